"""Context parallelism for packed batches the llama3 way: all-gather K/V, attend the local queries.

The packed tokens (T in all) are cut contiguously: rank r holds rows [r T/W, (r+1) T/W) of q,
k, v, whatever the document borders (``contiguous_shard(x, r, W, dim=0)``).
``llama3_flash_attn_prepare_cu_seqlens`` (``shard.py``) turns the global ``cu_seqlens`` into
what rank r computes: its query rows cut by document (``cu_seqlens_q``), and for each of those
documents the key range it sees (``cu_seqlens_k``, counted from ``local_k_slice.start`` within
the all-gathered keys). The keys and values are all-gathered ``heads_k_stride`` heads at a
time, the gather of the next heads posted before the current ones are attended; every rank
then calls the backend once per group of documents, and the backward sums the gradients of the
gathered keys/values across ranks with one reduce-scatter per head chunk.

Positions are global: local query row t is packed row ``r T/W + t``, gathered key row u is
packed row u. The backend aligns masks bottom-right per document; a document whose keys run
past its local queries (causal=False) is moved into place with its window, as in ``plan.py``:
with window_right >= 0 its keys are first cut at (last query + window_right), then the window
is moved by ``shift = (end of queries) - (end of keys)``. ALiBi needs shift 0 (true whenever
``causal=True``). Consecutive documents with one shift go through the backend together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..ops import _validate as V
from ..ops.backend import backend_for
from .ring import ring_options

__all__ = ["llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
           "llama3_flash_attn_varlen_qkvpacked_func"]

_NAME = "llama3_flash_attn_varlen_func"
# newer torch names it reduce_scatter_single and deprecates the old name (same arguments)
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class _Group:
    """Documents b0 .. b1 - 1: local query rows ``q``, gathered key rows ``kv``, their offsets."""

    q: slice
    kv: slice
    docs: slice
    params: object
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _plan(q, cu_seqlens_q, cu_seqlens_k, local_k_slice, params, rank: int, world_size: int, alibi: bool):
    """The groups of documents this rank computes (host-side, from the offsets' values)."""
    total = q.shape[0]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    k0 = local_k_slice.start
    if cu_k[-1] != local_k_slice.stop - k0:
        V.fail(ValueError, f"{_NAME}: cu_seqlens_k ends at {cu_k[-1]} but local_k_slice covers "
                           f"{local_k_slice.stop - k0} keys")
    wl, wr = params.window_left, params.window_right
    docs = []  # (b, key end after the cut, shift)
    for b in range(len(cu_q) - 1):
        q_lo, q_hi = rank * total + cu_q[b], rank * total + cu_q[b + 1]
        k_lo, k_hi = k0 + cu_k[b], k0 + cu_k[b + 1]
        if q_hi == q_lo:
            continue
        if k_lo > q_lo or k_hi < q_hi:
            V.fail(ValueError, f"{_NAME}: the keys of sequence {b} (packed rows {k_lo}..{k_hi}) must cover its "
                               f"queries (rows {q_lo}..{q_hi}): pass the results of "
                               "llama3_flash_attn_prepare_cu_seqlens")
        end = min(k_hi, q_hi + wr) if wr >= 0 else k_hi
        if alibi and q_hi != end:
            V.fail(NotImplementedError, f"{_NAME}: with alibi_slopes, a sequence's keys may not run past its local "
                                        f"queries (sequence {b} does: causal=False across a rank border); use "
                                        "causal=True or window_size=(left, 0)")
        docs.append((b, end, q_hi - end, end != k_hi))
    groups, run = [], []
    for doc in docs:
        if run and (doc[2] != run[-1][2] or run[-1][3] or doc[0] != run[-1][0] + 1):
            groups.append(run)
            run = []
        run.append(doc)
    if run:
        groups.append(run)
    whole = len(groups) == 1 and len(docs) == len(cu_q) - 1 and not docs[-1][3]
    out = []
    for run in groups:
        b0, b1, shift = run[0][0], run[-1][0] + 1, run[0][2]
        moved = replace(params, window_left=wl - shift if wl >= 0 else -1, window_right=wr + shift if wr >= 0 else -1)
        qs = [x - cu_q[b0] for x in cu_q[b0:b1 + 1]]
        ks = [x - cu_k[b0] for x in cu_k[b0:b1]] + [run[-1][1] - k0 - cu_k[b0]]
        if whole:
            cu_qt, cu_kt = cu_seqlens_q, cu_seqlens_k
        else:
            cu_qt = torch.tensor(qs, dtype=torch.int32, device=q.device)
            cu_kt = torch.tensor(ks, dtype=torch.int32, device=q.device)
        out.append(_Group(slice(cu_q[b0], cu_q[b1]), slice(k0 + cu_k[b0], k0 + cu_k[b0] + ks[-1]), slice(b0, b1),
                          moved, cu_qt, cu_kt, max(b - a for a, b in zip(qs[:-1], qs[1:])),
                          max(b - a for a, b in zip(ks[:-1], ks[1:]))))
    return out


class _Gather:
    """The all-gather of k and v heads [h0, h1) across the ranks, in flight."""

    def __init__(self, k, v, h0: int, h1: int, group):
        world_size = dist.get_world_size(group)
        self.parts = [t[:, h0:h1].contiguous() for t in (k, v)]  # kept alive until the gather is done
        self.full = [t.new_empty((world_size * t.shape[0],) + t.shape[1:]) for t in self.parts]
        self.works = [dist.all_gather_into_tensor(f, p, group=group, async_op=True)
                      for f, p in zip(self.full, self.parts)]

    def wait(self):
        for work in self.works:
            work.wait()
        return self.full


def _chunks(nheads_k: int, stride: int):
    return [(h, h + stride) for h in range(0, nheads_k, stride)]


def _llama3_fwd(q, k, v, groups, alibi, stride: int, group):
    backend = backend_for(q.device)
    nheads, nheads_k = q.shape[1], k.shape[1]
    g = nheads // nheads_k
    out = torch.empty_like(q)
    lse = torch.empty((nheads, q.shape[0]), device=q.device, dtype=torch.float32)
    chunks = _chunks(nheads_k, stride)
    pending = _Gather(k, v, *chunks[0], group)
    for i, (h0, h1) in enumerate(chunks):
        k_all, v_all = pending.wait()
        if i + 1 < len(chunks):  # the next heads travel while these are attended
            pending = _Gather(k, v, *chunks[i + 1], group)
        heads = slice(h0 * g, h1 * g)
        for grp in groups:
            backend.attn_fwd(q[grp.q, heads], k_all[grp.kv], v_all[grp.kv], out[grp.q, heads], lse[heads, grp.q],
                             params=grp.params, alibi_slopes=None if alibi is None else alibi[grp.docs, heads],
                             cu_seqlens_q=grp.cu_q, cu_seqlens_k=grp.cu_k, max_seqlen_q=grp.max_q,
                             max_seqlen_k=grp.max_k)
    return out, lse


def _llama3_bwd(dout, q, k, v, out, lse, groups, alibi, stride: int, group, deterministic: bool):
    backend = backend_for(q.device)
    nheads, nheads_k = q.shape[1], k.shape[1]
    g = nheads // nheads_k
    dq = torch.zeros_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    chunks = _chunks(nheads_k, stride)
    pending, reducing = _Gather(k, v, *chunks[0], group), []
    for i, (h0, h1) in enumerate(chunks):
        k_all, v_all = pending.wait()
        if i + 1 < len(chunks):
            pending = _Gather(k, v, *chunks[i + 1], group)
        heads = slice(h0 * g, h1 * g)
        # fp32 gradients of every gathered row (zero outside this rank's key ranges), summed across
        # the ranks by the reduce-scatter; the groups' key ranges are disjoint, so each call writes
        # its own rows directly (the backends store in the output's dtype)
        dkv_all = [torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in (k_all, v_all)]
        for grp in groups:
            backend.attn_bwd(dout[grp.q, heads], q[grp.q, heads], k_all[grp.kv], v_all[grp.kv], out[grp.q, heads],
                             lse[heads, grp.q], dq[grp.q, heads], dkv_all[0][grp.kv], dkv_all[1][grp.kv],
                             params=grp.params, alibi_slopes=None if alibi is None else alibi[grp.docs, heads],
                             cu_seqlens_q=grp.cu_q, cu_seqlens_k=grp.cu_k, max_seqlen_q=grp.max_q,
                             max_seqlen_k=grp.max_k, deterministic=deterministic)
        mine = [torch.empty((k.shape[0], h1 - h0, k.shape[2]), device=k.device, dtype=torch.float32) for _ in range(2)]
        works = [reduce_scatter(m, a, group=group, async_op=True) for m, a in zip(mine, dkv_all)]
        reducing.append((h0, h1, mine, dkv_all, works))
    for h0, h1, mine, _, works in reducing:
        for work in works:
            work.wait()
        dk[:, h0:h1], dv[:, h0:h1] = mine[0], mine[1]
    return dq, dk, dv


class Llama3FlashAttnVarlenFunc(torch.autograd.Function):
    """All-gather forward and backward across ``group``."""

    @staticmethod
    def forward(ctx, q, k, v, groups, alibi, stride, group, deterministic):
        out, lse = _llama3_fwd(q, k, v, groups, alibi, stride, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.groups, ctx.alibi, ctx.stride, ctx.group, ctx.deterministic = groups, alibi, stride, group, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _llama3_bwd(V.last_dim_contiguous(dout), q, k, v, out, lse, ctx.groups, ctx.alibi, ctx.stride,
                                 ctx.group, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None, *, softcap=0.0):
    """Attention of this rank's packed rows over the whole packed batch (keys/values all-gathered).

    q (total_local, nheads, headdim), k, v (total_local, nheads_k, headdim): rows
    [r T/W, (r+1) T/W) of the packed batch. ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``,
    ``max_seqlen_k`` and ``local_k_slice`` as returned by ``llama3_flash_attn_prepare_cu_seqlens``
    (with the same ``causal``); ``heads_k_stride`` key/value heads are gathered at a time (a
    divisor of nheads_k; smaller overlaps more of the gather, larger makes fewer calls).
    ``causal`` and ``window_size`` act on positions inside each document. ``alibi_slopes`` fp32
    (nheads,) or (num_local_sequences, nheads) where no sequence's keys run past its queries
    (always with causal=True). Returns out (total_local, nheads, headdim), or with
    ``return_attn_probs`` ``(out, softmax_lse (nheads, total_local) fp32, None)``. Arguments as
    in ring-flash-attention; ``softcap`` is tileattn's addition.
    """
    V.check_qkv(q, k, v, packed=True)
    if k.shape[0] != q.shape[0]:
        V.fail(ValueError, f"{_NAME}: q and k/v shards must have the same number of tokens, got {q.shape[0]} "
                           f"and {k.shape[0]}")
    nheads_k = k.shape[1]
    heads_k_stride = V.integer("heads_k_stride", heads_k_stride, minimum=1)
    if nheads_k % heads_k_stride:
        V.fail(ValueError, f"{_NAME}: heads_k_stride must be a positive divisor of nheads_k ({nheads_k}), "
                           f"got {heads_k_stride}")
    V.check_offsets(cu_seqlens_q, cu_seqlens_k, q)
    max_seqlen_q = V.integer("max_seqlen_q", max_seqlen_q, minimum=0)
    max_seqlen_k = V.integer("max_seqlen_k", max_seqlen_k, minimum=0)
    params = ring_options(_NAME, q, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, return_attn_probs=return_attn_probs, group=group,
                          alibi_ok=True)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (not isinstance(local_k_slice, slice) or not all(isinstance(x, int) for x in (local_k_slice.start,
                                                                                     local_k_slice.stop))
            or local_k_slice.step not in (None, 1) or not 0 <= local_k_slice.start <= local_k_slice.stop
            <= world_size * k.shape[0]):
        V.fail(ValueError, f"{_NAME}: local_k_slice must be a slice of the {world_size * k.shape[0]} gathered keys, "
                           f"got {local_k_slice!r}")
    V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, local_k_slice.stop - local_k_slice.start, max_seqlen_k)
    alibi = V.check_alibi(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], q.device)
    groups = _plan(q, cu_seqlens_q, cu_seqlens_k, local_k_slice, params, rank, world_size, alibi is not None)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    out, lse = Llama3FlashAttnVarlenFunc.apply(q, k, v, groups, alibi, heads_k_stride, group, deterministic)
    return (out, lse, None) if return_attn_probs else out


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                           return_attn_probs=False, group=None, *, softcap=0.0):
    """``llama3_flash_attn_varlen_func`` with kv (total_local, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        V.fail(ValueError, f"{_NAME}: kv must be (total, 2, nheads_k, headdim), got {getattr(kv, 'shape', kv)}")
    return llama3_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                                         causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         softcap=softcap)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0):
    """``llama3_flash_attn_varlen_func`` with qkv (total_local, 3, nheads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        V.fail(ValueError, f"{_NAME}: qkv must be (total, 3, nheads, headdim), got {getattr(qkv, 'shape', qkv)}")
    return llama3_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                                         causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         softcap=softcap)
