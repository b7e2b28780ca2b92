"""The Gluon launches' host side on a CPU (``tileattn.gpu.hopper``): the TMA descriptors kept per
(shape, strides, block, dtype), the alignment rule, the launch kept per constexprs and argument
classes. The kernels' values are checked on the GPU (tests/test_hopper_fwd.py, test_hopper_bwd.py)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tileattn.gpu import hopper

BLOCKS = [(1, 64, 1, 128), (1, 128, 1, 64), (1, 32, 1, 4, 64)]


def constructed(t, block):
    """The descriptor as Triton's constructor makes (and validates) it."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), hopper._smem_layout(block, t.dtype))


def fields(desc):
    return {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kept_descriptors_equal_constructed_ones(dtype):
    """Every descriptor, the first of its (shape, strides, block, dtype) and the later copies, has
    the fields Triton's constructor gives it, with its own tensor as the base; views with other
    strides get their own."""
    hopper._DESCRIPTOR_FIELDS.clear()
    for block in BLOCKS:
        shape = (2, 96, 4, 128) if len(block) == 4 else (2, 96, 2, 4, 64)
        for step in range(3):
            t = torch.randn(shape).to(dtype)
            desc = hopper._descriptor(t, block)
            assert type(desc) is TensorDescriptor and desc.base is t
            assert fields(desc) == fields(constructed(t, block)) and desc == constructed(t, block), step
        heads_first = torch.randn(shape[0], shape[2], shape[1], *shape[3:]).to(dtype).transpose(1, 2)
        desc = hopper._descriptor(heads_first, block)
        assert desc.strides == list(heads_first.stride()) and fields(desc) == fields(constructed(heads_first, block))


def test_kept_descriptor_fields_hold_no_tensor_and_check_alignment():
    """The kept fields do not keep the first tensor alive; a later base that is not 16-byte
    aligned raises as the constructor does."""
    hopper._DESCRIPTOR_FIELDS.clear()
    block = BLOCKS[0]
    t = torch.randn(1, 64, 2, 128).to(torch.bfloat16)
    hopper._descriptor(t, block)
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None, "the kept fields hold the first tensor"
    flat = torch.empty(64 * 2 * 128 + 8, dtype=torch.bfloat16)
    odd = flat[1:1 + 64 * 2 * 128].view(1, 64, 2, 128)  # 2 bytes past an aligned start
    assert odd.data_ptr() % 16 and not hopper._tma_ok(odd)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        constructed(odd, block)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        hopper._descriptor(odd, block)


def test_descriptor_fields_are_forgotten_when_full(monkeypatch):
    monkeypatch.setattr(hopper, "_MAX_DESCRIPTORS", 2)
    hopper._DESCRIPTOR_FIELDS.clear()
    for n in (64, 128, 192):
        hopper._descriptor(torch.empty(1, n, 2, 128, dtype=torch.bfloat16), BLOCKS[0])
    assert len(hopper._DESCRIPTOR_FIELDS) == 1


def test_tma_rule_on_strides_and_alignment():
    """``_tma_ok``: the base 16-byte aligned and every stride but the last a multiple of 16 bytes."""
    def rule(t):
        return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])

    base = torch.empty(4096, dtype=torch.bfloat16)
    views = [base[:2048].view(2, 16, 64), base[:2040].view(3, 680), base[8:8 + 2048].view(2, 16, 64),
             base[1:1 + 2048].view(2, 16, 64), base.view(64, 64)[:, :60], base.view(64, 64)[:, 4:60],
             torch.empty(3, 5, 8, dtype=torch.float32), torch.empty(3, 4, 8, dtype=torch.float32)]
    assert [hopper._tma_ok(t) for t in views] == [rule(t) for t in views]
    assert any(rule(t) for t in views) and not all(rule(t) for t in views)


class _Record:
    """Stands in for a Gluon kernel: ``kernel[grid](*args, **kwargs)`` records (nothing compiled)."""

    arg_names, params, do_not_specialize = ["x", "n"], [], []

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_launch_gluon_keeps_one_launch_per_constexprs_and_classes():
    """Calls with the same constexprs and argument classes share a ``Launch``; a constexpr's value
    or an argument's class makes another. Each launch gets the register split and its options."""
    kernel = _Record()
    x = torch.empty(4)
    for n in (32, 48):  # both divisible by 16: one class
        hopper.launch_gluon(kernel, (1, 1, 1), (x, n), dict(A=1, B=True))
    hopper.launch_gluon(kernel, (1, 1, 1), (x, 33), dict(A=1, B=True))
    hopper.launch_gluon(kernel, (1, 1, 1), (x, 32), dict(A=2, B=True))
    launches = {id(v): v for k, v in hopper._GLUON_LAUNCHES.items() if k[0] is kernel}
    assert len(launches) == 3 and len(kernel.launches) == 4
    assert all(kw == dict(A=kw["A"], B=True, CONSUMER_REGS=hopper.CONSUMER_REGS,
                          PRODUCER_REGS=hopper.PRODUCER_REGS, num_warps=4, maxnreg=hopper.MAXNREG)
               for _, _, kw in kernel.launches)
    assert [args[1] for _, args, _ in kernel.launches] == [32, 48, 33, 32]
