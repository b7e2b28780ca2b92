"""Launcher of the forward kernel: ``attn_fwd`` as the contract of ``tileattn.contract`` states it.

Inputs are validated by ``tileattn.ops``; this module only chooses the kernel's flags, tile
sizes and grid, and writes into the ``out``/``lse`` it is given. It never synchronises with
the device (no ``.item()``), so decoding can be captured in a CUDA graph.

Choices made here:

* prefill (many query rows): autotuned tiles (``_prefill_configs``) keyed on head dim,
  causality, dtype and a sequence-length bucket; one fixed config under ``TRITON_INTERPRET=1``;
* few query rows per KV head group (``max_seqlen_q <= PACK_GQA_MAX_SEQLEN_Q`` with GQA):
  ``PACK_GQA`` puts the group's heads into the tile's rows, so each K/V tile is read once per
  KV head; when the packed rows fit in 64 a small fixed tile (BLOCK_M 16..64) is used;
* ``num_splits = 0``: split the keys when batch x heads x query blocks cannot fill the SMs
  (``_auto_splits``); the partial states are merged by ``kernels.combine``;
* on Hopper, the prefill calls (dense or varlen) the Gluon kernel covers go to ``gpu/hopper.py`` instead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..dropout_mask import keep_threshold
from ..kernels.attn_fwd import _attn_fwd_kernel
from ..kernels.combine import _combine_kernel
from ..kernels.common import LOG2E
from ..contract import AttnParams
from ._tuning import Tuned, autotune_enabled, interpreting, length_bucket
from .hopper import hopper_attn_fwd, hopper_fwd_reason

__all__ = ["attn_fwd"]

PACK_GQA_MAX_SEQLEN_Q = 64  # pack the heads of a GQA group when the queries alone fill so few rows
DECODE_MAX_ROWS = 64  # at most this many rows per (sequence, head group): the small decode tile
MAX_SPLITS = 128
COMBINE_MAX_BLOCK_S = 64  # splits the combine reads at once (fewer when there are fewer splits)
# The decode tile, measured on the H200 by benchmarks/decode_tiles.py (docs/perf-notes.md): keys
# per tile (also the unit the split heuristic counts in), and a smaller one for caches whose
# pages hold whole tiles (one table lookup per tile), where 64 keys beat 128.
DECODE_BLOCK_N = 128
DECODE_BLOCK_N_WHOLE_PAGES = 64
DECODE_NUM_WARPS = 4
DECODE_MAX_STAGES = 3  # fewer when the staged K/V tiles would not fit in shared memory
SMEM_BUDGET = 200 * 1024  # of Hopper's 227 KB per block, leaving room for the compiler's scratch
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _prefill_configs():
    """The autotune set: (BLOCK_M, BLOCK_N, num_warps, num_stages) that suit Hopper."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    shapes = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2),
              (128, 32, 4, 3), (64, 32, 4, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _smem_bytes(block_m, block_n, stages, head_dim_pad, elem_size):
    """Shared memory of one program, roughly: the Q tile plus ``stages`` K and V tiles."""
    return (block_m + 2 * stages * block_n) * head_dim_pad * elem_size


def _prune_configs(configs, named_args, **kwargs):
    """Drop the tiles whose staged K/V would not fit in shared memory (large head dims, fp32)."""
    head_dim_pad = max(kwargs["HEAD_DIM_PAD"], kwargs.get("HEAD_DIM_V_PAD", 0))  # the larger of q/k's and v's
    elem = named_args["Q"].element_size()
    kept = [c for c in configs
            if _smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, head_dim_pad, elem) <= SMEM_BUDGET]
    return kept or [configs[-1]]


_TUNE_KEY = ["HEAD_DIM_PAD", "HEAD_DIM_V_PAD", "MASK_LEFT", "MASK_RIGHT", "PACK_GQA", "IS_PAGED"]


@functools.lru_cache(maxsize=None)
def _attn_fwd_tuned(bucket: int) -> Tuned:
    """The autotuned forward for one sequence-length bucket (``length_bucket``).

    The tiles that win at 512 tokens (launch-bound, few key blocks) need not win at 16k, and an
    autotuner's key can only name kernel arguments, so each bucket gets an autotuner of its own
    over the same jit function (compiled variants are shared; only the timing is redone).
    """
    return Tuned(_attn_fwd_kernel, _prefill_configs(), _TUNE_KEY, _prune_configs)


@functools.lru_cache(maxsize=None)
def _gpu_limits(index: int) -> tuple[int, int]:
    """(multiprocessors, shared memory one block may use) of CUDA device ``index``, asked once:
    a decoding step needs them every time."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


def _auto_splits(programs: int, key_blocks: int, device: torch.device, program_smem: int, waves: int) -> int:
    """Flash-decoding split count: enough programs for ``waves`` waves of the programs the GPU holds at once.

    The GPU holds about ``SMs x (shared memory a block may use // program_smem)`` programs at once. 1 when
    ``programs`` already fill the waves (or on the CPU / interpreter); never more splits than
    key blocks (each split keeps at least one) nor ``MAX_SPLITS``. Measured on the H200
    (benchmarks/decode_tiles.py, docs/perf-notes.md): a contiguous cache is fastest with one
    wave (batch 1: 16 splits of 8 KV heads; a partial second wave cost up to 20 %), a paged one
    with two, which hide the latency of the block-table lookups.
    """
    if device.type != "cuda" or interpreting():
        return 1
    sms, smem = _gpu_limits(device.index if device.index is not None else torch.cuda.current_device())
    resident = sms * max(1, smem // program_smem)
    return max(1, min(waves * resident // programs, key_blocks, MAX_SPLITS))


def _decode_tile(block_m: int, page_size: int, head_dim_pad: int, elem_size: int) -> tuple[int, int]:
    """(keys per tile, pipeline stages) of the decode launch; ``page_size`` 0 for a contiguous cache.

    ``DECODE_BLOCK_N`` keys (``DECODE_BLOCK_N_WHOLE_PAGES`` when pages hold whole tiles) with
    ``DECODE_MAX_STAGES``; when the staged tiles do not fit in shared memory (large head dims,
    fp32), fewer stages down to 2, then fewer keys per tile down to 16, then 1 stage.
    """
    whole_pages = page_size > 0 and page_size % DECODE_BLOCK_N_WHOLE_PAGES == 0
    block_n = DECODE_BLOCK_N_WHOLE_PAGES if whole_pages else DECODE_BLOCK_N
    stages = DECODE_MAX_STAGES
    while _smem_bytes(block_m, block_n, stages, head_dim_pad, elem_size) > SMEM_BUDGET:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            return block_n, 1
    return block_n, stages


def _stride(t: torch.Tensor | None, dim: int) -> int:
    return 0 if t is None else t.stride(dim)


def attn_fwd(q, k, v, out, lse, *, params: AttnParams, alibi_slopes=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             seqused_k=None, block_table=None, num_splits=1, learnable_sink=None) -> None:
    """Attention of ``q`` over ``k, v`` into ``out`` and ``lse`` (see ``tileattn.contract``).

    ``out[..., i, h, :] = sum_j softmax_j(s_ij) v_j`` (dropout-scaled when asked) and
    ``lse[..., h, i] = log sum_j exp(s_ij)`` over the keys query i may see; 0 and -inf if none.
    """
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    assert num_splits >= 0 and (seqused_k is not None or not paged), "inputs are validated by tileattn.ops"
    if learnable_sink is None and hopper_fwd_reason(  # the Hopper kernel has no sinks yet
            q, k, v, params, alibi_slopes=alibi_slopes, varlen=varlen, paged=paged, seqused_k=seqused_k,
            num_splits=num_splits, max_seqlen_q=max_seqlen_q) is None:
        hopper_attn_fwd(q, k, v, out, lse, params=params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        return
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
        _, nheads, head_dim = q.shape
        seqlen_q = max_seqlen_q if max_seqlen_q > 0 else q.shape[0]  # an upper bound suffices
        stride_qb, stride_qs, stride_qh = 0, q.stride(0), q.stride(1)
        stride_ob, stride_os, stride_oh = 0, out.stride(0), out.stride(1)
        stride_lb, stride_lh, stride_ls = 0, lse.stride(0), lse.stride(1)
    else:
        batch, seqlen_q, nheads, head_dim = q.shape
        stride_qb, stride_qs, stride_qh = q.stride(0), q.stride(1), q.stride(2)
        stride_ob, stride_os, stride_oh = out.stride(0), out.stride(1), out.stride(2)
        stride_lb, stride_lh, stride_ls = lse.stride(0), lse.stride(1), lse.stride(2)
    if paged or not varlen:  # (B or blocks, S or page, Hk, D)
        nheads_k = k.shape[2]
        stride_kb, stride_ks, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vb, stride_vs, stride_vh = v.stride(0), v.stride(1), v.stride(2)
    else:  # packed keys (Tk, Hk, D)
        nheads_k = k.shape[1]
        stride_kb, stride_ks, stride_kh = 0, k.stride(0), k.stride(1)
        stride_vb, stride_vs, stride_vh = 0, v.stride(0), v.stride(1)
    if paged:
        page_size = k.shape[1]
        seqlen_k = max_seqlen_k if max_seqlen_k > 0 else block_table.shape[1] * page_size
    elif varlen:
        page_size = 1
        seqlen_k = max_seqlen_k if max_seqlen_k > 0 else k.shape[0]
    else:
        page_size = 1
        seqlen_k = k.shape[1]
    group = nheads // nheads_k
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    head_dim_v = v.shape[-1]  # the output's head dim too; may differ from q/k's (MLA)
    head_dim_v_pad = max(16, triton.next_power_of_2(head_dim_v))
    smem_dim = max(head_dim_pad, head_dim_v_pad)  # shared-memory estimates: the larger tile width

    pack_gqa = group > 1 and seqlen_q <= PACK_GQA_MAX_SEQLEN_Q
    max_rows = seqlen_q * group if pack_gqa else seqlen_q
    heads_grid = nheads_k if pack_gqa else nheads
    decode = max_rows <= DECODE_MAX_ROWS
    block_m = max(16, triton.next_power_of_2(max_rows)) if decode else 128  # 128: the usual prefill tile
    block_n, stages = _decode_tile(block_m, page_size if paged else 0, smem_dim, q.element_size())
    if num_splits == 0:
        programs = batch * heads_grid * triton.cdiv(max_rows, block_m)
        smem = _smem_bytes(block_m, block_n, stages, smem_dim, q.element_size())
        num_splits = _auto_splits(programs, triton.cdiv(seqlen_k, block_n), q.device, smem, waves=2 if paged else 1)
    split_kv = num_splits > 1

    if split_kv:  # fp32 partial states (splits, B, Sq, H, D) and (splits, B, H, Sq); varlen: B = 1
        rows_b, rows_s = (1, q.shape[0]) if varlen else (batch, seqlen_q)
        o_dst = torch.empty((num_splits, rows_b, rows_s, nheads, head_dim_v), device=q.device, dtype=torch.float32)
        l_dst = torch.empty((num_splits, rows_b, nheads, rows_s), device=q.device, dtype=torch.float32)
        o_strides = o_dst.stride()[:4]
        l_strides = l_dst.stride()[:4]
        if varlen:  # the kernel indexes packed tokens with batch stride 0
            o_strides = (o_strides[0], 0, *o_strides[2:])
            l_strides = (l_strides[0], 0, *l_strides[2:])
    else:
        o_dst, l_dst = out, lse
        o_strides = (0, stride_ob, stride_os, stride_oh)
        l_strides = (0, stride_lb, stride_lh, stride_ls)

    dropout_p = params.dropout_p
    dot_dtype = _DOT_DTYPES[q.dtype]
    if interpreting() and q.dtype == torch.bfloat16:  # the interpreter's tl.dot mishandles bf16
        dot_dtype = tl.float32
    args = (
        q, k, v, o_dst, l_dst, alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
        stride_qb, stride_qs, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        *o_strides, *l_strides,
        _stride(alibi_slopes, 0), _stride(alibi_slopes, 1), _stride(block_table, 0),
        nheads, seqlen_q, seqlen_k, max_rows, num_splits,
        params.softmax_scale * LOG2E.value, params.softcap, params.window_left, params.window_right,
        params.dropout_seed, keep_threshold(dropout_p), 1.0 / (1.0 - dropout_p) if dropout_p > 0 else 1.0,
    )
    flags = dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=head_dim_v_pad, PAGE_SIZE=page_size,
        IS_VARLEN=varlen, IS_PAGED=paged, HAS_SEQUSED_K=seqused_k is not None,
        PACK_GQA=pack_gqa, SPLIT_KV=split_kv,
        MASK_LEFT=params.window_left >= 0, MASK_RIGHT=params.window_right >= 0,
        HAS_SOFTCAP=params.softcap > 0, HAS_ALIBI=alibi_slopes is not None, HAS_DROPOUT=dropout_p > 0,
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        HAS_SINK=learnable_sink is not None,
    )

    def grid(meta):
        return (batch * heads_grid * triton.cdiv(max_rows, meta["BLOCK_M"]), num_splits)

    if decode:
        _attn_fwd_kernel[grid](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=DECODE_NUM_WARPS,
                               num_stages=stages)
    elif autotune_enabled():
        key = tuple(flags[name] for name in _TUNE_KEY) + (q.dtype,)
        _attn_fwd_tuned(length_bucket(seqlen_q, seqlen_k)).launch(grid, key, args, flags)
    else:  # the first config that fits in shared memory
        cfg = _prune_configs(_prefill_configs(), {"Q": q}, HEAD_DIM_PAD=smem_dim)[0]
        _attn_fwd_kernel[grid](*args, **flags, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    if split_kv:
        _combine(o_dst, l_dst, out, lse, varlen, head_dim_v, head_dim_v_pad, learnable_sink)


def _combine(o_part, l_part, out, lse, varlen, head_dim, head_dim_pad, learnable_sink=None):
    """Merge the (splits, B, Sq, H, D) partials, and the sinks if any, into ``out``/``lse`` (varlen as B = 1)."""
    if varlen:
        out, lse = out.unsqueeze(0), lse.unsqueeze(0)
    num_splits, batch, seqlen_q, nheads, _ = o_part.shape
    grid = (batch * seqlen_q * nheads,)
    _combine_kernel[grid](
        o_part, l_part, out, lse, learnable_sink,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2), l_part.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        nheads, seqlen_q, num_splits,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_S=min(triton.next_power_of_2(num_splits), COMBINE_MAX_BLOCK_S), HAS_SINK=learnable_sink is not None,
        num_warps=4,
    )
