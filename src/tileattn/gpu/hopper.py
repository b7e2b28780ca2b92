"""Launcher of the Hopper forward kernel (``kernels/attn_fwd_hopper.py``) and the rule that picks it.

``attn_fwd`` of ``gpu/attention.py`` asks ``hopper_fwd_reason`` first: ``None`` means the
Hopper kernel takes the call; otherwise the string says why the portable kernel runs (the
benchmarks print it). ``TILEATTN_HOPPER=0`` turns the Hopper path off.

Work items of 128 query rows, each computed by two consumer warpgroups of 64 rows and one
producer warp (``kernels/attn_fwd_hopper.py``): one program per SM walks them when they cost
the same (dense, no mask) and for dense causal calls whose grouped work order holds enough
(sequence, head) pairs (``_order_group``, ``PERSISTENT_MIN_GROUP``), else one program per item.
Tiles per head dim: (BLOCK_N, STAGES); shared memory is the two Q tiles plus STAGES K and V tiles: hdim 128
-> 32 + 2 x 2 x 32 KB = 160 KB, hdim 64 -> 16 + 3 x 2 x 16 KB = 112 KB, hdim 256 -> 64 +
2 x 2 x 32 KB = 192 KB. Registers: the kernel runs 12 warps (3 warpgroups), so at most
``MAXNREG`` = 168 per thread on average; the producer gives back all but ``PRODUCER_REGS`` and
each consumer thread gets ``CONSUMER_REGS`` (2 x 128 x 240 + 128 x 24 <= 168 x 384).
"""

from __future__ import annotations

import functools
import os

import torch

from ..kernels.common import LOG2E
from ..contract import AttnParams
from ._launch import arg_classes, cdiv, launch_for
from ._tuning import interpreting

__all__ = ["hopper_fwd_reason", "hopper_attn_fwd", "hopper_partials_reason", "hopper_partials_splits",
           "hopper_attn_partials", "HopperPartials", "HOPPER_TILES"]

HOPPER_TILES = {64: (128, 3), 128: (128, 2), 256: (64, 2)}  # head_dim -> (BLOCK_N, STAGES)
BLOCK_M, ROWS_WG = 128, 64
MAXNREG, CONSUMER_REGS, PRODUCER_REGS = 168, 240, 24
# The work order of unequal items (_order_group): groups of (sequence, head) pairs whose keys and
# values fit ORDER_L2_BYTES (about half the L2), heaviest blocks first across a group; a group of
# fewer than ORDER_MIN_GROUP pairs keeps one pair at a time. Measured on the H200, causal, 16k
# tokens a batch (docs/perf-notes.md, 2026-12-01 05:20): groups of 12-48 pairs +1.6 to +3.7 %
# (hdim 128 at 2k-4k, hdim 64 at 2k-8k); groups of 3-6: -4.6 to +0.8 %.
ORDER_L2_BYTES, ORDER_MIN_GROUP = 24 << 20, 12
# Dense causal calls whose groups hold this many pairs run on a persistent grid walking the grouped
# order: measured (05:29) +10 / +2 % at hdim 128 (1k / 2k; groups 48 / 24), +23 / +17 / +10 % at
# hdim 64 (1k / 2k / 4k; 96 / 48 / 24); with groups of 12, -4 % at hdim 128 (4k), +5 % at hdim 64 (8k).
PERSISTENT_MIN_GROUP = 24
MIN_SEQLEN_Q = 128  # fewer query rows: decoding shapes, which the portable kernel's split-KV path serves
# Short calls the portable kernels serve faster: (head dim, causal, "fwd" or "bwd") -> the most
# query rows (per sequence) sent there; causal means no window beyond causality, not causal no
# mask at all. Measured on the H200 at 16k tokens a batch, portable vs Gluon TFLOP/s, medians of
# 3 interleaved rounds (docs/perf-notes.md, 2026-11-30 17:05): head dim 64 causal, forward 205 vs
# 138 at 512 rows and 262 vs 218 at 1024, backward 164 vs 135 at 512 (1024: 219 vs 267, Gluon);
# head dim 128 causal, forward 211 vs 201 and backward 164 vs 155 at 512; head dim 128 without a
# mask, backward 259 vs 236 at 512 (forward: 317 vs 396, Gluon). From 1k (head dim 128) and 2k
# (64) on the Gluon kernels are ahead everywhere. Since the persistent grouped order of dense causal
# calls (2026-12-01 05:37), the Gluon forward at head dim 128, causal, 512 rows: 229 against 210.
# The backward's entries went on 2026-12-01 11:40: the Gluon backward (two launches at <= 1024 rows,
# hopper_bwd.REDUCE_MIN_ROWS) against the portable kernels at 512 rows, backward alone: head dim 128
# causal 225 against 163, unmasked 306 against 260; head dim 64 causal 186 against 162 (the Gluon
# figures from the 10:55 run, the portable ones from 11:40: different hosts, margins of 15-38 %).
SHORT_PORTABLE = {(64, True, "fwd"): 1024}
_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def hopper_enabled() -> bool:
    return os.environ.get("TILEATTN_HOPPER", "1") not in ("0", "false", "no")


@functools.lru_cache(maxsize=None)
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1)
def _gluon_available() -> bool:
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and 16-byte multiples for every stride but the last.
    (Asked on every call of the rules: a loop, not ``all`` over a generator.)"""
    if t.data_ptr() % 16:
        return False
    size = t.element_size()
    for s in t.stride()[:-1]:
        if s * size % 16:
            return False
    return True


def device_reason(q) -> str | None:
    """Why the Gluon kernels cannot run on ``q``'s device, or are turned off there (one short
    phrase), or None: they can. The forward's and the backward's rules both ask it."""
    if not hopper_enabled():
        return "TILEATTN_HOPPER=0"
    if q.device.type != "cuda" or interpreting():
        return "not a CUDA device"
    if not _is_hopper(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return "not sm_90"
    if not _gluon_available():
        return "Triton has no Gluon"
    return None


def options_reason(params: AttnParams, alibi_slopes) -> str | None:
    """Why the Gluon kernels (forward and backward alike) cannot apply these options, or None."""
    if not params.softmax_scale > 0:
        return "softmax_scale <= 0"
    if params.softcap > 0 or alibi_slopes is not None or params.dropout_p > 0:
        return "softcap / ALiBi / dropout"
    if params.diag_shift:
        return "shifted diagonal (a ring block)"
    return None


def short_call(params: AttnParams, head_dim: int, rows: int, kind: str) -> str | None:
    """Why the portable kernels take this call (``SHORT_PORTABLE``), or None: ``kind`` "fwd" or
    "bwd", ``rows`` the longest sequence's queries."""
    if params.window_left >= 0 or params.window_right > 0:
        return None
    causal = params.window_right == 0
    if rows <= SHORT_PORTABLE.get((head_dim, causal, kind), 0):
        return f"short {'causal' if causal else 'unmasked'} call at head dim {head_dim}"
    return None


def hopper_fwd_reason(q, k, v, params: AttnParams, *, alibi_slopes, varlen: bool, paged: bool, seqused_k,
                      num_splits: int, max_seqlen_q: int = 0) -> str | None:
    """None when the Hopper kernel can compute this forward call, else why not (one short phrase).

    The shape checks come first: a decoding call, the most frequent and the shortest, is told
    no before the environment and the device are looked at."""
    if paged or seqused_k is not None:
        return "paged / seqused_k"
    if num_splits > 1:
        return "explicit KV splits"
    seq_dim = 0 if varlen else 1
    rows = max_seqlen_q if varlen and max_seqlen_q > 0 else q.shape[seq_dim]
    if rows < MIN_SEQLEN_Q:
        return "decoding shape"
    short = short_call(params, q.shape[-1], rows, "fwd")
    if short is not None:
        return short
    why = _operands_reason(q, k, v)
    if why is not None:
        return why
    if q.shape[0] == 0 or k.shape[seq_dim] == 0:
        return "empty batch or keys"
    return options_reason(params, alibi_slopes) or _aligned_reason(q, k, v)


def _operands_reason(q, k, v) -> str | None:
    """Why the Gluon forward cannot take these tensors (device, dtypes, head dims), or None."""
    why = device_reason(q)
    if why is not None:
        return why
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype} / {k.dtype} / {v.dtype}"
    if q.shape[-1] not in HOPPER_TILES or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]}"
    return None


def _aligned_reason(*tensors) -> str | None:
    return None if all(_tma_ok(t) for t in tensors) else "strides not 16-byte aligned"


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, str(dtype).removeprefix("torch.")))


def launch_gluon(kernel, grid: tuple[int, int, int], args: tuple, constexprs: dict) -> None:
    """Launch Gluon ``kernel`` (one consumer warpgroup per default partition, the register split
    of this module) through ``_launch.Launch``: after a shape class's first call, straight to
    the compiled kernel's launcher, without ``JITFunction.run`` binding and specialising ~30
    arguments (for a portable kernel ~36 µs a launch in benchmarks/host_launch.py's stand-in;
    here per call: three descriptors, ``arg_classes`` and the lookup, ~25 µs on that machine). The
    ``Launch`` is kept per (kernel, the caller's constexprs in its order, ``arg_classes``): no
    sorted key per call."""
    classes = arg_classes(kernel, args)
    key = (kernel, tuple(constexprs.items()), classes)  # the caller's constexprs in its own order
    launch = _GLUON_LAUNCHES.get(key)
    if launch is None:
        launch = _GLUON_LAUNCHES[key] = launch_for(
            kernel, dict(constexprs, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4),
            {"maxnreg": MAXNREG}, classes)
    launch(grid, *args)


_GLUON_LAUNCHES: dict = {}  # launch_gluon's (kernel, constexprs, classes) -> launch_for's Launch


def _descriptor(t: torch.Tensor, block: tuple[int, ...]):
    """A TMA descriptor of ``t`` read in tiles of ``block`` (NVMMA shared layout).

    Triton's constructor validates it (rank, block shape, dtype, strides, base alignment: ~2.5 µs
    on the 2-core CPU machine, and a launch makes 3 to 8). All but the base's alignment depend only
    on (shape, strides, block, dtype): the fields of the first validated descriptor of those are
    kept (``_DESCRIPTOR_FIELDS``, without its base), and a later one is a copy of them with ``t`` as
    its base, whose alignment is asserted as the constructor does (~0.9 µs)."""
    key = (t.shape, t.stride(), block, t.dtype)
    kept = _DESCRIPTOR_FIELDS.get(key)
    if kept is None:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        desc = TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _smem_layout(block, t.dtype))
        if len(_DESCRIPTOR_FIELDS) >= _MAX_DESCRIPTORS:
            _DESCRIPTOR_FIELDS.clear()
        _DESCRIPTOR_FIELDS[key] = (type(desc), {name: value for name, value in vars(desc).items() if name != "base"})
        return desc
    cls, fields = kept
    assert t.data_ptr() % 16 == 0, "base must be 16-byte aligned"
    desc = object.__new__(cls)
    desc.__dict__.update(fields)
    desc.base = t
    return desc


_DESCRIPTOR_FIELDS: dict = {}  # (shape, strides, block, dtype) -> (descriptor class, its fields but the base)
_MAX_DESCRIPTORS = 1024  # kept field sets; all are dropped when full (shapes that do not come back)


def hopper_attn_fwd(q, k, v, out, lse, *, params: AttnParams, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q: int = 0, max_seqlen_k: int = 0, learnable_sink=None) -> None:
    """Forward into ``out``/``lse`` (dense, or packed with ``cu_seqlens_q/k``; ``learnable_sink``
    fp32 (nheads,) or None); the call must have passed ``hopper_fwd_reason``."""
    varlen = cu_seqlens_q is not None
    if varlen:  # packed (T, H, D) tensors seen as batch 1 by the descriptors; lse (H, T)
        batch = cu_seqlens_q.shape[0] - 1
        seqlen_q = max_seqlen_q if max_seqlen_q > 0 else q.shape[0]
        seqlen_k = max_seqlen_k if max_seqlen_k > 0 else k.shape[0]
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        o_strides = (0, out.stride(0), out.stride(1), 0)
        l_strides = (0, lse.stride(0), lse.stride(1), 0)
    else:
        batch, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        o_strides = (out.stride(0), out.stride(1), out.stride(2), 0)
        l_strides = (lse.stride(0), lse.stride(1), lse.stride(2), 0)
    block_n, stages = HOPPER_TILES[q.shape[3]]
    works = cdiv(seqlen_q, BLOCK_M) * batch * q.shape[2]
    if varlen or params.window_left >= 0 or params.window_right >= 0:
        # Items of unequal cost (causal diagonal, windows, packed lengths): one program per item,
        # so the hardware's block scheduler balances them. A static round-robin over one program
        # per SM in the order of one (sequence, head) pair at a time measured 435 against 625
        # TFLOP/s at hdim 128, causal, 16k; over the grouped order (_order_group) with large
        # groups it balances: dense causal calls with groups of PERSISTENT_MIN_GROUP or more
        # pairs run persistent (docs/perf-notes.md, 2026-12-01 05:29).
        group = _order_group(k, v, seqlen_k, q.shape[2], batch * q.shape[2])
        dense_causal = not varlen and params.window_left < 0 and params.window_right == 0
        programs = min(works, _sms(q)) if dense_causal and group >= PERSISTENT_MIN_GROUP else works
    else:  # equal items: one program per SM walks them, overlapping one item's tail with the next's loads
        programs, group = min(works, _sms(q)), 1
    _launch_fwd(q, k, v, out, lse, o_strides, l_strides, params, batch, seqlen_q, seqlen_k, programs, block_n, stages,
                learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, group=group)


def _order_group(k, v, seqlen_k: int, nheads: int, pairs: int) -> int:
    """How many of the call's ``pairs`` (sequence, query head) pairs the kernel's work order takes
    at a time (``_work`` of kernels/attn_fwd_hopper.py: heaviest blocks first across a group): as
    many as keep the keys and values they read within ``ORDER_L2_BYTES`` (the ``nheads`` query
    heads share k's KV heads), or 1 where that is fewer than ``ORDER_MIN_GROUP``."""
    per_head = seqlen_k * (k.shape[-1] + v.shape[-1]) * k.element_size() * k.shape[-2] // nheads
    group = min(pairs, ORDER_L2_BYTES // max(per_head, 1))
    return group if group >= ORDER_MIN_GROUP else 1


def _sms(q) -> int:
    return _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()) if q.is_cuda else 132


def _launch_fwd(q, k, v, out, lse, o_strides, l_strides, params: AttnParams, batch, seqlen_q, seqlen_k, programs,
                block_n, stages, *, learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                block_table=None, qpack=1, num_splits=1, tiles_per_split=2**30, group=1) -> None:
    """The one launch of the Gluon forward: descriptors, integer arguments, flags. q, k, v are 4-D
    (batch, seqlen, heads, dim), k and v the pool (num_blocks, page, heads_k, dim) with
    ``block_table``; ``o_strides``/``l_strides`` are (batch, seqlen, head, split) and (batch,
    head, seqlen, split) of ``out``/``lse``."""
    from ..kernels.attn_fwd_hopper import _attn_fwd_hopper_kernel

    nheads, head_dim, nheads_k = q.shape[2], q.shape[3], k.shape[2]
    if qpack > 1:  # rows (query, head of the KV head's group): a 5-D view (B, S, H_k, qpack, D)
        q5 = q.unflatten(2, (nheads // qpack, qpack))
        q_desc = _descriptor(q5, (1, ROWS_WG // qpack, 1, qpack, head_dim))
    else:
        q_desc = _descriptor(q, (1, ROWS_WG, 1, head_dim))
    page = k.shape[1] if block_table is not None else 0
    kv_rows = min(page, block_n) if page else block_n
    k_desc = _descriptor(k, (1, kv_rows, 1, head_dim))
    v_desc = _descriptor(v, (1, kv_rows, 1, head_dim))
    table = (block_table.stride(0), block_table.shape[1]) if block_table is not None else (0, 0)
    args = (q_desc, k_desc, v_desc, out, lse, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
            *o_strides, *l_strides, *table, batch, nheads, seqlen_q, seqlen_k, num_splits, tiles_per_split, group,
            params.softmax_scale * LOG2E.value, params.window_left, params.window_right)
    launch_gluon(_attn_fwd_hopper_kernel, (programs, 1, 1), args, dict(
        GROUP=nheads // nheads_k, QPACK=qpack, IS_VARLEN=cu_seqlens_q is not None, HAS_SEQUSED=seqused_k is not None,
        MASK_LEFT=params.window_left >= 0, MASK_RIGHT=params.window_right >= 0, HAS_SINK=learnable_sink is not None,
        PAGE=page, BLOCK_N=block_n, STAGES=stages))


def hopper_partials_reason(q, k_cache, v_cache, params: AttnParams, block_table, seqused_k) -> str | None:
    """None when ``hopper_attn_partials`` can compute this call, else why not: one sequence
    (q (1, rows, heads, dim)) over a paged pool, no mask (a cascade's shared prefix)."""
    if q.shape[0] != 1 or block_table is None or seqused_k is None:
        return "not one sequence over a paged pool"
    if params.window_left >= 0 or params.window_right >= 0:
        return "masked"
    why = _operands_reason(q, k_cache, v_cache)
    if why is not None:
        return why
    block_n, page = HOPPER_TILES[q.shape[-1]][0], k_cache.shape[1]
    if not (page % block_n == 0 or (block_n % page == 0 and page % 8 == 0)):
        return f"pages of {page} keys"
    if ROWS_WG % (q.shape[2] // k_cache.shape[2]):
        return "query heads per KV head do not divide 64"
    return options_reason(params, None) or _aligned_reason(q, k_cache, v_cache)


def hopper_partials_splits(q, k_cache, max_seqlen_k: int) -> int:
    """How many key splits ``hopper_attn_partials`` makes: enough work items for one per SM, each
    split at least 4 key tiles."""
    block_n = HOPPER_TILES[q.shape[-1]][0]
    return max(1, min(_sms(q) // _partials_items(q, k_cache), cdiv(max_seqlen_k, block_n) // 4))


def _partials_items(q, k_cache) -> int:
    """Work items of one key split: query blocks of the packed rows (rows x query heads per KV
    head) for each KV head."""
    return cdiv(q.shape[1] * (q.shape[2] // k_cache.shape[2]), BLOCK_M) * k_cache.shape[2]


class HopperPartials:
    """``gpu.attention.plan_partials``'s plan on Hopper: ``num_splits`` key splits of the Gluon kernel."""

    def __init__(self, num_splits: int, max_seqlen_k: int):
        self.num_splits, self.max_seqlen_k = num_splits, max_seqlen_k

    def run_partials(self, q, k, v, params: AttnParams, seqused_k, block_table, o_parts, lse_parts, k_descale=None,
                     v_descale=None) -> None:
        assert k_descale is None and v_descale is None, "FP8 pools take the portable kernel"
        hopper_attn_partials(q, k, v, o_parts, lse_parts, params=params, block_table=block_table, seqused_k=seqused_k,
                             max_seqlen_k=self.max_seqlen_k)


def hopper_attn_partials(q, k_cache, v_cache, o_parts, lse_parts, *, params: AttnParams, block_table, seqused_k,
                         max_seqlen_k: int) -> None:
    """The partial states of ``o_parts.shape[0]`` key splits of one sequence's attention over a
    paged pool, unmerged: ``o_parts`` (splits, 1, rows, heads, dim) and ``lse_parts`` (splits, 1,
    heads, rows), fp32 (``merge_parts`` merges them with others). The query heads that share a KV
    head are packed as rows, so each key tile is read once for all of them. The call must have
    passed ``hopper_partials_reason``."""
    splits, rows, nheads = o_parts.shape[0], q.shape[1], q.shape[2]
    block_n, stages = HOPPER_TILES[q.shape[3]]
    qpack = nheads // k_cache.shape[2]
    tiles_per_split = cdiv(cdiv(max_seqlen_k, block_n), splits)
    items = _partials_items(q, k_cache) * splits
    o_strides = (o_parts.stride(1), o_parts.stride(2), o_parts.stride(3), o_parts.stride(0))
    l_strides = (lse_parts.stride(1), lse_parts.stride(2), lse_parts.stride(3), lse_parts.stride(0))
    _launch_fwd(q, k_cache, v_cache, o_parts, lse_parts, o_strides, l_strides, params, 1, rows, max_seqlen_k,
                min(items, _sms(q)), block_n, stages, seqused_k=seqused_k, block_table=block_table,
                qpack=qpack, num_splits=splits, tiles_per_split=tiles_per_split)
