"""The Hopper backward's Python side, on a CPU: the rule that picks it, the way ``attn_bwd``
routes to it, and the launches its launcher makes (recorded, not run: Gluon kernels need the
GPU, where tests/test_hopper_bwd.py checks their values).
"""

from __future__ import annotations

import math

import pytest
import torch

from tileattn.contract import AttnParams
from tileattn.gpu import backward
from tileattn.gpu import hopper_bwd
from tileattn.kernels import attn_bwd_hopper


# the preprocess really runs (compiled on a GPU host, interpreted elsewhere): tensors where it can
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(batch=1, seqlen_q=70, seqlen_k=90, nheads=4, nheads_k=2, d=64, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q, dout, out = (torch.randn(batch, seqlen_q, nheads, d, generator=g).to(dtype) for _ in range(3))
    k, v = (torch.randn(batch, seqlen_k, nheads_k, d, generator=g).to(dtype) for _ in range(2))
    lse = torch.randn(batch, nheads, seqlen_q, generator=g) + 5
    return tuple(t.to(device) for t in (dout, q, k, v, out, lse))


def test_reason_names_the_switch_and_the_device(monkeypatch):
    dout, q, k, v, _, _ = _tensors()
    args = (dout, q, k, v, q, k, v, AttnParams(0.125, -1, -1))
    monkeypatch.setenv("TILEATTN_HOPPER", "0")
    assert hopper_bwd.hopper_bwd_reason(*args) == "TILEATTN_HOPPER=0"
    monkeypatch.delenv("TILEATTN_HOPPER")
    assert hopper_bwd.hopper_bwd_reason(*args) == "not a CUDA device"


def test_attn_bwd_routes_to_the_hopper_launcher(monkeypatch):
    """With the rule saying yes, attn_bwd runs the shared preprocess and hands its delta and
    lse2 to hopper_attn_bwd instead of launching the portable dK/dV and dQ kernels."""
    calls = []

    def fake(dout, q, k, v, dq, dk, dv, lse2, delta, **kwargs):
        calls.append((lse2.clone(), delta.clone(), kwargs))

    monkeypatch.setattr(backward, "hopper_bwd_reason", lambda *a, **kw: None)
    monkeypatch.setattr(backward, "hopper_attn_bwd", fake)
    backward.clear_plans()
    try:
        dout, q, k, v, out, lse = _tensors(device=DEV)
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        params = AttnParams(0.125, -1, 0)
        backward.attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, params=params)
    finally:
        backward.clear_plans()
    assert len(calls) == 1, "hopper_attn_bwd was not called exactly once"
    lse2, delta, kwargs = calls[0]
    assert kwargs["params"] == params and kwargs["cu_seqlens_q"] is None
    assert torch.allclose(lse2, lse * math.log2(math.e))
    assert torch.allclose(delta, (dout.float() * out.float()).sum(-1).transpose(1, 2), atol=1e-3)
    assert torch.isnan(dq).all() and torch.isnan(dk).all(), "the portable kernels ran as well"


class _Record:
    """Stands in for the Gluon kernel: ``kernel[grid](*args, **kwargs)`` records."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, dict(zip(self.kernel.arg_names, args)), kwargs))

    def __getattr__(self, name):  # arg_names, params, do_not_specialize: the launch path reads them
        return getattr(self.kernel, name)


@pytest.mark.parametrize("window, varlen", [((-1, -1), False), ((-1, 0), False), ((64, 0), False),
                                            ((-1, 0), True)])
def test_launches(monkeypatch, window, varlen):
    """``deterministic``: two launches, dK/dV in the transposed frame (rows = keys: lengths, window
    bounds and mask flags swapped; GROUP column passes) and dQ (rows = queries). Otherwise (head
    dim 128) the dK/dV launch alone, reducing dQ into an fp32 (tokens, heads x dim) workspace
    through a descriptor of half the columns."""
    record = _Record(attn_bwd_hopper._attn_bwd_hopper_kernel)
    monkeypatch.setattr(attn_bwd_hopper, "_attn_bwd_hopper_kernel", record)
    dout, q, k, v, _, _ = _tensors(batch=2, seqlen_q=300, seqlen_k=350, nheads=8, nheads_k=2, d=128)
    kwargs = {}
    if varlen:
        dout, q, k, v = (t.flatten(0, 1) for t in (dout, q, k, v))
        kwargs = dict(cu_seqlens_q=torch.tensor([0, 100, 600], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, 330, 700], dtype=torch.int32), max_seqlen_q=500,
                      max_seqlen_k=370)
    ws = torch.empty((8, 600) if varlen else (2, 8, 300))
    left, right = window
    params = AttnParams(0.1, left, right)
    hopper_bwd.hopper_attn_bwd(dout, q, k, v, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ws,
                               ws.clone(), params=params, deterministic=True, **kwargs)
    (grid_kv, args_kv, meta_kv), (grid_q, args_q, meta_q) = record.launches
    len_q, len_k = (500, 370) if varlen else (300, 350)
    assert grid_kv == (math.ceil(len_k / 128), 2, 2) and grid_q == (math.ceil(len_q / 128), 8, 2)
    assert (args_kv["seqlen_r"], args_kv["seqlen_c"]) == (len_k, len_q)
    assert (args_q["seqlen_r"], args_q["seqlen_c"]) == (len_q, len_k)
    assert (args_kv["window_left"], args_kv["window_right"]) == (right, left)
    assert (args_q["window_left"], args_q["window_right"]) == (left, right)
    assert (meta_kv["MASK_LEFT"], meta_kv["MASK_RIGHT"]) == (right >= 0, left >= 0)
    assert (meta_q["MASK_LEFT"], meta_q["MASK_RIGHT"]) == (left >= 0, right >= 0)
    assert meta_kv["DKDV"] and meta_kv["COL_PASSES"] == 4 and not meta_q["DKDV"] and meta_q["COL_PASSES"] == 1
    assert args_kv["a_desc"].base.data_ptr() == k.data_ptr() and args_kv["c_desc"].base.data_ptr() == q.data_ptr()
    assert args_q["a_desc"].base.data_ptr() == q.data_ptr() and args_q["d_desc"].base.data_ptr() == v.data_ptr()
    assert not meta_kv["DQ_REDUCE"] and not meta_q["DQ_REDUCE"] and args_kv["dq_desc"] is None
    if varlen:  # packed: one batch to the descriptors and the output strides
        assert args_kv["stride_1b"] == 0 and args_q["stride_1b"] == 0 and args_q["stride_wb"] == 0
        assert args_kv["CuSeqlensR"] is kwargs["cu_seqlens_k"] and args_q["CuSeqlensR"] is kwargs["cu_seqlens_q"]
    record.launches.clear()  # without deterministic: two launches as well up to REDUCE_MIN_ROWS query rows
    hopper_bwd.hopper_attn_bwd(dout, q, k, v, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ws,
                               ws.clone(), params=params, **kwargs)
    assert [meta["DQ_REDUCE"] for _, _, meta in record.launches] == [False, False]
    record.launches.clear()
    monkeypatch.setattr(hopper_bwd, "REDUCE_MIN_ROWS", len_q)  # past it: dQ by reductions, one launch
    hopper_bwd.hopper_attn_bwd(dout, q, k, v, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ws,
                               ws.clone(), params=params, **kwargs)
    ((grid, args, meta),) = record.launches
    assert grid == grid_kv and meta["DQ_REDUCE"] and meta["DKDV"] and meta["COL_PASSES"] == 4
    tokens = q.shape[0] if varlen else q.shape[0] * q.shape[1]
    assert list(args["dq_desc"].shape) == [tokens, 8 * 128] and list(args["dq_desc"].block_shape) == [64, 64]



def test_reductions_at_head_dim_64_split_query_rows(monkeypatch):
    """At head dim 64 the dK/dV launch reduces dQ as well (128-query tiles), each warpgroup half of
    a tile's query rows over all 64 columns: the workspace's descriptor reads (64, 64) boxes."""
    record = _Record(attn_bwd_hopper._attn_bwd_hopper_kernel)
    monkeypatch.setattr(attn_bwd_hopper, "_attn_bwd_hopper_kernel", record)
    monkeypatch.setattr(hopper_bwd, "REDUCE_MIN_ROWS", 0)
    dout, q, k, v, _, _ = _tensors(batch=2, seqlen_q=300, seqlen_k=350, nheads=8, nheads_k=2, d=64)
    ws = torch.empty((2, 8, 300))
    hopper_bwd.hopper_attn_bwd(dout, q, k, v, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ws,
                               ws.clone(), params=AttnParams(0.1, -1, 0))
    ((grid, args, meta),) = record.launches
    assert grid == (math.ceil(350 / 128), 2, 2) and meta["DQ_REDUCE"] and meta["DKDV"]
    assert args["c_desc"].block_shape == [1, 128, 1, 64]  # 128-query column tiles
    assert list(args["dq_desc"].shape) == [2 * 300, 8 * 64] and list(args["dq_desc"].block_shape) == [64, 64]
