"""The Gluon launches' host side on a CPU (``tileattn.gpu.hopper``): the TMA descriptors kept per
(shape, strides, block, dtype), the alignment rule, the launch kept per constexprs and argument
classes, the launches a call signature keeps (``GluonLaunch``), the Hopper rules asked in two
parts (once per signature, the rest per call) and which forward calls store their output through
TMA copies (``TMA_STORE``, with a descriptor of ``out``). The kernels' values are checked on the GPU
(tests/test_hopper_fwd.py, test_hopper_bwd.py)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tileattn.contract import AttnParams
from tileattn.gpu import hopper

BLOCKS = [(1, 64, 1, 128), (1, 128, 1, 64), (1, 32, 1, 4, 64)]


def constructed(t, block):
    """The descriptor as Triton's constructor makes (and validates) it."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), hopper._smem_layout(block, t.dtype))


def fields(desc):
    return {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc)}


def descriptor(t, block):
    """The descriptor a Gluon launch passes for base ``t``: kept fields, ``t`` as base."""
    return hopper._rebase(hopper._kept_fields(t, block), t)


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
            desc = descriptor(t, block)
            assert type(desc) is TensorDescriptor and desc.base is t
            assert fields(desc) == fields(constructed(t, block)) and desc == constructed(t, block), step
        heads_first = torch.randn(shape[0], shape[2], shape[1], *shape[3:]).to(dtype).transpose(1, 2)
        desc = descriptor(heads_first, block)
        assert desc.strides == list(heads_first.stride()) and fields(desc) == fields(constructed(heads_first, block))


def test_kept_descriptor_fields_hold_no_tensor_and_check_alignment():
    """The kept fields do not keep the first tensor alive; a later base that is not 16-byte
    aligned raises as the constructor does."""
    hopper._DESCRIPTOR_FIELDS.clear()
    block = BLOCKS[0]
    t = torch.randn(1, 64, 2, 128).to(torch.bfloat16)
    descriptor(t, block)
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None, "the kept fields hold the first tensor"
    flat = torch.empty(64 * 2 * 128 + 8, dtype=torch.bfloat16)
    odd = flat[1:1 + 64 * 2 * 128].view(1, 64, 2, 128)  # 2 bytes past an aligned start
    assert odd.data_ptr() % 16 and hopper._pointers_reason(odd) and not hopper._strides_reason(odd)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        constructed(odd, block)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        descriptor(odd, block)


def test_descriptor_fields_are_forgotten_when_full(monkeypatch):
    monkeypatch.setattr(hopper, "_MAX_DESCRIPTORS", 2)
    hopper._DESCRIPTOR_FIELDS.clear()
    for n in (64, 128, 192):
        descriptor(torch.empty(1, n, 2, 128, dtype=torch.bfloat16), BLOCKS[0])
    assert len(hopper._DESCRIPTOR_FIELDS) == 1


def test_tma_rule_on_strides_and_alignment():
    """The base 16-byte aligned (``_pointers_reason``, asked per call) and every stride but the last a
    multiple of 16 bytes (``_strides_reason``, fixed by a signature)."""
    def rule(t):
        return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])

    base = torch.empty(4096, dtype=torch.bfloat16)
    views = [base[:2048].view(2, 16, 64), base[:2040].view(3, 680), base[8:8 + 2048].view(2, 16, 64),
             base[1:1 + 2048].view(2, 16, 64), base.view(64, 64)[:, :60], base.view(64, 64)[:, 4:60],
             torch.empty(3, 5, 8, dtype=torch.float32), torch.empty(3, 4, 8, dtype=torch.float32),
             base[:2046].view(3, 682), torch.empty(3, 5, 3, dtype=torch.float32)]  # strides of 1364 and 12 bytes
    assert [not (hopper._strides_reason(t) or hopper._pointers_reason(t)) for t in views] == [rule(t) for t in views]
    assert hopper._pointers_reason(*views) and hopper._strides_reason(*views)
    assert any(rule(t) for t in views) and not all(rule(t) for t in views)


class _Record:
    """Stands in for a Gluon kernel: ``kernel[grid](*args, **kwargs)`` records (nothing compiled)."""

    arg_names, params, do_not_specialize = ["x", "n"], [], []

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_launch_of_keeps_one_launch_per_constexprs_and_classes():
    """Calls with the same constexprs and argument classes share a ``Launch``; a constexpr's value
    or an argument's class makes another. Each launch gets the register split and its options.
    (A launcher called once per call, as ``hopper_attn_fwd``, makes a ``GluonLaunch`` per call.)"""
    kernel = _Record()
    x = torch.empty(4)
    for n in (32, 48):  # both divisible by 16: one class
        hopper.GluonLaunch(kernel, (1, 1, 1), dict(A=1, B=True), (None,), (n,))(x)
    hopper.GluonLaunch(kernel, (1, 1, 1), dict(A=1, B=True), (None,), (33,))(x)
    hopper.GluonLaunch(kernel, (1, 1, 1), dict(A=2, B=True), (None,), (32,))(x)
    launches = {id(v): v for k, v in hopper._GLUON_LAUNCHES.items() if k[0] is kernel}
    assert len(launches) == 3 and len(kernel.launches) == 4
    assert all(kw == dict(A=kw["A"], B=True, CONSUMER_REGS=hopper.CONSUMER_REGS,
                          PRODUCER_REGS=hopper.PRODUCER_REGS, num_warps=4, maxnreg=hopper.MAXNREG)
               for _, _, kw in kernel.launches)
    assert [args[1] for _, args, _ in kernel.launches] == [32, 48, 33, 32]


class _DescRecord(_Record):
    arg_names = ["desc", "out", "sink", "n", "scale"]


def test_gluon_launch_keeps_classes_and_descriptors(monkeypatch):
    """A kept ``GluonLaunch`` (a prepared signature's) works its argument classes out once and later
    calls launch with the ``Launch`` a fresh lookup gives and the arguments a fresh one-shot launch
    passes: each call's descriptor (its own base, the constructor's fields) and tensors, the kept
    numbers. A later base that is not 16-byte aligned still raises as the constructor does."""
    kernel, block = _DescRecord(), (1, 64, 1, 128)
    counted = []
    real = hopper.arg_classes
    monkeypatch.setattr(hopper, "arg_classes", lambda fn, args: counted.append(1) or real(fn, args))
    kept = hopper.GluonLaunch(kernel, (7, 1, 1), dict(A=1), (block, None, None), (48, 0.5))
    flat = torch.empty(64 * 2 * 128 + 8, dtype=torch.bfloat16)
    for step in range(3):
        t, out = torch.randn(1, 64, 2, 128).to(torch.bfloat16), torch.empty(3)
        kept(t, out, None)
        fresh = hopper.GluonLaunch(kernel, (7, 1, 1), dict(A=1), (block, None, None), (48, 0.5))
        fresh(t, out, None)
        (g1, got, kw1), (g2, expect, kw2) = kernel.launches[-2:]
        assert (g1, kw1) == (g2, kw2) and got[0].base is t and got[1] is out and got[2] is None
        assert fields(got[0]) == fields(expect[0]) == fields(constructed(t, block)) and got[1:] == expect[1:]
        assert kept.launch is fresh.launch
    assert len(counted) == 1 + 3, "the kept launch asked arg_classes again"
    odd = flat[1:1 + 64 * 2 * 128].view(1, 64, 2, 128)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        kept(odd, torch.empty(3), None)


def _cases():
    """(q, k, v, dout, params, options) for the rules: prefill shapes the Gluon kernels take and
    variants that each break one condition (dtype, head dim, rows, options,
    an empty batch, strides, a pointer, a cache, splits)."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape).to(dtype)

    flat = torch.empty(1 * 256 * 2 * 64 + 8, dtype=torch.bfloat16)
    odd = flat[1:1 + 256 * 2 * 64].view(1, 256, 2, 64)  # a base 2 bytes past alignment
    wide = t(1, 256, 2, 65)[..., :64]  # head strides of 130 bytes
    q, kv = t(1, 256, 2, 64), t(1, 300, 1, 64)
    plain, causal = AttnParams(0.125, -1, -1), AttnParams(0.125, -1, 0)
    yield q, kv, kv, q, plain, {}
    yield q, kv, kv, q, causal, {}  # short and causal at head dim 64: the Gluon kernels' since 2026-12-01
    yield t(1, 256, 2, 128), t(1, 300, 1, 128), t(1, 300, 1, 128), t(1, 256, 2, 128), causal, {}
    yield q.float(), kv.float(), kv.float(), q.float(), plain, {}
    yield t(1, 256, 2, 96), t(1, 300, 1, 96), t(1, 300, 1, 96), t(1, 256, 2, 96), plain, {}
    yield q[:, :64], kv, kv, q[:, :64], plain, {}
    yield q[:0], kv[:0], kv[:0], q[:0], plain, {}
    yield q, kv, kv, q, AttnParams(0.125, -1, -1, softcap=5.0), {}
    yield q, kv, kv, q, plain, dict(alibi_slopes=torch.ones(2))
    yield q, kv, kv, odd, plain, {}
    yield odd, kv, kv, q, plain, {}
    yield wide, kv, kv, q, plain, {}
    yield q, kv, kv, wide, plain, {}
    yield q, kv, kv, q, plain, dict(paged=True)
    yield q, kv, kv, q, plain, dict(num_splits=2)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_rules_equal_their_two_parts(monkeypatch, switch):
    """The forward's and the backward's Hopper rule say yes exactly where the part a signature
    fixes (``fwd_signature_reason``, ``bwd_signature_reason``: shapes, dtypes, strides, options,
    the device) and the part a call can change (``call_reason``: the environment's switches, the
    pointers) both do, and give one of the parts' phrases. The device is stood in for as an H200
    (not Triton's interpreter); with ``TILEATTN_HOPPER=0`` both rules say no."""
    from tileattn.gpu import hopper_bwd

    for module in (hopper, hopper_bwd):
        monkeypatch.setattr(module, "device_kind_reason", lambda q: None)
    monkeypatch.setattr(hopper, "interpreting", lambda: False)
    monkeypatch.setenv("TILEATTN_HOPPER", switch)
    device = None if switch == "1" else "TILEATTN_HOPPER=0"
    yes = {"fwd": 0, "bwd": 0}
    for q, k, v, dout, params, opts in _cases():
        fwd_opts = dict(alibi_slopes=opts.get("alibi_slopes"), varlen=False, paged=opts.get("paged", False),
                        seqused_k=None, num_splits=opts.get("num_splits", 1))
        whole = hopper.hopper_fwd_reason(q, k, v, params, **fwd_opts)
        parts = hopper.fwd_signature_reason(q, k, v, params, **fwd_opts), hopper.call_reason(q, k, v)
        assert (whole is None) == (parts == (None, None)) and whole in (*parts, None), (whole, parts)
        yes["fwd"] += whole is None
        if opts.get("paged") or opts.get("num_splits"):
            continue
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        bwd_opts = dict(alibi_slopes=opts.get("alibi_slopes"))
        whole = hopper_bwd.hopper_bwd_reason(dout, q, k, v, dq, dk, dv, params, **bwd_opts)
        parts = (hopper_bwd.bwd_signature_reason(dout, q, k, v, dq, dk, dv, params, **bwd_opts),
                 hopper.call_reason(q, k, v, dout))
        assert (whole is None) == (parts == (None, None)) and whole in (*parts, None), (whole, parts)
        yes["bwd"] += whole is None
    assert yes == ({"fwd": 5, "bwd": 4} if device is None else {"fwd": 0, "bwd": 0})


@pytest.fixture
def fwd_launches(monkeypatch):
    """The forward's Gluon launches recorded instead of compiled: (constexprs, kernel arguments)
    each, the descriptors as ``GluonLaunch`` makes them (kept fields, each call's bases)."""
    launches = []
    monkeypatch.setattr(hopper, "launch_of", lambda kernel, args, constexprs:
                        lambda grid, *args: launches.append((constexprs, args)))
    hopper._DESCRIPTOR_FIELDS.clear()
    return launches


def _dense(batch, seqlen, heads, head_dim, dtype=torch.bfloat16):
    return tuple(torch.randn(batch, seqlen, heads, head_dim).to(dtype) for _ in range(3))


def _assert_out_descriptor(args, out):
    """The launch's output descriptor: over ``out`` itself (base, shape, strides: TMA then clips the
    last block's rows at seqlen_q and writes nothing outside the view), in [1, 64, 1, D] tiles, with
    the fields Triton's constructor gives it; the pointer argument is ``out`` too."""
    desc, block = args[3], (1, hopper.ROWS_WG, 1, out.shape[-1])
    assert type(desc) is TensorDescriptor and desc.base is out and args[4] is out
    assert desc.shape == list(out.shape) and desc.strides == list(out.stride()) and desc.block_shape == list(block)
    assert fields(desc) == fields(constructed(out, block))


def test_tma_store_head_dims():
    """hdims 64 and 128 store through TMA (both measured faster on the H200); 256's staging tiles
    would not fit in shared memory."""
    assert hopper.TMA_STORE_HEAD_DIMS == (64, 128)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [256, 1000])
def test_dense_forward_stores_through_tma(fwd_launches, head_dim, causal, seqlen_q):
    """A dense 16-bit call at head dims 64 and 128: the ``TMA_STORE`` flag and a descriptor of
    ``out`` (B, S, H, D); at 1000 rows, not a multiple of 64, the descriptor's row bound is 1000,
    so the last warpgroup's rows 1000-1023 are clipped."""
    q, k, v = _dense(2, seqlen_q, 4, head_dim)
    out, lse = torch.empty_like(q), torch.empty(2, 4, seqlen_q)
    hopper.hopper_attn_fwd(q, k, v, out, lse, params=AttnParams(head_dim**-0.5, -1, 0 if causal else -1))
    [(constexprs, args)] = fwd_launches
    assert constexprs["TMA_STORE"] and constexprs["QPACK"] == 1 and not constexprs["IS_VARLEN"]
    _assert_out_descriptor(args, out)
    assert args[3].shape[1] == seqlen_q
    assert args[0].base is q and args[0].block_shape == args[3].block_shape  # q's tiles and out's alike


@pytest.mark.parametrize("view", ["heads first", "narrower", "rows of a longer one"])
def test_strided_out_views_store_through_tma(fwd_launches, view):
    """``out`` views with TMA-writable strides take the flag with their own strides and bounds: a
    (B, H, S, D) buffer seen as (B, S, H, D), the first 64 of 72 columns, 300 rows of 512."""
    q, k, v = _dense(2, 300, 4, 64)
    out = {"heads first": torch.empty(2, 4, 300, 64, dtype=torch.bfloat16).transpose(1, 2),
           "narrower": torch.empty(2, 300, 4, 72, dtype=torch.bfloat16)[..., :64],
           "rows of a longer one": torch.empty(2, 512, 4, 64, dtype=torch.bfloat16)[:, 100:400]}[view]
    hopper.hopper_attn_fwd(q, k, v, out, torch.empty(2, 4, 300), params=AttnParams(0.125, -1, 0))
    [(constexprs, args)] = fwd_launches
    assert constexprs["TMA_STORE"] and out.data_ptr() % 16 == 0
    _assert_out_descriptor(args, out)


def _store_from_registers(launch, out):
    constexprs, args = launch
    assert not constexprs["TMA_STORE"] and args[3] is None and args[4] is out


@pytest.mark.parametrize("case", ["hdim 256", "fp32 out", "fp16 out for bf16", "head stride of 136 bytes",
                                  "unit stride not last"])
def test_dense_forward_stores_from_registers(fwd_launches, case):
    """Dense calls the rule leaves out store from registers, with None for the descriptor: head
    dim 256 (its staging tiles would not fit), an out of another dtype, strides a descriptor
    cannot take."""
    head_dim = 256 if case == "hdim 256" else 64
    q, k, v = _dense(1, 256, 2, head_dim)
    out = {"fp32 out": torch.empty(q.shape), "fp16 out for bf16": torch.empty(q.shape, dtype=torch.float16),
           "head stride of 136 bytes": torch.empty(1, 256, 2, 68, dtype=torch.bfloat16)[..., :64],
           "unit stride not last": torch.empty(1, 256, 64, 2, dtype=torch.bfloat16).transpose(2, 3)}.get(
               case, torch.empty_like(q))
    hopper.hopper_attn_fwd(q, k, v, out, torch.empty(1, 2, 256), params=AttnParams(head_dim**-0.5, -1, -1))
    [launch] = fwd_launches
    _store_from_registers(launch, out)


def test_kept_forward_falls_back_for_an_unaligned_out(fwd_launches):
    """A kept launch (a prepared signature's ``HopperFwd``) that stores through TMA: a later call
    whose ``out`` is not 16-byte aligned stores from registers (a launch of its own), the next
    aligned one through TMA again, each with its own base."""
    q, k, v = _dense(1, 256, 2, 64)
    fwd = hopper.HopperFwd(AttnParams(0.125, -1, -1))
    flat = torch.empty(256 * 2 * 64 + 8, dtype=torch.bfloat16)
    outs = [torch.empty_like(q), flat[1:1 + 256 * 2 * 64].view(q.shape), torch.empty_like(q)]
    for out in outs:
        fwd(q, k, v, out, torch.empty(1, 2, 256))
    assert fwd.tma_store and [c["TMA_STORE"] for c, _ in fwd_launches] == [True, False, True]
    _assert_out_descriptor(fwd_launches[0][1], outs[0])
    _store_from_registers(fwd_launches[1], outs[1])
    _assert_out_descriptor(fwd_launches[2][1], outs[2])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", ["dense", "varlen", "paged partials"])
def test_double_q_buffers_at_head_dim_64(fwd_launches, head_dim, kind):
    """Two pairs of Q buffers (``Q_BUFS`` 2) at head dim 64 for every kind of call, one pair at 128
    and 256, where the second pair would not fit in shared memory (2 x 16 KB and 2 x 32 KB more)."""
    assert hopper.DOUBLE_Q_HEAD_DIMS == (64,)
    q, k, v = _dense(1, 256, 4, head_dim)
    if kind == "dense":
        hopper.hopper_attn_fwd(q, k, v, torch.empty_like(q), torch.empty(1, 4, 256),
                               params=AttnParams(head_dim**-0.5, -1, 0))
    elif kind == "varlen":
        cu = torch.tensor([0, 100, 256], dtype=torch.int32)
        hopper.hopper_attn_fwd(q[0], k[0], v[0], torch.empty_like(q[0]), torch.empty(4, 256),
                               params=AttnParams(head_dim**-0.5, -1, 0), cu_seqlens_q=cu, cu_seqlens_k=cu,
                               max_seqlen_q=156, max_seqlen_k=156)
    else:
        pool = torch.randn(40, 16, 4, head_dim).to(torch.bfloat16)
        table = torch.randperm(40)[:32].view(1, 32).to(torch.int32)
        hopper.hopper_attn_partials(q, pool, pool, torch.empty(2, 1, 256, 4, head_dim), torch.empty(2, 1, 4, 256),
                                    params=AttnParams(head_dim**-0.5), block_table=table,
                                    seqused_k=torch.tensor([500], dtype=torch.int32), max_seqlen_k=512)
    [(constexprs, _)] = fwd_launches
    assert constexprs["Q_BUFS"] == (2 if head_dim == 64 else 1)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_forward_stores_from_registers(fwd_launches, head_dim):
    """Packed sequences store from registers: a tile past a sequence's end would overwrite the next
    sequence's rows (TMA clips only at the packed tensor's bounds)."""
    q, k, v = (torch.randn(600, 4, head_dim).to(torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 250, 600], dtype=torch.int32)
    out = torch.empty_like(q)
    hopper.hopper_attn_fwd(q, k, v, out, torch.empty(4, 600), params=AttnParams(head_dim**-0.5, -1, 0),
                           cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=350, max_seqlen_k=350)
    [(constexprs, args)] = fwd_launches
    assert constexprs["IS_VARLEN"]
    _store_from_registers((constexprs, args), out)


@pytest.mark.parametrize("head_dim, group, splits", [(64, 4, 4), (64, 1, 1), (128, 8, 2)])
def test_partials_store_from_registers(fwd_launches, head_dim, group, splits):
    """Split partials over a paged pool (QPACK query heads a row group, fp32 partials laid out
    (splits, 1, rows, heads, dim)) store from registers, one split or several."""
    q = torch.randn(1, 64, 8, head_dim).to(torch.bfloat16)
    pool = torch.randn(40, 16, 8 // group, head_dim).to(torch.bfloat16)
    table = torch.randperm(40)[:32].view(1, 32).to(torch.int32)
    o_parts, lse_parts = torch.empty(splits, 1, 64, 8, head_dim), torch.empty(splits, 1, 8, 64)
    hopper.hopper_attn_partials(q, pool, pool, o_parts, lse_parts, params=AttnParams(head_dim**-0.5),
                                block_table=table, seqused_k=torch.tensor([500], dtype=torch.int32), max_seqlen_k=512)
    [(constexprs, args)] = fwd_launches
    assert constexprs["QPACK"] == group and constexprs["PAGE"] == 16
    _store_from_registers((constexprs, args), o_parts)


def test_launch_refuses_a_tma_store_it_cannot_make():
    """``_fwd_launch`` asserts the output descriptor only comes with dense, unpacked, unsplit calls."""
    q, k, _ = _dense(1, 256, 8, 64)
    for extra in (dict(qpack=4), dict(num_splits=2), dict(cu_seqlens_q=torch.zeros(2, dtype=torch.int32))):
        with pytest.raises(AssertionError):
            hopper._fwd_launch(q, k, (0, 0, 0, 0), (0, 0, 0, 0), AttnParams(0.125), 1, 256, 256, 1, 128, 3,
                               o_block=(1, 64, 1, 64), **extra)


COUNTER = 11  # the position of the forward kernel's Counter argument


@pytest.mark.parametrize("dynamic_on", [True, False])
def test_causal_grid_rule(monkeypatch, dynamic_on):
    """``_causal_grid``: with the dynamic schedule, dense causal calls in groups of DYNAMIC_MIN_GROUP
    (12) pairs or more run persistent and fetch their items dynamically where they outnumber the
    programs; without it, the static rule (PERSISTENT_MIN_GROUP, 24) as before."""
    monkeypatch.setattr(hopper, "DYNAMIC_SCHEDULE", dynamic_on)
    rule = hopper._causal_grid
    assert (hopper.PERSISTENT_MIN_GROUP, hopper.DYNAMIC_MIN_GROUP) == (24, 12)
    assert rule(2048, 132, 24) == rule(2048, 132, 48) == (132, dynamic_on)
    assert rule(2048, 132, 12) == ((132, True) if dynamic_on else (2048, False))
    assert rule(2048, 132, 1) == (2048, False)
    assert rule(100, 132, 24) == (100, False)  # no more items than programs: nothing to fetch
    assert rule(133, 132, 24) == (132, dynamic_on)


# (head dim, seqlen, causal) -> (programs, DYNAMIC) at 16k tokens a batch, 2048 // head dim heads, 132 SMs
_GRIDS = {(128, 1024, True): (132, True), (128, 2048, True): (132, True), (128, 4096, True): (132, True),
          (128, 8192, True): (2048, False),  # groups of one pair: one program per item
          (64, 1024, True): (132, True), (64, 2048, True): (132, True), (64, 4096, True): (132, True),
          (64, 8192, True): (132, True), (128, 2048, False): (132, False), (64, 8192, False): (132, False)}


@pytest.mark.parametrize("cell", sorted(_GRIDS))
def test_forward_schedule_per_cell(cell):
    """The benchmark cells (docs/perf-notes.md's table): which run persistent and which fetch their
    items dynamically, worked out by the launcher from meta tensors (nothing launched)."""
    head_dim, seqlen, causal = cell
    heads, batch = 2048 // head_dim, 16384 // seqlen
    q = torch.empty(batch, seqlen, heads, head_dim, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(batch, heads, seqlen, device="meta")
    launch = hopper.HopperFwd(AttnParams(head_dim**-0.5, -1, 0 if causal else -1))._launch(q, q, q, q, lse, None, None)
    assert (launch.grid[0], launch.constexprs["DYNAMIC"]) == _GRIDS[cell]


@pytest.mark.parametrize("case", ["window", "varlen", "sink", "gqa"])
def test_dynamic_schedule_only_dense_causal(case):
    """Windows and packed sequences keep one program per item and no counter; sinks and GQA on a
    dense causal call take the dynamic schedule like any other."""
    q = torch.empty(8, 2048, 16, 128, dtype=torch.bfloat16, device="meta")
    kv = q[:, :, :4] if case == "gqa" else q
    lse = torch.empty(8, 16, 2048, device="meta")
    params = AttnParams(128**-0.5, 127 if case == "window" else -1, 0)
    fwd = hopper.HopperFwd(params, 2048, 2048)
    if case == "varlen":
        packed = q.view(1, -1, 16, 128)
        cu = torch.arange(0, 8 * 2048 + 1, 2048, dtype=torch.int32, device="meta")
        launch = fwd._launch(packed, packed, packed, packed[0], torch.empty(16, 8 * 2048, device="meta"), None, cu)
    else:
        sink = torch.empty(16, device="meta") if case == "sink" else None
        launch = fwd._launch(q, kv, kv, q, lse, sink, None)
    dynamic = case in ("sink", "gqa")
    assert launch.constexprs["DYNAMIC"] == dynamic and (launch.grid[0] == 132) == dynamic


@pytest.fixture
def fwd_runs(monkeypatch):
    """The forward's launches recorded with their grids, each launch's counter then bumped as the
    kernel would leave it (so a counter reused by a later call would show)."""
    runs = []

    def launch_of(kernel, args, constexprs):
        def run(grid, *args):
            runs.append((constexprs, grid, args))
            if args[COUNTER] is not None:
                args[COUNTER].add_(1000)
        return run

    monkeypatch.setattr(hopper, "launch_of", launch_of)
    monkeypatch.setattr(hopper, "_sms", lambda q: 4)  # 4 programs, 3 x 2 x 4 = 24 causal items
    monkeypatch.setattr(hopper, "ORDER_MIN_GROUP", 1)
    monkeypatch.setattr(hopper, "DYNAMIC_MIN_GROUP", 1)  # the 8 pairs are one group
    hopper._DESCRIPTOR_FIELDS.clear()
    return runs


def _assert_fresh_counters(runs, device):
    counters = [args[COUNTER] for _, _, args in runs]
    for i, (constexprs, grid, args) in enumerate(runs):
        assert constexprs["DYNAMIC"] and grid == (4, 1, 1)
        counter = args[COUNTER]
        assert counter.dtype == torch.int32 and counter.shape == (1,) and counter.device == device
        assert int(counter) == 1000, "the counter was not zero at its launch"
        assert all(counter is not other for other in counters[:i])


def test_each_call_gets_a_fresh_zeroed_counter(fwd_runs):
    """One-shot calls (``hopper_attn_fwd``) and a kept launch (``HopperFwd``, a prepared signature's):
    every dynamic launch gets its own int32 counter, zero when launched; a flag-off call gets None."""
    q, k, v = _dense(2, 300, 4, 128)
    params = AttnParams(128**-0.5, -1, 0)
    for _ in range(2):
        hopper.hopper_attn_fwd(q, k, v, torch.empty_like(q), torch.empty(2, 4, 300), params=params)
    fwd = hopper.HopperFwd(params)
    for _ in range(3):
        fwd(q, k, v, torch.empty_like(q), torch.empty(2, 4, 300))
    assert fwd.dynamic and fwd.launch.constexprs["DYNAMIC"] and len(fwd_runs) == 5
    _assert_fresh_counters(fwd_runs, q.device)
    hopper.hopper_attn_fwd(q, k, v, torch.empty_like(q), torch.empty(2, 4, 300), params=AttnParams(128**-0.5))
    constexprs, grid, args = fwd_runs[-1]
    assert not constexprs["DYNAMIC"] and args[COUNTER] is None


def test_kept_launch_fallback_keeps_the_counter(fwd_runs):
    """A kept dynamic launch whose later ``out`` is not 16-byte aligned stores from registers (a launch
    of its own): still dynamic, with a fresh counter."""
    q, k, v = _dense(2, 300, 4, 64)
    fwd = hopper.HopperFwd(AttnParams(0.125, -1, 0))
    flat = torch.empty(q.numel() + 8, dtype=torch.bfloat16)
    for out in (torch.empty_like(q), flat[1:1 + q.numel()].view(q.shape), torch.empty_like(q)):
        fwd(q, k, v, out, torch.empty(2, 4, 300))
    assert [c["TMA_STORE"] for c, _, _ in fwd_runs] == [True, False, True]
    _assert_fresh_counters(fwd_runs, q.device)


def test_partials_take_no_counter(fwd_launches):
    q = torch.randn(1, 64, 8, 128).to(torch.bfloat16)
    pool = torch.randn(40, 16, 2, 128).to(torch.bfloat16)
    table = torch.randperm(40)[:32].view(1, 32).to(torch.int32)
    o_parts, lse_parts = torch.empty(2, 1, 64, 8, 128), torch.empty(2, 1, 8, 64)
    hopper.hopper_attn_partials(q, pool, pool, o_parts, lse_parts, params=AttnParams(128**-0.5), block_table=table,
                                seqused_k=torch.tensor([500], dtype=torch.int32), max_seqlen_k=512)
    [(constexprs, args)] = fwd_launches
    assert not constexprs["DYNAMIC"] and args[COUNTER] is None and type(args[COUNTER + 1]) is int  # strides follow


def _heads_first(batch, seqlen, heads, head_dim, *, packed=False):
    """A (B, S, H, D) (packed: (T, H, D)) bf16 view of a heads-first buffer on the meta device: its
    heads lie S * D elements apart (nothing allocated)."""
    base = torch.empty(0, dtype=torch.bfloat16, device="meta")
    if packed:
        return base.as_strided((seqlen, heads, head_dim), (head_dim, seqlen * head_dim, 1))
    return base.as_strided((batch, seqlen, heads, head_dim),
                           (heads * seqlen * head_dim, head_dim, seqlen * head_dim, 1))


@pytest.mark.parametrize("case", ["dense hdim 256", "dense hdim 128", "packed", "lse"])
def test_forward_rule_refuses_outputs_whose_head_offsets_wrap_int32(monkeypatch, case):
    """The Gluon forward's register store and lse store compute a head's offset as ``h * stride`` in
    int32 (kernels/attn_fwd_hopper.py, ``o_row``, ``l_row``): an ``out=`` view of a heads-first buffer
    whose last head starts 2**31 elements in or more (here the 32nd, 2**27 apart) wraps, writes out of bounds on
    the GPU. The rule sends such calls to the portable kernel (int64 offsets); the contiguous outputs of
    the same shapes, and a last head just inside int32, stay on the Gluon kernel. (The TMA
    store's descriptor has no such product, but a kept launch stores from registers when a later
    ``out`` is not 16-byte aligned, so every head dim is covered.)"""
    monkeypatch.setattr(hopper, "device_kind_reason", lambda q: None)
    monkeypatch.setattr(hopper, "interpreting", lambda: False)
    monkeypatch.setenv("TILEATTN_HOPPER", "1")
    heads, packed = 32, case == "packed"
    head_dim = 128 if case in ("dense hdim 128", "packed") else 256
    seqlen = 2**27 // head_dim  # heads 2**27 elements apart: 31 x 2**27 > 2**31
    meta = dict(dtype=torch.bfloat16, device="meta")
    q = torch.empty((seqlen, heads, head_dim) if packed else (1, seqlen, heads, head_dim), **meta)
    lse = torch.empty((heads, seqlen) if packed else (1, heads, seqlen), device="meta")
    out = _heads_first(1, seqlen, heads, head_dim, packed=packed)
    if case == "lse":  # an lse (B, H, S) whose heads lie 2**27 elements apart: a view of a wider buffer
        out, lse = torch.empty_like(q), torch.empty(0, device="meta").as_strided((1, heads, seqlen), (0, 2**27, 1))
    opts = dict(alibi_slopes=None, varlen=packed, paged=False, seqused_k=None, num_splits=1,
                max_seqlen_q=seqlen if packed else 0)
    params = AttnParams(head_dim**-0.5, -1, 0)
    assert hopper.hopper_fwd_reason(q, q, q, params, **opts) is None  # the outputs not given: q, k, v pass
    assert hopper.hopper_fwd_reason(q, q, q, params, **opts, out=out, lse=lse) == "output head offsets past int32"
    assert hopper.fwd_signature_reason(q, q, q, params, **opts, out=out, lse=lse) == "output head offsets past int32"
    contiguous = torch.empty_like(q), torch.empty(lse.shape, device="meta")
    assert hopper.hopper_fwd_reason(q, q, q, params, **opts, out=contiguous[0], lse=contiguous[1]) is None
    # heads (2**31 - 1) // 31 elements apart: the last head's offset just inside int32
    edge = torch.empty(0, **meta).as_strided(q.shape, (*q.stride()[:-2], (2**31 - 1) // (heads - 1), 1))
    assert hopper.hopper_fwd_reason(q, q, q, params, **opts, out=edge, lse=contiguous[1]) is None


def test_attn_fwd_and_prepare_fwd_give_the_rule_their_outputs(monkeypatch):
    """``attn_fwd`` and ``prepare_fwd`` hand the outputs to the forward's Hopper rule (an ``out=``
    view reaches ``attn_fwd`` as it is), so the output check above runs on the calls it guards."""
    from tileattn.gpu import attention, prepared

    seen = []

    class Stop(Exception):
        pass

    def rule(*args, **kwargs):
        seen.append(kwargs)
        raise Stop

    monkeypatch.setattr(attention, "hopper_fwd_reason", rule)
    monkeypatch.setattr(prepared, "fwd_signature_reason", rule)
    plan = attention.FwdPlan.__new__(attention.FwdPlan)
    plan.long, plan.fwd = None, object()  # a tuned plan of one launch: prepare_fwd then asks the rule
    monkeypatch.setattr(attention, "plan_fwd", lambda *a, **k: plan)
    q, k, v = _dense(1, 256, 2, 64)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 256)
    with pytest.raises(Stop):
        attention.attn_fwd(q, k, v, out, lse, params=AttnParams(0.125))
    assert seen[-1]["out"] is out and seen[-1]["lse"] is lse
    with pytest.raises(Stop):
        prepared.prepare_fwd(q, k, v, out, lse, params=AttnParams(0.125), alibi_slopes=None, max_seqlen_q=256,
                             max_seqlen_k=256, seqused_k=None, block_table=None, num_splits=1, learnable_sink=None,
                             k_descale=None)
    assert len(seen) == 2 and seen[-1]["out"] is out and seen[-1]["lse"] is lse


def test_s_ahead_head_dims():
    """The key tiles go in pairs with the S product one tile ahead (``S_AHEAD``) at head dim 64 (docs/
    perf-notes.md, 2026-12-02 04:49): the second score tile in flight fits its registers there."""
    assert hopper.S_AHEAD_HEAD_DIMS == (64,)


@pytest.mark.parametrize("flag", ["S_AHEAD", "KV_BAR"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dims", [(), (64, 128, 256)])
def test_loop_flags_follow_head_dims(fwd_launches, monkeypatch, flag, head_dim, dims):
    """``S_AHEAD`` and ``KV_BAR`` are each set from their launcher tuple (``S_AHEAD_HEAD_DIMS``,
    ``KV_BAR_HEAD_DIMS``) alone, for a dense call (unmasked and causal), a packed one and the split
    partials over a paged pool."""
    monkeypatch.setattr(hopper, f"{flag}_HEAD_DIMS", dims)
    q, k, v = _dense(1, 256, 2, head_dim)
    for right in (-1, 0):
        hopper.hopper_attn_fwd(q, k, v, torch.empty_like(q), torch.empty(1, 2, 256),
                               params=AttnParams(head_dim**-0.5, -1, right))
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    hopper.hopper_attn_fwd(q[0], k[0], v[0], torch.empty_like(q[0]), torch.empty(2, 256),
                           params=AttnParams(head_dim**-0.5, -1, 0), cu_seqlens_q=cu, cu_seqlens_k=cu,
                           max_seqlen_q=156, max_seqlen_k=156)
    pool = torch.randn(40, 16, 2, head_dim).to(torch.bfloat16)
    table = torch.randperm(40)[:32].view(1, 32).to(torch.int32)
    hopper.hopper_attn_partials(q[:, :64], pool, pool, torch.empty(2, 1, 64, 2, head_dim), torch.empty(2, 1, 2, 64),
                                params=AttnParams(head_dim**-0.5), block_table=table,
                                seqused_k=torch.tensor([500], dtype=torch.int32), max_seqlen_k=512)
    assert [c[flag] for c, _ in fwd_launches] == [head_dim in dims] * 4


def test_kv_bar_head_dims():
    """A ring slot's K and V share one pair of barriers (``KV_BAR``) at head dim 64 alone (measured there:
    docs/perf-notes.md, 2026-12-02 10:00), with 4 stages there; with ``S_AHEAD`` the kernel needs 3 stages
    (its static assertion), so every head dim with both flags has them."""
    assert hopper.KV_BAR_HEAD_DIMS == (64,)
    assert hopper.HOPPER_TILES[64][1] == 4
    for head_dim in set(hopper.KV_BAR_HEAD_DIMS) & set(hopper.S_AHEAD_HEAD_DIMS):
        assert hopper.HOPPER_TILES[head_dim][1] >= 3, head_dim
