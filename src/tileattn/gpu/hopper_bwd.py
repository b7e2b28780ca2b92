"""Launcher of the Hopper backward kernels (``kernels/attn_bwd_hopper.py``) and the rule that picks them.

``attn_bwd`` of ``gpu/backward.py`` runs the portable preprocess (delta, lse2) and then, when
``hopper_bwd_reason`` is None, these launches instead of the portable dK/dV and dQ kernels. On
by default on sm_90, like the Gluon forward; ``TILEATTN_HOPPER=0`` turns both off. A prepared
backward (``backward.PreparedBwd``) asks the rule's part its signature fixes once
(``bwd_signature_reason``), the rest per call (``hopper.call_reason``), and keeps its launches
(``HopperBwd``).

One kernel, one program per block of 128 resident rows (two consumer warpgroups of 64 rows and
one producer warp), launched twice:

* dK/dV: a key block of one key/value head; the query tiles of its GROUP query heads stream
  through the ring. The kernel works in a (rows, columns) frame, so the call is handed over
  transposed: rows = keys, columns = queries, lengths and window bounds swapped;
* dQ: a query block of one query head; its key/value head's key tiles stream (S and dP
  recomputed: 7 matrix products per tile pair in all, every gradient element written once, so
  the gradients are bitwise reproducible). Past ``REDUCE_MIN_ROWS`` query rows this launch runs
  only with ``deterministic``: otherwise the dK/dV programs add each query tile's dQ share to an
  fp32 workspace by bulk reductions (5 products per tile pair; ``("dkdv+dq", 128)``: 64-query
  tiles, 2 stages, 192 KB with the two dS^T tiles and the two fp32 staging tiles;
  ``("dkdv+dq", 64)``: 128-query tiles, 2 stages, 193 KB).

Tiles per (kind, head dim): (column tile, STAGES), the best of a sweep on the H200 (bwd-only
TFLOP/s at 8k tokens, hidden 2048, docs/perf-notes.md). Shared memory = the rows' two tiles (2 x
128 x d) + STAGES x the two column tiles: dK/dV hdim 128, 64 queries x 2 stages -> 64 + 64 = 128
KB (3 or 4 stages measured the same); hdim 64, 128 queries x 2 stages -> 32 + 64 = 96 KB (11-14 %
faster than 64-query tiles); dQ hdim 128, 64 keys x 3 stages -> 64 + 96 = 160 KB (4-6 % faster
than 128 x 2); hdim 64, 128 keys x 3 stages -> 32 + 96 = 128 KB. At hdim 128 dK/dV stays at
64-query tiles: with dK and dV in registers (2 x 64 fp32 per thread) a 128-wide S^T and dP^T
tile spills. Registers (``gpu/hopper.py``'s split, the forward's too): 12 warps, at most
``MAXNREG`` = 168 per thread on average; setmaxnreg gives each consumer thread
``CONSUMER_REGS`` = 240 and the producer 24 (2 x 128 x 240 + 32 x 24 <= 168 x 384).
tests/hopper_compile.py checks every variant for shared memory, spills and serialised wgmma.
"""

from __future__ import annotations

import torch

from ..contract import AttnParams
from ..kernels.common import LOG2E
from ._launch import cdiv
from .hopper import GluonLaunch, _pointers_reason, _strides_reason, device_kind_reason, device_reason, options_reason

__all__ = ["hopper_bwd_reason", "bwd_signature_reason", "hopper_attn_bwd", "HopperBwd", "HOPPER_BWD_TILES"]

# (kind, head_dim) -> (column tile, STAGES)
HOPPER_BWD_TILES = {("dkdv", 64): (128, 2), ("dkdv", 128): (64, 2), ("dq", 64): (128, 3), ("dq", 128): (64, 3),
                    ("dkdv+dq", 128): (64, 2), ("dkdv+dq", 64): (128, 2)}
ROWS_WG = 64  # resident rows per consumer warpgroup; 128 per program
# dQ by reductions from the dK/dV programs only past this many query rows (the longest sequence's):
# measured on the H200 (docs/perf-notes.md, 2026-12-01 11:40), backward alone, head dim 128, at 512
# rows the two launches were ahead (causal 225 against 124 TFLOP/s, unmasked 306 against 300), at
# 2k the reductions (379 against 364, 467 against 437); at head dim 64 (12:45) 1k was a wash (unmasked
# 350 against 341, causal 251 against 258) and 2k went to the reductions (397 / 326 against 369 / 317).
REDUCE_MIN_ROWS = 1025
_DTYPES = (torch.float16, torch.bfloat16)


def hopper_bwd_reason(dout, q, k, v, dq, dk, dv, params: AttnParams, *, alibi_slopes=None,
                      varlen: bool = False) -> str | None:
    """None when the Hopper kernels can compute this backward call's dq, dk, dv, else why not
    (one short phrase). dlse and learnable sinks only change the preprocess, which both paths
    share; ``deterministic`` needs nothing (no atomics, one tile configuration). All but the
    environment (``hopper.switch_reason``) and the data pointers' alignment are fixed by the call's
    signature: ``bwd_signature_reason`` asks them once, ``hopper.call_reason(q, k, v, dout)`` the rest."""
    return (device_reason(q) or _bwd_operands_reason(dout, q, k, v, dq, dk, dv, params, alibi_slopes, varlen)
            or _pointers_reason(q, k, v, dout))


def bwd_signature_reason(dout, q, k, v, dq, dk, dv, params: AttnParams, *, alibi_slopes=None,
                         varlen: bool = False) -> str | None:
    """The part of ``hopper_bwd_reason`` that every call with these tensors' metadata and these
    options answers alike."""
    return (device_kind_reason(q) or _bwd_operands_reason(dout, q, k, v, dq, dk, dv, params, alibi_slopes, varlen))


def _bwd_operands_reason(dout, q, k, v, dq, dk, dv, params: AttnParams, alibi_slopes, varlen: bool) -> str | None:
    seq_dim = 0 if varlen else 1
    # the gradients may also be fp32 (the ring's accumulators): stored unrounded
    if (q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in (k, v, dout))
            or any(t.dtype not in (q.dtype, torch.float32) for t in (dq, dk, dv))):
        return "dtypes " + " / ".join(str(t.dtype) for t in (q, k, v, dout, dq, dk, dv))
    if ("dq", q.shape[-1]) not in HOPPER_BWD_TILES or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} / {v.shape[-1]}"
    if q.shape[0] == 0 or q.shape[seq_dim] == 0 or k.shape[seq_dim] == 0:
        return "empty batch, queries or keys"
    return options_reason(params, alibi_slopes) or _strides_reason(q, k, v, dout)


def hopper_attn_bwd(dout, q, k, v, dq, dk, dv, lse2, delta, *, params: AttnParams, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                    deterministic: bool = False) -> None:
    """dq, dk, dv from the preprocess's ``lse2`` and ``delta`` (shaped like lse: (B, H, Sq), or
    (H, Tq) when packed, contiguous); the call must have passed ``hopper_bwd_reason``.

    Past ``REDUCE_MIN_ROWS`` query rows, unless ``deterministic``: one launch,
    dK/dV, whose programs also add their keys' share of dQ to an fp32 workspace by bulk reductions
    (5 matrix products per tile; the order of the additions varies from run to run), then dq =
    the workspace rounded. Otherwise two launches, dK/dV then dQ (7 products, bitwise
    reproducible)."""
    HopperBwd(params, max_seqlen_q, max_seqlen_k, deterministic)(dout, q, k, v, dq, dk, dv, lse2, delta,
                                                                 cu_seqlens_q, cu_seqlens_k)


class HopperBwd:
    """``hopper_attn_bwd`` with its options bound: ``bwd(dout, q, k, v, dq, dk, dv, lse2, delta,
    cu_seqlens_q, cu_seqlens_k)``. Its launches (``hopper.GluonLaunch``) are worked out from the
    first call's metadata and kept: a prepared backward (``backward.PreparedBwd``) keeps one for
    every call of its signature that takes the Gluon kernels."""

    __slots__ = ("params", "max_seqlen_q", "max_seqlen_k", "deterministic", "launches")

    def __init__(self, params: AttnParams, max_seqlen_q: int = 0, max_seqlen_k: int = 0, deterministic: bool = False):
        self.params, self.max_seqlen_q, self.max_seqlen_k = params, max_seqlen_q, max_seqlen_k
        self.deterministic, self.launches = deterministic, None

    def __call__(self, dout, q, k, v, dq, dk, dv, lse2, delta, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
        if cu_seqlens_q is not None:  # packed (T, H, D) tensors seen as batch 1 by the descriptors
            q, k, v, dout = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), dout.unsqueeze(0)
            dq, dk, dv = dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)
        launches = self.launches
        if launches is None:
            launches = self.launches = self._launches(dq, dk, dv, lse2, delta, q, k, cu_seqlens_q)
        dkdv, dq_launch = launches
        if dq_launch is None:  # dQ by reductions into the (tokens, heads x head_dim) fp32 workspace
            dq_acc = torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
            dkdv(k, v, q, dout, dq_acc.view(-1, q.shape[2] * q.shape[3]), dk, dv, lse2, delta, cu_seqlens_k,
                 cu_seqlens_q)
            dq.copy_(dq_acc)  # the kernel scaled each share: the workspace only needs rounding to dq's dtype
            return
        dkdv(k, v, q, dout, None, dk, dv, lse2, delta, cu_seqlens_k, cu_seqlens_q)
        dq_launch(q, dout, k, v, None, dq, None, lse2, delta, cu_seqlens_q, cu_seqlens_k)

    def _launches(self, dq, dk, dv, lse2, delta, q, k, cu_seqlens_q) -> tuple:
        """(dK/dV's launch, dQ's or None: dQ by reductions) of calls like this one (4-D tensors:
        packed ones unsqueezed)."""
        from ..kernels.attn_bwd_hopper import _attn_bwd_hopper_kernel

        varlen = cu_seqlens_q is not None
        if varlen:
            batch = cu_seqlens_q.shape[0] - 1
            seqlen_q = self.max_seqlen_q if self.max_seqlen_q > 0 else q.shape[1]
            seqlen_k = self.max_seqlen_k if self.max_seqlen_k > 0 else k.shape[1]
            w_strides = (0, lse2.stride(0))
        else:
            batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
            w_strides = (lse2.stride(0), lse2.stride(1))
        assert lse2.stride(-1) == 1 and delta.stride() == lse2.stride()
        nheads, head_dim, nheads_k = q.shape[2], q.shape[3], k.shape[2]
        group = nheads // nheads_k
        left, right = self.params.window_left, self.params.window_right
        scale = float(self.params.softmax_scale)
        common = dict(GROUP=group, IS_VARLEN=varlen)
        rows = (1, ROWS_WG, 1, head_dim)

        def strides(t):  # (batch, row, head) strides of an output; packed outputs are one batch
            return (0 if varlen else t.stride(0), t.stride(1), t.stride(2))

        # dK/dV, transposed: rows = keys, columns = queries; (left, right) and the lengths swap
        reduce = not self.deterministic and ("dkdv+dq", head_dim) in HOPPER_BWD_TILES and seqlen_q >= REDUCE_MIN_ROWS
        cols, stages = HOPPER_BWD_TILES["dkdv+dq" if reduce else "dkdv", head_dim]
        # with reductions each warpgroup adds half of a tile's dQ to the workspace: half the columns at
        # head dim 128, half the query rows at 64
        dq_block = None
        if reduce:
            dq_block = (cols, head_dim // 2) if head_dim >= 128 else (cols // 2, head_dim)
        dkdv = GluonLaunch(
            _attn_bwd_hopper_kernel, (cdiv(seqlen_k, 2 * ROWS_WG), nheads_k, batch),
            dict(COL_PASSES=group, DKDV=True, DQ_REDUCE=reduce, MASK_LEFT=right >= 0, MASK_RIGHT=left >= 0,
                 STAGES=stages, **common),
            (rows, rows, (1, cols, 1, head_dim), (1, cols, 1, head_dim), dq_block) + (None,) * 6,
            (*strides(dk), *strides(dv), *w_strides, seqlen_k, seqlen_q, scale, scale * LOG2E.value, right, left))
        if reduce:
            return dkdv, None
        # dQ: rows = queries, columns = keys
        cols, stages = HOPPER_BWD_TILES["dq", head_dim]
        dq_launch = GluonLaunch(
            _attn_bwd_hopper_kernel, (cdiv(seqlen_q, 2 * ROWS_WG), nheads, batch),
            dict(COL_PASSES=1, DKDV=False, DQ_REDUCE=False, MASK_LEFT=left >= 0, MASK_RIGHT=right >= 0,
                 STAGES=stages, **common),
            (rows, rows, (1, cols, 1, head_dim), (1, cols, 1, head_dim)) + (None,) * 7,
            (*strides(dq), 0, 0, 0, *w_strides, seqlen_q, seqlen_k, scale, scale * LOG2E.value, left, right))
        return dkdv, dq_launch
