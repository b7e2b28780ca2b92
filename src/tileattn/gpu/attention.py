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
  (``_auto_splits``); the partial states are merged by a combine launch, or by the split launch
  itself (``FwdPlan.merged``: eager prepared calls, ``gpu/combine.py``);
* a packed batch over a KV cache (``seqused_k``) mixing sequences of few new tokens (decoding,
  speculative rows) with long ones (prefill chunks): two launches into the same outputs, the
  short sequences with the decode tile (split when asked) and the long ones with the prefill
  tile (never split; the combine skips their rows, marked in split 0's lse);
* an FP8 cache (``k_descale``/``v_descale``): the same kernel with ``IS_FP8``, or on Hopper the Gluon
  FP8 decode (``gpu/hopper_fp8.py``) for the decoding calls its rule takes;
* head dims above 256 (MLA's absorbed latent, q/k 576 and v 512): q/k's head dim as a power-of-two
  main part and a tail (``_split_head_dim``: 576 = 512 + 64, not padded to 1024), the key tile
  reused as the value tile when v is a view of k's leading columns (``V_IS_K``), and one fixed
  tile for every row count (``WIDE_*``: a 512-wide fp32 accumulator leaves no room for the
  prefill configs; rows of 64 over two warpgroups, 128 accumulator registers per thread);
* on Hopper, the prefill calls (dense or varlen) the Gluon kernel covers go to ``gpu/hopper.py`` instead.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..dropout_mask import keep_threshold
from ..kernels.attn_fwd import _attn_fwd_kernel
from ..kernels.combine import UNSPLIT_MARK
from ..kernels.common import LOG2E
from ..contract import AttnParams
from ._launch import (Launch, cdiv, config_options, contiguous_strides, int_class, launch_for, next_power_of_2,
                      partials_workspace, plan_for)
from .combine import combine_launch, merge_constexprs
from ._tuning import SMEM_LIMIT, Tuned, autotune_enabled, dot_types, interpreting, length_bucket, softcap_form
from .hopper_fp8 import Fp8DecodePlan, hopper_fp8_decode_reason
from .hopper import HopperPartials, hopper_attn_fwd, hopper_fwd_reason, hopper_partials_reason, hopper_partials_splits

__all__ = ["attn_fwd", "plan_fwd", "plan_partials", "clear_plans", "FwdPlan"]

PACK_GQA_MAX_SEQLEN_Q = 64  # pack the heads of a GQA group when the queries alone fill so few rows
DECODE_MAX_ROWS = 64  # at most this many rows per (sequence, head group): the small decode tile
# paged launches: load each key tile's page ids one tile ahead (``PREFETCH_PAGES`` of the kernel),
# per tile kind. Measured on the H200 (2026-11-30 20:25, docs/perf-notes.md): the staged tiles
# raise the bf16 decode tile's shared memory 74 -> 139 KB (one program per SM) and slow it 6-38 %;
# the FP8 decode tile (41 -> 74 KB) gains 3.6 %, the prefill tile 7-13 % (packed prefix, mixed batch)
PREFETCH_PAGES = {"decode": False, "decode_fp8": True, "prefill": True}
MIXED_BLOCK_M = 16  # the decode tile's rows in a mixed batch (FwdPlan)
MAX_SPLITS = 128
# a decode-tile call over a KV cache with its lengths (``seqused_k``): the host does not know them,
# and they may differ from sequence to sequence, so a few long splits leave the SMs idle while the
# longest sequences finish. Splits for RAGGED_WAVES programs per SM (counted at the longest
# length) keep every SM busy to the end, each split at least RAGGED_MIN_KEYS keys. Measured on the
# H200 (2026-12-01 03:07 and 03:17, docs/perf-notes.md): 48 decoding rows over 8k-32k keys, 1 split
# (the two-wave rule's) 1,033 / 1,116 us (contiguous / paged 16), 5 splits 943 / 981, floor 915;
# the price where every sequence has the same length, batch 64 x 8k: 484 -> 503 us (4 splits)
RAGGED_WAVES = 12
RAGGED_MIN_KEYS = 1024
# The decode tile, measured on the H200 by benchmarks/decode_tiles.py (docs/perf-notes.md): keys
# per tile (also the unit the split heuristic counts in), and a smaller one for caches whose
# pages hold whole tiles (one table lookup per tile), where 64 keys beat 128.
DECODE_BLOCK_N = 128
DECODE_BLOCK_N_WHOLE_PAGES = 64
DECODE_NUM_WARPS = 4
DECODE_MAX_STAGES = 3  # fewer when the staged K/V tiles would not fit in shared memory
SMEM_BUDGET = SMEM_LIMIT - 27 * 1024  # _smem_bytes leaves out the compiler's scratch (layout conversions)
# Head dims above TAIL_ABOVE (q/k) are a power-of-two main part and a tail; a call with a q/k or v
# head dim above it is "wide" and takes the wide tile, for any number of rows: up to WIDE_BLOCK_M
# rows (at 64 rows WIDE_NUM_WARPS: two warpgroups, each 256 columns of a 512-wide fp32 accumulator,
# 128 registers per thread), WIDE_BLOCK_N keys when the key tile is the value tile (V_IS_K), else
# WIDE_BLOCK_N_SEPARATE, and WIDE_MAX_STAGES stages or fewer (_decode_tile, for shared memory);
# over an FP8 cache WIDE_FP8_BLOCK_M rows with 4 warps and WIDE_BLOCK_N_SEPARATE keys (the tile
# converted to fp16 has no room beside 64 rows). Chosen by sm_90 ptxas: the largest tiles that
# compile without spills (tests/hopper_compile.py checks it; the table is in docs/perf-notes.md).
TAIL_ABOVE = 256
WIDE_BLOCK_M = 64
WIDE_NUM_WARPS = 8
WIDE_BLOCK_N = 32
WIDE_BLOCK_N_SEPARATE = 16
WIDE_MAX_STAGES = 2
WIDE_FP8_BLOCK_M = 32


def _prefill_configs():
    """The autotune set: (BLOCK_M, BLOCK_N, num_warps, num_stages) that suit Hopper."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    shapes = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2),
              (128, 32, 4, 3), (64, 32, 4, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _smem_bytes(block_m, block_n, stages, head_dim_pad, elem_size, v_width=None, kv_elem_size=None):
    """Shared memory of one program, roughly: the Q tile plus ``stages`` K and V tiles, each
    ``head_dim_pad`` wide (V ``v_width`` wide when given: 0 when the K tile is the V tile), of
    ``kv_elem_size`` bytes an element (an FP8 cache's 1) when it differs from q's."""
    v_width = head_dim_pad if v_width is None else v_width
    return block_m * head_dim_pad * elem_size + stages * block_n * (head_dim_pad + v_width) * (kv_elem_size or elem_size)


def _prune_configs(configs, named_args, **kwargs):
    """Drop the tiles whose staged K/V would not fit in shared memory (large head dims, fp32).
    Head dims above 256 never reach the autotuner: they take the wide tile (``FwdPlan``)."""
    head_dim_pad = max(kwargs["HEAD_DIM_PAD"], kwargs.get("HEAD_DIM_V_PAD", 0))  # the larger of q/k's and v's
    elem = named_args["Q"].element_size()
    kept = [c for c in configs
            if _smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, head_dim_pad, elem) <= SMEM_BUDGET]
    return kept or [configs[-1]]


_TUNE_KEY = ["HEAD_DIM_PAD", "HEAD_DIM_V_PAD", "MASK_LEFT", "MASK_RIGHT", "PACK_GQA", "IS_PAGED"]
_PLANS: dict[tuple, "FwdPlan"] = {}
_FP8_PLANS: dict[tuple, Fp8DecodePlan] = {}  # _fp8_plan's plans of the Gluon FP8 decode
_FWD_FIRST_INT = _attn_fwd_kernel.arg_names.index("stride_qb")  # the plan's integers start here
# where a call's own key strides and length go among them when the plan takes those per call
_K_INTS = _attn_fwd_kernel.arg_names.index("stride_kb") - _FWD_FIRST_INT
_SEQLEN_K_INT = _attn_fwd_kernel.arg_names.index("seqlen_k_arg") - _FWD_FIRST_INT


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


def _auto_splits(programs: int, key_blocks: int, device: torch.device, program_smem: int, waves: int,
                 ragged_blocks: int = 0) -> int:
    """Flash-decoding split count: enough programs for ``waves`` waves of the programs the GPU holds at once.

    The GPU holds about ``SMs x (shared memory a block may use // program_smem)`` programs at once. 1 when
    ``programs`` already fill the waves (or on the CPU / interpreter); never more splits than
    key blocks (each split keeps at least one) nor ``MAX_SPLITS``. Measured on the H200
    (benchmarks/decode_tiles.py, docs/perf-notes.md): a contiguous cache is fastest with one
    wave (batch 1: 16 splits of 8 KV heads; a partial second wave cost up to 20 %), a paged one
    with two, which hide the latency of the block-table lookups.

    ``ragged_blocks`` > 0: the sequences' lengths are per-call values the host does not know
    (``seqused_k``). When the unsplit grid already gives every SM a program (a batch of many
    sequences; below that the waves rule, measured at batch 1, stands), at least enough splits
    for ``RAGGED_WAVES`` programs per SM (counted at the longest length, whatever the shared
    memory lets run at once: a small FP8 tile must not multiply the splits), but no more than
    ``ragged_blocks`` (the key blocks of ``RAGGED_MIN_KEYS`` keys).
    """
    if device.type != "cuda" or interpreting():
        return 1
    sms, smem = _gpu_limits(device.index if device.index is not None else torch.cuda.current_device())
    resident = sms * max(1, smem // program_smem)
    splits = waves * resident // programs
    if ragged_blocks and programs >= sms:
        splits = max(splits, min(cdiv(RAGGED_WAVES * sms, programs), ragged_blocks))
    return max(1, min(splits, key_blocks, MAX_SPLITS))


def _decode_tile(block_m: int, page_size: int, head_dim_pad: int, elem_size: int, v_width: int | None = None,
                 block_n: int | None = None, stages: int = DECODE_MAX_STAGES,
                 kv_elem_size: int | None = None) -> tuple[int, int]:
    """(keys per tile, pipeline stages) of the decode launch; ``page_size`` 0 for a contiguous cache.

    ``DECODE_BLOCK_N`` keys (``DECODE_BLOCK_N_WHOLE_PAGES`` when pages hold whole tiles; ``block_n``
    when given) with ``stages``; when the staged tiles do not fit in shared memory (large head dims,
    fp32), fewer stages down to 2, then fewer keys per tile down to 16, then 1 stage. The tiles
    are ``head_dim_pad`` wide, V's ``v_width`` when given (``_smem_bytes``).
    """
    if block_n is None:
        whole_pages = page_size > 0 and page_size % DECODE_BLOCK_N_WHOLE_PAGES == 0
        block_n = DECODE_BLOCK_N_WHOLE_PAGES if whole_pages else DECODE_BLOCK_N
    while _smem_bytes(block_m, block_n, stages, head_dim_pad, elem_size, v_width, kv_elem_size) > SMEM_BUDGET:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            return block_n, 1
    return block_n, stages


def _split_head_dim(head_dim: int) -> tuple[int, int]:
    """(main, tail) of q/k's head dim: up to ``TAIL_ABOVE`` one part (padded to a power of two by
    the kernel), above it the largest power of two below plus the rest, so that the products pad
    only the tail: 576 = 512 + 64 (padded whole, 1024 would cost 78 % more of the score products),
    320 = 256 + 64, 384 = 256 + 128, 512 = 512 + 0."""
    if head_dim <= TAIL_ABOVE:
        return head_dim, 0
    main = 1 << (head_dim.bit_length() - 1)
    return main, head_dim - main


def is_wide(head_dim_pad: int, head_dim_tail_pad: int, head_dim_v_pad: int) -> bool:
    """Whether a launch of these (padded) head dims takes the wide tile (``WIDE_BLOCK_M``)."""
    return head_dim_pad + head_dim_tail_pad > TAIL_ABOVE or head_dim_v_pad > TAIL_ABOVE


def _v_is_k(k, v) -> bool:
    """Whether v is k's leading columns in memory (MLA's latent: v_cache = k_cache[..., :headdim_v])."""
    return (v.data_ptr() == k.data_ptr() and v.dtype == k.dtype and v.shape[:-1] == k.shape[:-1]
            and v.stride() == k.stride())


def clear_plans() -> None:
    """Forget every launch plan (after changing this module's tile constants, as the tile sweep does);
    the launches ``prepare_fwd`` bound to plans go back to ``attn_fwd`` (``generation``)."""
    global generation
    _PLANS.clear()
    _FP8_PLANS.clear()
    generation += 1


generation = 0  # how many times the plans were forgotten


def attn_fwd(q, k, v, out, lse, *, params: AttnParams, alibi_slopes=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             seqused_k=None, block_table=None, num_splits=1, learnable_sink=None, k_descale=None,
             v_descale=None) -> None:
    """Attention of ``q`` over ``k, v`` into ``out`` and ``lse`` (see ``tileattn.contract``).

    ``out[..., i, h, :] = sum_j softmax_j(s_ij) v_j`` (dropout-scaled when asked) and
    ``lse[..., h, i] = log sum_j exp(s_ij)`` over the keys query i may see; 0 and -inf if none.

    The tiles, split count, grid and kernel flags depend only on the call's shape class
    (``_plan_key``: shapes, strides, dtypes, which optional tensors are given, the flags the
    options turn on); they are worked out once per class (``FwdPlan``) and every later call
    of the class only launches.
    """
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    assert num_splits >= 0 and (seqused_k is not None or not paged), "inputs are validated by tileattn.ops"
    if hopper_fwd_reason(q, k, v, params, alibi_slopes=alibi_slopes, varlen=varlen, paged=paged,
                         seqused_k=seqused_k, num_splits=num_splits, max_seqlen_q=max_seqlen_q, out=out,
                         lse=lse) is None:
        hopper_attn_fwd(q, k, v, out, lse, params=params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, learnable_sink=learnable_sink)
        return
    key = _plan_key(q, k, v, out, lse, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, seqused_k, block_table, num_splits, learnable_sink, k_descale)
    plan = None
    if k_descale is not None:  # an FP8 cache: the Gluon decode on Hopper when its rule takes the call
        plan = _fp8_plan(key, q, k, v, out, lse, params, alibi_slopes, cu_seqlens_q, max_seqlen_k, seqused_k,
                         block_table, num_splits, learnable_sink, k_descale, v_descale)
    if plan is None:
        plan = plan_for(_PLANS, key, FwdPlan)
    plan.run(q, k, v, out, lse, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
             learnable_sink=learnable_sink, k_descale=k_descale, v_descale=v_descale)


def plan_fwd(q, k, v, out, lse, *, params: AttnParams, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=0, max_seqlen_k=0, seqused_k=None, block_table=None, num_splits=1,
             learnable_sink=None, k_descale=None) -> "FwdPlan":
    """The plan of the portable kernel for these arguments (the Hopper forward is never planned:
    it takes no decoding shapes), or over an FP8 cache the Gluon FP8 decode's (``Fp8DecodePlan``,
    when ``hopper_fp8_decode_reason`` takes the call; the environment is read now), for a caller that
    launches it many times itself (``tileattn.DecodePlan``): ``plan.run(q, k, v, out, lse, params, ...)``."""
    key = _plan_key(q, k, v, out, lse, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, seqused_k, block_table, num_splits, learnable_sink, k_descale)
    if k_descale is not None:
        # v's descale is not an argument here: the rule asks only whether both are given, and the
        # caller (``DecodePlan``) has checked v's with k's
        plan = _fp8_plan(key, q, k, v, out, lse, params, alibi_slopes, cu_seqlens_q, max_seqlen_k, seqused_k,
                         block_table, num_splits, learnable_sink, k_descale, k_descale)
        if plan is not None:
            return plan
    return plan_for(_PLANS, key, FwdPlan)


def _fp8_plan(key, q, k, v, out, lse, params: AttnParams, alibi_slopes, cu_seqlens_q, max_seqlen_k: int, seqused_k,
              block_table, num_splits: int, learnable_sink, k_descale, v_descale) -> Fp8DecodePlan | None:
    """The Gluon FP8 decode's plan of this call (kept per ``key``, the cache's shape and strides and
    the softmax scale, which its launch holds), or None where ``hopper_fp8_decode_reason`` declines."""
    if hopper_fp8_decode_reason(q, k, v, params, alibi_slopes=alibi_slopes, varlen=cu_seqlens_q is not None,
                                block_table=block_table, learnable_sink=learnable_sink, k_descale=k_descale,
                                v_descale=v_descale) is not None:
        return None
    return plan_for(_FP8_PLANS, (key, k.shape, k.stride(), v.stride(), params.softmax_scale), lambda _: Fp8DecodePlan(
        q, k, out, lse, params, block_table=block_table, seqused_k=seqused_k,
        max_seqlen_k=_bound(max_seqlen_k) if block_table is not None else 0, num_splits=num_splits,
        fallback=lambda: plan_for(_PLANS, key, FwdPlan)))


def plan_partials(q, k, v, *, params: AttnParams, max_seqlen_q: int, max_seqlen_k: int, seqused_k, block_table,
                  num_splits: int, k_descale=None):
    """One sequence's attention over a paged pool (a cascade's shared prefix, q (1, rows, H, D))
    as unmerged partial states over key splits, for the caller's ``merge_parts``: a plan with
    ``num_splits`` and ``run_partials(q, k, v, params, seqused_k, block_table, o_parts, lse_parts,
    k_descale, v_descale)`` writing (splits, 1, rows, H, Dv) / (splits, 1, H, rows) fp32, or None
    when the call does not split (the caller then makes the ordinary call). On Hopper, with no
    split count asked, the Gluon kernel (the query heads of a KV head packed as rows); else the
    portable kernel's split plan."""
    if num_splits == 0 and k_descale is None and hopper_partials_reason(q, k, v, params, block_table, seqused_k) is None:
        return HopperPartials(hopper_partials_splits(q, k, max_seqlen_k), max_seqlen_k)
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    key = _plan_key(q, k, v, out, lse, params, None, None, None, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                    num_splits, None, k_descale)
    plan = plan_for(_PLANS, key, FwdPlan)  # the portable kernel's (the Gluon FP8 decode takes few rows)
    return plan if plan.workspace_shapes is not None else None


def _stride_class(x: int) -> int:
    """A stride Triton specialises alike: 1, a multiple of 16, or neither; i64 past i32."""
    return x if x == 1 else (16 if x % 16 == 0 else 17) + (2**32 if x > 2**31 - 1 else 0)


def _bound(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0: unknown). The plan uses a packed or paged
    call's max_seqlen_q/k only as upper bounds: the kernel reads each sequence's own lengths."""
    return next_power_of_2(n) if n > 0 else n


def _plan_key(q, k, v, out, lse, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              seqused_k, block_table, num_splits, learnable_sink=None, k_descale=None) -> tuple:
    """Everything ``FwdPlan`` reads: the launch depends on the call through this tuple only.

    Of the optional tensors: alibi's strides, the batch of cu_seqlens, the block table's width
    and row stride, and each one's dtype (the kernel reads the rest by the layout contract; an
    FP8 cache's descales are contiguous (batch, nheads_k) fp32, named by one entry for both).
    A dense call with a fixed split count (``flash_attn_func``, as transformers calls it with a
    KV cache that grows every step) names its keys' length only by ``length_bucket`` and their
    strides only by how Triton classifies them (``_stride_class``): its plan takes the rest per
    call, so a growing cache does not make a new plan every step. Packed keys that are not paged,
    with a max_seqlen_k (a ``DecodePlan`` over transformers' left-padded caches reads every row in
    place: the packed view's token count and head stride grow every step), are named alike: their
    count is never read (the kernel reads each sequence's keys by cu_seqlens_k and seqused_k,
    max_seqlen_k bounds them) and their strides only by class, taken per call. A dense call's max_seqlen_q/k
    (the public functions pass its shapes) say nothing the shapes do not: they are left out;
    a packed or paged call's are rounded up to a power of two (``_bound``).

    A right window bound (causal included) leaves a single query per sequence every key: bottom-
    right aligned, it sits at the last key. Such calls (decoding, as engines make them: causal)
    get the plan without the right mask: one kernel variant fewer, and no spill (sm_90: the
    unsplit decode tile had 24 bytes of stack with the mask, none without).

    Whether v is a view of k's leading columns (``_v_is_k``, asked only of head dims above 256)
    is part of the key: a wide plan then reads the value tile from the key tile (``V_IS_K``).
    """
    one_query = (q.shape[1] if cu_seqlens_q is None else max_seqlen_q) == 1 and params.diag_shift == 0
    if cu_seqlens_q is None and block_table is None:  # dense: the shapes give the lengths
        max_seqlen_q = max_seqlen_k = 0
    else:  # upper bounds to the plan (grid, tile, splits): by power of two, so that a serving
        # loop, whose longest sequence grows every step, reuses its plans
        max_seqlen_q, max_seqlen_k = _bound(max_seqlen_q), _bound(max_seqlen_k)
    if cu_seqlens_q is None and block_table is None and seqused_k is None and num_splits > 0:
        ks, vs = k.stride(), v.stride()
        kv = ("dense", k.shape[0], k.shape[2:], v.shape[2:], length_bucket(q.shape[1], k.shape[1]),
              _stride_class(ks[0]), _stride_class(ks[1]), _stride_class(ks[2]),
              _stride_class(vs[0]), _stride_class(vs[1]), _stride_class(vs[2]))
    elif cu_seqlens_q is not None and block_table is None and max_seqlen_k > 0:  # packed (tokens, Hk, D)
        ks, vs = k.stride(), v.stride()
        kv = ("packed", k.shape[1:], v.shape[1:], _stride_class(ks[0]), _stride_class(ks[1]), _stride_class(vs[0]),
              _stride_class(vs[1]))
    else:
        kv = (None, k.shape, k.stride(), v.shape, v.stride())
    return (q.shape, q.stride(), kv, out.stride(), lse.stride(),
            q.dtype, k.dtype, v.dtype, out.dtype, lse.dtype, q.device,
            None if alibi_slopes is None else (alibi_slopes.stride(), alibi_slopes.dtype),
            None if cu_seqlens_q is None else (cu_seqlens_q.shape[0], cu_seqlens_q.dtype),
            None if cu_seqlens_k is None else cu_seqlens_k.dtype,
            None if seqused_k is None else seqused_k.dtype,
            None if block_table is None else (block_table.shape[1], block_table.stride(0), block_table.dtype),
            None if learnable_sink is None else learnable_sink.dtype,
            None if k_descale is None else k_descale.dtype,
            max_seqlen_q, max_seqlen_k, num_splits,
            params.window_left >= 0, params.window_right >= 0 and not one_query, softcap_form(q.dtype, params.softcap),
            params.dropout_p > 0, max(k.shape[-1], v.shape[-1]) > TAIL_ABOVE and _v_is_k(k, v))


class FwdPlan:
    """The forward launch of one shape class: kernel flags, tiles, split count, grid, workspace shape.

    Built from a ``_plan_key`` tuple alone, so every call with that key launches the same
    compiled kernels (``_launch.Launch``) with the same integer arguments; ``run`` passes the
    tensors and the per-call scalars (scale, softcap, window sizes, dropout seed).

    A mixed batch (packed queries over a KV cache, some sequences with more rows than the decode
    tile holds) is two launches: this plan's serves the sequences of at most
    ``DECODE_MAX_ROWS // group`` queries, and ``self.long``, a plan of its own made from the same
    key with ``min_seqlen_q``, the longer ones, unsplit, straight into the outputs.
    """

    def __init__(self, key: tuple, min_seqlen_q: int = 0):
        (q_shape, q_stride, kv, o_stride, l_stride,
         q_dtype, k_dtype, v_dtype, o_dtype, l_dtype, device,
         alibi, cu_q, cu_k, seqused, table, sink, descale, max_seqlen_q, max_seqlen_k, num_splits,
         mask_left, mask_right, (has_softcap, precise_tanh), has_dropout, v_is_k) = key
        # keys whose strides (dense: and length) come with each call: "dense" or "packed", else None
        self.kv_per_call, *kv = kv
        if self.kv_per_call == "dense":  # the strides' classes stand in for them (``_stride_class``), length 0
            k_shape, v_shape = (kv[0], 0, *kv[1]), (kv[0], 0, *kv[2])
            k_stride, v_stride, bucket = kv[4:7], kv[7:10], kv[3]
        elif self.kv_per_call == "packed":  # the same, token count 0 (max_seqlen_k bounds the keys)
            k_shape, v_shape = (0, *kv[0]), (0, *kv[1])
            k_stride, v_stride = (kv[2], kv[3], 1), (kv[4], kv[5], 1)
        else:
            k_shape, k_stride, v_shape, v_stride = kv
        varlen = cu_q is not None
        paged = table is not None
        if varlen:
            batch = cu_q[0] - 1
            _, nheads, head_dim = q_shape
            seqlen_q = max_seqlen_q if max_seqlen_q > 0 else q_shape[0]  # an upper bound suffices
            stride_qb, stride_qs, stride_qh = 0, q_stride[0], q_stride[1]
            stride_ob, stride_os, stride_oh = 0, o_stride[0], o_stride[1]
            stride_lb, stride_lh, stride_ls = 0, l_stride[0], l_stride[1]
        else:
            batch, seqlen_q, nheads, head_dim = q_shape
            stride_qb, stride_qs, stride_qh = q_stride[:3]
            stride_ob, stride_os, stride_oh = o_stride[:3]
            stride_lb, stride_lh, stride_ls = l_stride
        if paged or not varlen:  # (B or blocks, S or page, Hk, D)
            nheads_k = k_shape[2]
            stride_kb, stride_ks, stride_kh = k_stride[:3]
            stride_vb, stride_vs, stride_vh = v_stride[:3]
        else:  # packed keys (Tk, Hk, D)
            nheads_k = k_shape[1]
            stride_kb, stride_ks, stride_kh = 0, k_stride[0], k_stride[1]
            stride_vb, stride_vs, stride_vh = 0, v_stride[0], v_stride[1]
        # (keys a sequence's cache holds, blocks of the pool): what ``CHECK_CACHE`` checks against
        cache_bounds = (table[0] * k_shape[1], k_shape[0]) if paged else (0 if varlen else k_shape[1], 0)
        self.cache_top, self.num_blocks = cache_bounds
        if paged:
            page_size = k_shape[1]
            seqlen_k = max_seqlen_k if max_seqlen_k > 0 else table[0] * page_size
        elif varlen:
            page_size = 1
            seqlen_k = max_seqlen_k if max_seqlen_k > 0 else k_shape[0]
        else:
            page_size = 1
            seqlen_k = k_shape[1]
        group = nheads // nheads_k
        head_dim_v = v_shape[-1]  # the output's head dim too; may differ from q/k's (MLA)
        head_dim, head_dim_tail = _split_head_dim(head_dim)  # q/k: main part and tail (head dims above 256)
        head_dim_pad = max(16, next_power_of_2(head_dim))
        head_dim_tail_pad = max(16, next_power_of_2(head_dim_tail)) if head_dim_tail else 0
        head_dim_v_pad = max(16, next_power_of_2(head_dim_v))
        wide = is_wide(head_dim_pad, head_dim_tail_pad, head_dim_v_pad)
        v_is_k = v_is_k and wide and head_dim_v == head_dim  # the key tile's main part is the value tile
        elem_size = q_dtype.itemsize
        if wide:  # shared-memory estimates: Q and K tiles main + tail wide, V's own (none if it is K's)
            smem_dim, v_width = head_dim_pad + head_dim_tail_pad, 0 if v_is_k else head_dim_v_pad
        else:  # the larger tile width for all three
            smem_dim, v_width = max(head_dim_pad, head_dim_v_pad), None

        short = DECODE_MAX_ROWS // group  # queries of the longest sequence the decode tile serves
        mixed = varlen and seqused is not None and seqlen_q > short >= 1 and min_seqlen_q == 0
        if min_seqlen_q:  # the long sequences of a mixed batch: never split
            num_splits = 1
        rows_q = short if mixed else seqlen_q  # queries of the longest sequence this launch serves
        pack_gqa = group > 1 and rows_q <= PACK_GQA_MAX_SEQLEN_Q
        max_rows = rows_q * group if pack_gqa else rows_q
        heads_grid = nheads_k if pack_gqa else nheads
        decode = max_rows <= DECODE_MAX_ROWS or wide  # a fixed tile (wide: for every row count)
        block_m = max(16, next_power_of_2(max_rows)) if decode else 128  # 128: the usual prefill tile
        if wide:
            block_m = min(block_m, WIDE_FP8_BLOCK_M if descale is not None else WIDE_BLOCK_M)
        if mixed:
            # A mixed batch's short sequences (up to 64 rows) take the 16-row tile whatever their
            # count: sized for 64 rows the decode tile needs 148 KB of shared memory and spills at
            # 255 registers (one program per SM), at 16 rows 74 KB and 204 (three per SM; sm_90
            # ptxas). A decoding row (GQA 4: 4 rows) fits one tile; a sequence of 5-16 queries is
            # read by 2-4 programs.
            block_m = MIXED_BLOCK_M
        kv_elem_size = None
        if wide:  # the wide tiles were chosen by ptxas with 2-byte estimates (perf-notes): kept as measured
            keys = WIDE_BLOCK_N if v_is_k and descale is None else WIDE_BLOCK_N_SEPARATE
            block_n, stages = _decode_tile(block_m, page_size if paged else 0, smem_dim, elem_size, v_width, keys,
                                           WIDE_MAX_STAGES)
        else:
            kv_elem_size = k_dtype.itemsize
            block_n, stages = _decode_tile(block_m, page_size if paged else 0, smem_dim, elem_size,
                                           kv_elem_size=kv_elem_size)
        if num_splits == 0:
            # a mixed batch's short sequences: most are decoding rows, one tile each (the grid's
            # other tiles of them end at once)
            programs = batch * heads_grid * (1 if mixed else cdiv(max_rows, block_m))
            smem = _smem_bytes(block_m, block_n, stages, smem_dim, elem_size, v_width, kv_elem_size)
            ragged = seqused is not None and max_rows <= DECODE_MAX_ROWS  # the small decode tile
            num_splits = _auto_splits(programs, cdiv(seqlen_k, block_n), device, smem, waves=2 if paged else 1,
                                      ragged_blocks=seqlen_k // RAGGED_MIN_KEYS if ragged else 0)
        split_kv = num_splits > 1
        self.num_splits, self.device = num_splits, device
        self.device_index = device.index if device.type == "cuda" else -1
        self.long = FwdPlan(key, min_seqlen_q=short + 1) if mixed else None
        self.marked = split_kv and mixed  # the long sequences' rows, which the combine skips

        self.workspace_shapes = None
        if split_kv:  # fp32 partial states (splits, B, Sq, H, D) and (splits, B, H, Sq); varlen: B = 1
            rows_b, rows_s = (1, q_shape[0]) if varlen else (batch, seqlen_q)
            self.workspace_shapes = ((num_splits, rows_b, rows_s, nheads, head_dim_v),
                                     (num_splits, rows_b, nheads, rows_s))
            o_strides = contiguous_strides(self.workspace_shapes[0])[:4]
            l_strides = contiguous_strides(self.workspace_shapes[1])[:4]
            if varlen:  # the kernel indexes packed tokens with batch stride 0
                o_strides = (o_strides[0], 0, *o_strides[2:])
                l_strides = (l_strides[0], 0, *l_strides[2:])
        else:
            o_strides = (0, stride_ob, stride_os, stride_oh)
            l_strides = (0, stride_lb, stride_lh, stride_ls)

        dot_dtype, dot_precision = dot_types(q_dtype, fp8_cache=descale is not None)
        self.ints = (
            stride_qb, stride_qs, stride_qh,
            stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh,
            *o_strides, *l_strides,
            alibi[0][0] if alibi else 0, alibi[0][1] if alibi else 0, table[1] if paged else 0,
            nheads, seqlen_q, seqlen_k, max_rows, min_seqlen_q, num_splits, *cache_bounds,
        )
        flags = dict(
            GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEAD_DIM_V=head_dim_v,
            HEAD_DIM_V_PAD=head_dim_v_pad, PAGE_SIZE=page_size,
            IS_VARLEN=varlen, IS_PAGED=paged, HAS_SEQUSED_K=seqused is not None,
            PREFETCH_PAGES=paged and PREFETCH_PAGES[
                "prefill" if not decode else "decode" if descale is None else "decode_fp8"],
            PACK_GQA=pack_gqa, SPLIT_KV=split_kv, IS_FP8=descale is not None,
            MASK_LEFT=mask_left, MASK_RIGHT=mask_right,
            HAS_SOFTCAP=has_softcap, PRECISE_TANH=precise_tanh, HAS_ALIBI=alibi is not None,
            HAS_DROPOUT=has_dropout, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
            HAS_SINK=sink is not None, HEAD_DIM_TAIL=head_dim_tail, HEAD_DIM_TAIL_PAD=head_dim_tail_pad,
            V_IS_K=v_is_k, SINGLE_LOOP=wide, CHECK_CACHE=False, CHECK_BLOCK_P=128,  # the check: checking_launch
            MERGE_SPLITS=False, MERGE_ROWS=1, MERGE_BLOCK_S=1, MERGE_UNROLL=1,  # the merge: merged
        )
        self.flags = flags

        def grid(block_m):
            return (batch * heads_grid * cdiv(max_rows, block_m), num_splits, 1)

        self._grid = grid
        ws_dtype = torch.float32 if split_kv else None
        # what the compiled kernel depends on beyond its constexprs (``_launch.launch_for``): the
        # tensors' dtypes (the merged launch's outputs and counters: None but in ``merged``'s)
        tensors = (None if alibi is None else alibi[-1], sink, None if cu_q is None else cu_q[-1], cu_k, seqused,
                   None if table is None else table[-1], descale, descale)
        ints = int_class(_attn_fwd_kernel, _FWD_FIRST_INT, self.ints)
        parts = (q_dtype, k_dtype, v_dtype, ws_dtype or o_dtype, ws_dtype or l_dtype)
        self._signature = ((*parts, None, None, None, *tensors), ints)
        self._merged_signature = ((*parts, o_dtype, l_dtype, torch.int32, *tensors), ints)
        self.tuned = self.tune_key = None
        self.merged = None  # the split launch that merges its splits itself (``MERGE_SPLITS``), or None
        if decode:
            num_warps = WIDE_NUM_WARPS if wide and block_m == WIDE_BLOCK_M else DECODE_NUM_WARPS
            self.fwd = launch_for(_attn_fwd_kernel, dict(flags, BLOCK_M=block_m, BLOCK_N=block_n),
                                  dict(num_warps=num_warps, num_stages=stages), self._signature)
            self.grid = grid(block_m)
            # the small decode tile's splits (not the wide tile's, nor a mixed batch's), where the
            # outputs lie as one split of the workspace (the merge writes them at the partials' offsets)
            one_split = (o_strides[1:] == (stride_ob, stride_os, stride_oh)
                         and l_strides[1:] == (stride_lb, stride_lh, stride_ls))
            merge = merge_constexprs(min(block_m, next_power_of_2(max_rows)), num_splits, head_dim_v, head_dim_v_pad,
                                     num_warps) if split_kv and not wide and not mixed and one_split else None
            if merge is not None:
                self.merged = launch_for(_attn_fwd_kernel, dict(self.fwd.constexprs, **merge), self.fwd.options,
                                         self._merged_signature)
        elif autotune_enabled():
            self.fwd = None  # until the autotuner has chosen for this tune key (``_tuned_launch``)
            self.tuned = _attn_fwd_tuned(bucket if self.kv_per_call == "dense" else
                                         length_bucket(seqlen_q, seqlen_k))
            self.tune_key = tuple(flags[name] for name in _TUNE_KEY) + (q_dtype,)
        else:  # the first config that fits in shared memory
            self._use_config(_prune_configs(_prefill_configs(), {"Q": torch.empty((), dtype=q_dtype)},
                                            HEAD_DIM_PAD=head_dim_pad, HEAD_DIM_V_PAD=head_dim_v_pad)[0])
        self.combine = None
        if split_kv:
            self.combine, self.combine_grid, self.combine_ints = combine_launch(
                self.workspace_shapes, varlen, o_stride, l_stride, head_dim_v, head_dim_v_pad, o_dtype, l_dtype, sink,
                self.marked)

    def run(self, q, k, v, out, lse, params: AttnParams, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
            block_table, workspace: tuple | None = None, learnable_sink=None, k_descale=None, v_descale=None,
            combine: bool = True) -> None:
        """Launch the plan on one call's tensors (they must have the plan's key, sinks and descales
        included). ``workspace``: the split partials' buffers, shaped as ``workspace_shapes``
        (``new_workspace``; contiguous), else they are allocated here. ``combine=False`` leaves
        the split partials in ``workspace`` for the caller to merge (``merge_parts``)."""
        if self.workspace_shapes is not None:
            o_dst, l_dst = workspace or self.new_workspace(q.device)
            if self.marked:  # rows no split of this launch writes keep the mark
                l_dst[0].view(torch.int32).fill_(UNSPLIT_MARK.value)
        else:
            o_dst, l_dst = out, lse
        args = (q, k, v, o_dst, l_dst, None, None, None, alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k,
                seqused_k, block_table, k_descale, v_descale, *self.call_ints(k, v), *scalar_args(params, q.shape[-2]))
        if self.fwd is not None:
            self.fwd(self.grid, *args)
        else:
            self._tuned_launch(args)
        if self.long is not None:
            self.long.run(q, k, v, out, lse, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                          learnable_sink=learnable_sink, k_descale=k_descale, v_descale=v_descale)
        if self.combine is not None and combine:
            self.combine(self.combine_grid, o_dst, l_dst, out, lse, learnable_sink, *self.combine_ints)

    def checking_launch(self, merged: bool = False) -> Launch | None:
        """``fwd`` (``merged``: ``merged``) with the KV cache's value check folded in (the kernel's
        ``CHECK_CACHE``, compiled with Triton's ``debug`` option and ``sanitize_overflow`` off), for a
        caller that would otherwise launch ``gpu.checks``' kernel before it with the lengths' top at
        the cache's capacity (no append) and no left pads; None where the fold would not check what
        that kernel does: no tile yet, a mixed batch, packed queries, no ``seqused_k``, a left window
        (pages before it are read by no program), no query rows (no program), a block table
        without columns (nothing to clamp a bad length's page ids to), or no merged launch."""
        flags, fwd = self.flags, self.merged if merged else self.fwd
        if (fwd is None or self.long is not None or flags["IS_VARLEN"] or not flags["HAS_SEQUSED_K"]
                or flags["MASK_LEFT"] or self.grid[0] == 0 or flags["IS_PAGED"] and self.cache_top == 0):
            return None
        return launch_for(_attn_fwd_kernel,
                          dict(fwd.constexprs, CHECK_CACHE=True, CHECK_BLOCK_P=32 * fwd.options["num_warps"]),
                          dict(fwd.options, debug=True, sanitize_overflow=False),
                          self._merged_signature if merged else self._signature)

    def call_ints(self, k, v) -> tuple:
        """The integer arguments of a launch on these keys and values: ``ints``, with the call's own
        key and value strides (k then v, 3 each) and key length when the plan takes them per call."""
        ints, per_call = self.ints, self.kv_per_call
        if per_call == "dense":
            ks, vs, i, n = k.stride(), v.stride(), _K_INTS, _SEQLEN_K_INT
            ints = (*ints[:i], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], *ints[i + 6:n], k.shape[1], *ints[n + 1:])
        elif per_call == "packed":  # (tokens, Hk, D): batch stride 0, as the plan has it
            ks, vs, i = k.stride(), v.stride(), _K_INTS
            ints = (*ints[:i], 0, ks[0], ks[1], 0, vs[0], vs[1], *ints[i + 6:])
        return ints

    def run_partials(self, q, k, v, params: AttnParams, seqused_k, block_table, o_parts, lse_parts, k_descale=None,
                     v_descale=None) -> None:
        """``plan_partials``'s launch: the split partial states into ``o_parts``/``lse_parts``, unmerged."""
        self.run(q, k, v, None, None, params, None, None, None, seqused_k, block_table, workspace=(o_parts, lse_parts),
                 k_descale=k_descale, v_descale=v_descale, combine=False)

    def new_workspace(self, device) -> tuple | None:
        """fp32 buffers for the split partial states (o, lse) (``partials_workspace``), or None
        without splits."""
        return None if self.workspace_shapes is None else partials_workspace(self.workspace_shapes, device)

    def _use_config(self, config: triton.Config) -> None:
        self.fwd = launch_for(_attn_fwd_kernel, dict(self.flags, **config.kwargs), config_options(config),
                              self._signature)
        self.grid = self._grid(config.kwargs["BLOCK_M"])

    def _tuned_launch(self, args) -> None:
        """A prefill launch before this plan knows its config: through the autotuner, which
        times the configs the first time its key is seen; the plan keeps the config chosen."""
        config = self.tuned.best(self.tune_key)
        if config is None:
            self.tuned.launch(lambda meta: self._grid(meta["BLOCK_M"]), self.tune_key, args, self.flags)
            self._use_config(self.tuned.best(self.tune_key))
        else:
            self._use_config(config)
            self.fwd(self.grid, *args)


def scalar_args(params: AttnParams, nheads: int) -> tuple:
    """The forward kernel's arguments after the integers, for a call of ``nheads`` query heads:
    the scale (base 2), softcap, window, diagonal shift and dropout's counters, seed, threshold
    and rescale."""
    dropout_p = params.dropout_p
    return (float(params.softmax_scale) * LOG2E.value, float(params.softcap), params.window_left,
            params.window_right, params.diag_shift, *params.dropout_offsets(nheads), params.dropout_seed,
            keep_threshold(dropout_p), 1.0 / (1.0 - dropout_p) if dropout_p > 0 else 1.0)
