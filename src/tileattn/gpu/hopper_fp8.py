"""Launcher of the Gluon FP8 decode (``kernels/decode_fp8_hopper.py``) and the rule that picks it.

``attn_fwd`` and ``plan_fwd`` of ``gpu/attention.py`` ask ``hopper_fp8_decode_reason`` for every call
over an FP8 cache (``k_descale``/``v_descale`` given): ``None`` means the Gluon kernel takes it (an
``Fp8DecodePlan``, kept per call signature), otherwise the string says why the portable kernel's
``IS_FP8`` path runs. ``TILEATTN_HOPPER=0`` turns it off with the other Gluon kernels.

What it takes: an sm_90 device with Gluon; a float8_e4m3fn cache (contiguous (batch, seqlen, heads_k,
128) or a paged pool (num_blocks, page, heads_k, 128) whose pages are 16-byte-row multiples of 8 keys
that tile 128 keys or are tiled by them: 16, 32, 64, 128, 256, ...) with k's and v's descales; dense
bf16/fp16 q (not packed) of head dim 128 with at most ``N_Q`` = 8 query rows per KV head (rows per
sequence x query heads per KV head: GQA up to 8 at one row, 4 at two); no window (causal is fine),
softcap, ALiBi, dropout or learnable sinks; TMA-readable strides and 16-byte aligned bases.

The launch: a persistent grid (one program per SM, at most one per work item) over work items of
(sequence, KV head, key split); every item writes two partial states (one per consumer warpgroup),
so the workspace holds ``2 num_splits`` fp32 partials and ``combine.py``'s kernel merges them into
``out``/``lse`` (the portable split path's launch, ``combine_launch``). Splits (``fp8_decode_splits``):
the caller's count, or with 0 enough for ``ITEMS_PER_SM`` items per SM (the sequences' lengths, per
call on the device, may differ: many short items balance), each split at least ``MIN_SPLIT_TILES``
key tiles of 128.
Each consumer warpgroup overlaps a tile's O^T product with the next tile's S^T product and softmax
(``FP8_DECODE_OVERLAP``, the kernel's ``OVERLAP``: bitwise the same result).
"""

from __future__ import annotations

import torch

from ..contract import AttnParams
from ..kernels.common import LOG2E
from ._launch import cdiv, contiguous_strides, partials_workspace
from .combine import combine_launch
from .hopper import GluonLaunch, _pointers_reason, _sms, _strides_reason, call_reason, device_reason, options_reason

__all__ = ["hopper_fp8_decode_reason", "fp8_decode_splits", "Fp8DecodePlan", "FP8_DECODE_STAGES", "FP8_DECODE_OVERLAP",
           "N_Q"]

HEAD_DIM, N_Q, BLOCK_N = 128, 8, 128  # the kernel's head dim, query rows per item, keys per ring slot
FP8_DECODE_STAGES = 4  # ring slots of 128 keys (K and V: 32 KB each slot): 128 KB in flight per SM
ITEMS_PER_SM = 8
MIN_SPLIT_TILES = 8  # 1,024 keys
MAX_SPLITS = 64
# Each consumer warpgroup overlaps tile t - 1's O^T = V^T P^T product with tile t's S^T = K Q^T and
# softmax (the kernel's ``OVERLAP``; bitwise the same result). On for every call the kernel takes;
# a module constant so that an A/B can switch it (docs/perf-notes.md, "The FP8 decode's S/O overlap").
FP8_DECODE_OVERLAP = True
_Q_DTYPES = (torch.float16, torch.bfloat16)


def hopper_fp8_decode_reason(q, k, v, params: AttnParams, *, alibi_slopes, varlen: bool, block_table,
                             learnable_sink, k_descale, v_descale) -> str | None:
    """None when the Gluon FP8 decode can compute this forward call, else why not (one short phrase):
    the shape and option checks first (a call over a 16-bit cache is told no at once), then the
    environment and device (``device_reason``), then strides and the data pointers' alignment."""
    why = _fp8_shape_reason(q, k, v, params, alibi_slopes, varlen, block_table, learnable_sink, k_descale, v_descale)
    return why or device_reason(q) or _strides_reason(k, v) or _pointers_reason(k, v)


def _fp8_shape_reason(q, k, v, params: AttnParams, alibi_slopes, varlen, block_table, learnable_sink, k_descale,
                      v_descale) -> str | None:
    if k_descale is None or v_descale is None:
        return "not an FP8 cache"
    if k.dtype != torch.float8_e4m3fn or v.dtype != k.dtype or q.dtype not in _Q_DTYPES:
        return f"dtypes {q.dtype} / {k.dtype} / {v.dtype}"
    if varlen or q.dim() != 4:
        return "packed queries"
    if q.shape[-1] != HEAD_DIM or k.shape[-1] != HEAD_DIM or v.shape != k.shape:
        return f"head dims {q.shape[-1]} / {k.shape[-1]} / {v.shape[-1]}"
    if q.shape[1] * (q.shape[2] // k.shape[2]) > N_Q:
        return f"more than {N_Q} query rows per KV head"
    if learnable_sink is not None:
        return "learnable sinks"
    if params.window_left >= 0 or params.window_right > 0:
        return "sliding window"
    if block_table is not None:
        page = k.shape[1]
        if not (page % BLOCK_N == 0 or (BLOCK_N % page == 0 and page >= 16)):
            return f"pages of {page} keys"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "head dim not contiguous"
    if q.shape[0] == 0 or k.shape[0] == 0:
        return "empty batch or cache"
    return options_reason(params, alibi_slopes)


def fp8_decode_splits(items: int, max_keys: int, sms: int, num_splits: int = 0) -> int:
    """Key splits of each (sequence, KV head): ``num_splits`` when the caller asks (> 0), else enough
    for ``ITEMS_PER_SM`` work items per SM, each split at least ``MIN_SPLIT_TILES`` tiles; never more
    splits than tiles (one at least) nor ``MAX_SPLITS``."""
    tiles = max(1, cdiv(max_keys, BLOCK_N))
    if num_splits <= 0:
        num_splits = min(cdiv(ITEMS_PER_SM * sms, max(items, 1)), tiles // MIN_SPLIT_TILES)
    return max(1, min(num_splits, tiles, MAX_SPLITS))


class Fp8DecodePlan:
    """The Gluon FP8 decode of one call signature (shapes, strides, dtypes, options): its launch
    (``GluonLaunch``), split count, workspace and merge. ``run`` has ``FwdPlan.run``'s arguments, so
    ``DecodePlan`` keeps one as it keeps a portable plan; a call whose part of the rule that can
    change between calls (``call_reason``: the switch, base alignment) says no goes to ``fallback()``,
    the portable plan (made when first needed)."""

    __slots__ = ("num_splits", "workspace_shapes", "fwd", "combine", "combine_grid", "combine_ints", "fallback",
                 "_fallback_plan", "causal")

    def __init__(self, q, k, out, lse, params: AttnParams, *, block_table, seqused_k, max_seqlen_k: int,
                 num_splits: int, fallback):
        from ..kernels.decode_fp8_hopper import _decode_fp8_hopper_kernel

        batch, seqlen_q, nheads, _ = q.shape
        nheads_k = k.shape[2]
        paged = block_table is not None
        page = k.shape[1] if paged else 0
        capacity = block_table.shape[1] * page if paged else k.shape[1]
        max_keys = min(capacity, max_seqlen_k) if max_seqlen_k > 0 else capacity
        items = batch * nheads_k
        sms = _sms(q)
        self.num_splits = fp8_decode_splits(items, max_keys, sms, num_splits)
        tiles_per_split = cdiv(cdiv(max(max_keys, 1), BLOCK_N), self.num_splits)
        parts = 2 * self.num_splits  # two warpgroups' partial states per split
        self.workspace_shapes = ((parts, batch, seqlen_q, nheads, HEAD_DIM), (parts, batch, nheads, seqlen_q))
        po, pl = (contiguous_strides(s) for s in self.workspace_shapes)
        self.causal = params.window_right == 0 and seqlen_q > 1
        kv_block = (1, min(page, BLOCK_N) if paged else BLOCK_N, 1, HEAD_DIM)
        table = (block_table.stride(0), block_table.shape[1]) if paged else (0, 0)
        numbers = (*q.stride()[:3], po[1], po[2], po[3], po[0], pl[1], pl[2], pl[3], pl[0], *table, batch, nheads_k,
                   seqlen_q, max_keys, self.num_splits, tiles_per_split, params.softmax_scale * LOG2E.value)
        self.fwd = GluonLaunch(_decode_fp8_hopper_kernel, (min(items * self.num_splits, sms), 1, 1), dict(
            GROUP=nheads // nheads_k, HAS_SEQUSED=seqused_k is not None, CAUSAL=self.causal, PAGE=page,
            STAGES=FP8_DECODE_STAGES, OVERLAP=FP8_DECODE_OVERLAP), (kv_block, kv_block) + (None,) * 7, numbers)
        self.combine, self.combine_grid, self.combine_ints = combine_launch(
            self.workspace_shapes, False, out.stride()[:3], lse.stride(), HEAD_DIM, HEAD_DIM, out.dtype, lse.dtype,
            None, False)
        self.fallback, self._fallback_plan = fallback, None

    def new_workspace(self, device) -> tuple:
        """fp32 buffers for the partial states (o, lse) (``partials_workspace``)."""
        return partials_workspace(self.workspace_shapes, device)

    def run(self, q, k, v, out, lse, params: AttnParams, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
            block_table, workspace: tuple | None = None, learnable_sink=None, k_descale=None, v_descale=None,
            combine: bool = True) -> None:
        """Launch on one call's tensors (the plan's signature; ``workspace`` shaped ``workspace_shapes``
        or None), then merge the partials into ``out``/``lse`` (``combine=False`` leaves them)."""
        if call_reason(k, v) is not None:
            if self._fallback_plan is None:
                self._fallback_plan = self.fallback()
            self._fallback_plan.run(q, k, v, out, lse, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    block_table, learnable_sink=learnable_sink, k_descale=k_descale,
                                    v_descale=v_descale, combine=combine)
            return
        o_parts, lse_parts = workspace or self.new_workspace(q.device)
        self.fwd(k, v, q, o_parts, lse_parts, k_descale, v_descale, seqused_k, block_table)
        if combine:
            self.combine(self.combine_grid, o_parts, lse_parts, out, lse, None, *self.combine_ints)
