"""Launcher of the Triton backward kernels (``tileattn.kernels.attn_bwd``).

Implements ``attn_bwd`` of the contract in ``tileattn.contract``: given dO, q, k, v, the
forward's out and lse, it writes dq, dk, dv (in their own dtype; accumulation is fp32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..dropout_mask import keep_threshold
from ..kernels.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess
from ._tuning import Tuned, autotune_enabled, interpreting, length_bucket

__all__ = ["attn_bwd"]

_MAX_GRID_YZ = 65535
_PREPROCESS_BLOCK = 64


def _shapes(head_dim_p: int) -> list[tuple[int, int, int, int]]:
    """(resident block, streamed block, num_warps, num_stages) to try, best guess first.

    dkdv keeps a key block (BLOCK_N rows of k, v, dk, dv) resident and streams query blocks,
    dq keeps a query block resident and streams key blocks: the resident side is the large one.
    """
    if interpreting():  # small tiles: the tests walk several blocks in a few hundred tokens
        return [(32, 16, 4, 1)]
    if head_dim_p <= 64:
        return [(128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 2), (64, 64, 4, 3)]
    if head_dim_p <= 128:
        # the last two spill least in dK/dV (ptxas: 32 and 208 B of stack against 0.6-3 KB for the
        # others, tests/hopper_compile.py); timed on the H200, the autotuner never kept them
        # (docs/perf-notes.md: the spilling (128, 64, 8, 2 or 3) won at every size)
        return [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 5), (128, 32, 8, 3), (64, 64, 4, 3),
                (128, 16, 8, 3), (128, 32, 8, 2)]
    return [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3)]


SMEM_LIMIT = 227 * 1024  # shared memory one block may use on Hopper


def _smem_estimate(resident: int, streamed: int, stages: int, head_dim_p: int, elem_size: int) -> int:
    """An estimate of one program's shared memory: two resident tiles (k, v or q, dout) and
    ``stages`` copies of the two streamed ones. Compiled for sm_90 the kernels use 60-101 % of
    it (tests/hopper_compile.py checks every kept config against the real limit); without it
    fp32 inputs would get the bf16 tiles, which do not fit."""
    return elem_size * head_dim_p * (2 * resident + 2 * stages * streamed)


def _configs(kind: str, head_dims=(64, 128, 256), elem_size: int | None = None) -> list[triton.Config]:
    """The configs of one kernel ("dkdv" or "dq") for the given padded head dims, best guess
    first; with ``elem_size``, only those whose shared memory fits (at least the smallest)."""
    resident, streamed = ("BLOCK_N", "BLOCK_M") if kind == "dkdv" else ("BLOCK_M", "BLOCK_N")
    configs = []
    for d in head_dims:
        shapes = _shapes(d)
        if elem_size is not None:
            fitting = [sh for sh in shapes if _smem_estimate(sh[0], sh[1], sh[3], d, elem_size) <= SMEM_LIMIT]
            shapes = fitting or [min(shapes, key=lambda sh: _smem_estimate(sh[0], sh[1], sh[3], d, elem_size))]
        configs += [(r, st, w, n) for r, st, w, n in shapes if (r, st, w, n) not in configs]
    return [triton.Config({resident: r, streamed: st}, num_warps=w, num_stages=n) for r, st, w, n in configs]


def _pruner(kind: str):
    """The autotuner's early prune: the configs meant for this head dimension that fit in
    shared memory for this dtype."""
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        width = max(args["HEAD_DIM_P"], args["HEAD_DIM_V_P"])  # the configs of the wider of q/k and v
        wanted = {str(c) for c in _configs(kind, (width,), args["q_ptr"].element_size())}
        return [c for c in configs if str(c) in wanted]
    return prune


_TUNE_KEY = ["HEAD_DIM_P", "HEAD_DIM_V_P", "GROUP", "IS_VARLEN", "MASK_LEFT", "MASK_RIGHT", "HAS_DROPOUT"]


@functools.lru_cache(maxsize=None)
def _tuned(kind: str, bucket: int) -> Tuned:
    """The autotuned dkdv or dq kernel for one sequence-length bucket (``length_bucket``): one
    autotuner per bucket over the same jit function, since a key can only name kernel arguments."""
    kernel = _attn_bwd_dkdv_kernel if kind == "dkdv" else _attn_bwd_dq_kernel
    return Tuned(kernel, _configs(kind), _TUNE_KEY, _pruner(kind))


def _dot_dtype(dtype: torch.dtype):
    """Operand dtype of the matmuls: the inputs' own, except bf16 under Triton 3.6's interpreter,
    whose tl.dot multiplies bf16 bit patterns as integers; there the operands (already rounded
    to bf16) are widened to fp32."""
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def _rows_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (B, S, H, D) or packed (T, H, D) tensor."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _launch(kernel: Tuned, fixed: triton.Config | None, grid, args: tuple, meta: dict, dtype: torch.dtype) -> None:
    """Run an autotuned kernel, or its plain jit function with the ``fixed`` config."""
    if fixed is None:
        kernel.launch(grid, tuple(meta[name] for name in _TUNE_KEY) + (dtype,), args, meta)
    else:
        kernel.fn[grid](*args, **meta, **fixed.all_kwargs())


def attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, params, alibi_slopes=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             deterministic=False, dlse=None, learnable_sink=None, dsink=None) -> None:
    """Gradients of ``sum(out * dout) + sum(lse * dlse)`` with respect to q, k, v (and the
    learnable sinks), written into dq, dk, dv (and dsink).

    Three launches: delta = rowsum(dO * O) - dlse (with lse in log2 units and, with sinks, the
    rows' terms of dsink, summed here by torch in a fixed order), then dK/dV per key block
    and dQ per query block. The scores are recomputed from q, k and lse (no N x N buffer);
    see ``tileattn.kernels.attn_bwd`` for the math. Every gradient element is written by exactly
    one program, which sums in a fixed order (a shared key/value head's dk, dv too: its program
    walks the query heads of its group one after the other), and no atomics are used. The
    gradients are therefore bitwise reproducible run after run; ``deterministic=True`` also pins
    the tile configuration (no autotuning), so they match across processes as well.
    """
    varlen = cu_seqlens_q is not None
    # validated by tileattn.ops (shapes, head dims, grid limits) and by its autograd (strides)
    assert varlen == (cu_seqlens_k is not None) and max(q.shape[-1], v.shape[-1]) <= 256
    assert (learnable_sink is None) == (dsink is None)
    assert all(t.stride(-1) == 1 for t in (q, k, v, out, dq, dk, dv))
    if dout.stride(-1) != 1:  # autograd hands over any gradient (an expanded one has stride 0)
        dout = dout.contiguous()
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        lse_strides = (0, lse.stride(0), lse.stride(1))
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        lse_strides = lse.stride()
    assert batch <= _MAX_GRID_YZ and nheads <= _MAX_GRID_YZ
    if dsink is not None:
        dsink.zero_()
    if batch == 0 or seqlen_q == 0 and seqlen_k == 0:
        return

    # workspaces shaped like lse: delta = rowsum(dO * O) and lse2 = log2(e) lse (+inf if empty)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    ws_strides = (0, delta.stride(0)) if varlen else (delta.stride(0), delta.stride(1))
    # with sinks, each row's term of -dsink (zeros where no row writes: packed tokens outside every sequence)
    sink_terms = None if learnable_sink is None else torch.zeros_like(delta)
    dlse_strides = (0, 0, 0) if dlse is None else (0, dlse.stride(0), dlse.stride(1)) if varlen else dlse.stride()
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    head_dim_v_p = max(16, triton.next_power_of_2(head_dim_v))
    width = max(head_dim_p, head_dim_v_p)  # tile configs are chosen for the wider of q/k and v
    if seqlen_q > 0:
        _attn_bwd_preprocess[(triton.cdiv(seqlen_q, _PREPROCESS_BLOCK), nheads, batch)](
            out, dout, lse, delta, lse2, cu_seqlens_q, dlse, learnable_sink, sink_terms,
            *_rows_strides(out, varlen), *_rows_strides(dout, varlen), *lse_strides, *dlse_strides, *ws_strides,
            seqlen_q, HEAD_DIM=head_dim_v, HEAD_DIM_P=head_dim_v_p, BLOCK_M=_PREPROCESS_BLOCK, IS_VARLEN=varlen,
            HAS_DLSE=dlse is not None, HAS_SINK=learnable_sink is not None)
        if sink_terms is not None:  # (B, H, Sq) or packed (H, Tq) -> (H,)
            dsink.copy_(-(sink_terms.sum(dim=1) if varlen else sink_terms.sum(dim=(0, 2))))

    p = float(params.dropout_p)
    has_alibi = alibi_slopes is not None
    scalars = (seqlen_q, seqlen_k, nheads, float(params.softmax_scale), float(params.softcap),
               int(params.window_left), int(params.window_right), int(params.dropout_seed) % 2**32,
               keep_threshold(p), 1.0 / (1.0 - p) if p > 0 else 1.0)
    meta = dict(GROUP=nheads // nheads_k, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, HEAD_DIM_V=head_dim_v,
                HEAD_DIM_V_P=head_dim_v_p, IS_VARLEN=varlen,
                HAS_SOFTCAP=params.softcap > 0, HAS_ALIBI=has_alibi, HAS_DROPOUT=p > 0,
                MASK_LEFT=params.window_left >= 0, MASK_RIGHT=params.window_right >= 0,
                DOT_DTYPE=_dot_dtype(q.dtype), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    alibi_strides = alibi_slopes.stride() if has_alibi else (0, 0)
    common = (cu_seqlens_q, cu_seqlens_k, alibi_slopes,
              *_rows_strides(q, varlen), *_rows_strides(k, varlen), *_rows_strides(v, varlen),
              *_rows_strides(dout, varlen))
    fixed = deterministic or interpreting() or not autotune_enabled()
    bucket = length_bucket(seqlen_q, seqlen_k)
    if seqlen_k > 0:
        _launch(_tuned("dkdv", bucket), _configs("dkdv", (width,), q.element_size())[0] if fixed else None,
                lambda m: (triton.cdiv(seqlen_k, m["BLOCK_N"]), nheads_k, batch),
                (q, k, v, dout, dk, dv, lse2, delta, *common, *_rows_strides(dk, varlen),
                 *_rows_strides(dv, varlen), *ws_strides, *alibi_strides, *scalars), meta, q.dtype)
    if seqlen_q > 0:
        _launch(_tuned("dq", bucket), _configs("dq", (width,), q.element_size())[0] if fixed else None,
                lambda m: (triton.cdiv(seqlen_q, m["BLOCK_M"]), nheads, batch),
                (q, k, v, dout, dq, lse2, delta, *common, *_rows_strides(dq, varlen), *ws_strides,
                 *alibi_strides, *scalars), meta, q.dtype)
