"""Context parallelism for packed batches, llama3's layout: each rank attends its own rows.

The packed tokens (T in all) are cut contiguously: rank r holds rows [r T/W, (r+1) T/W) of q,
k, v, whatever the document borders (``contiguous_shard(x, r, W, dim=0)``).
``llama3_flash_attn_prepare_cu_seqlens`` (``shard.py``) turns the global ``cu_seqlens`` into
what rank r computes: its query rows cut by document (``cu_seqlens_q``), and for each of those
documents the key range it sees (``cu_seqlens_k``, counted from ``local_k_slice.start``, a
range of global packed rows). ring-flash-attention all-gathers every key; here only the rows
that some rank reads travel:

* *home* documents (every key on this rank: all but the first and the last) go through the
  backend in ONE call over all heads, on the shard itself, while the rest travels;
* *away* documents (at most two: the first, whose keys begin on earlier ranks, and with
  ``causal=False`` the last, whose keys run on) get a buffer of their keys/values, this
  rank's rows copied in, the other ranks' rows received into it, ``heads_k_stride`` heads at a
  time; each is a batch-1 call per chunk of heads as its chunk arrives;
* keys that no query reaches (causal: after the last query; a window: beyond its reach) are
  cut before anything travels. Every rank all-gathers the two ends of each rank's key range
  once per call, so that it knows which of its rows the others read (``exports``).

The backward reuses the buffers (nothing travels twice), computes the away documents first and
sends the gradients of borrowed rows straight back to their owners while the home call runs;
an owner adds what comes back to its own rows in fp32 (float64 for float64 inputs), in rank
order (deterministic). With W ranks and causal documents no longer than a shard, rank r
receives only the part of its first document held by rank r-1, and sends the part of its last
one to rank r+1.

Positions are global: local query row t is packed row ``r T/W + t``. The backend aligns masks
bottom-right per document; a document whose keys run past its local queries (causal=False) is
moved into place with its window, as in ``plan.py``: ``shift = (end of queries) - (end of
keys)``. ALiBi needs shift 0 (true whenever ``causal=True``). Learnable sinks enter each row
once (every row is attended in exactly one call); the LSE is differentiable.

Dropout hashes what ``flash_attn_varlen_func`` on the whole packed batch hashes: (document index
b in the global ``cu_seqlens``, query head h of nheads, positions inside the document). Each call
names where it sits (``AttnParams.dropout_base`` = (b, first head, first query's position, first
key's position), ``dropout_nheads`` = nheads): an away call per chunk of heads, a home call per
run of documents that follow each other in the global offsets from position 0 (a zero-length
document between two, or a first document begun on an earlier rank, starts a new run).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..contract import AttnParams
from ..ops import _validate as V
from ..ops.backend import backend_for
from .comm import Peers, agree, signature
from .engine import acc_dtype, backward_inputs, sink_grad
from .ring import _options, check_group, ring_options, settle

__all__ = ["llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
           "llama3_flash_attn_varlen_qkvpacked_func"]

_NAME = "llama3_flash_attn_varlen_func"


@dataclass(frozen=True)
class _Call:
    """Local query rows ``q`` over key rows ``kv`` (of the local shard for the home call, of the
    document's buffer for an away one); ``docs`` the sequences (for per-sequence ALiBi slopes);
    ``cu_q is None``: one sequence, made as a batch-1 dense call."""

    q: slice
    kv: slice
    docs: slice
    params: AttnParams
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0


@dataclass(frozen=True)
class _Away:
    """A document whose keys leave this rank's rows: keys at global rows ``keys`` assembled in a
    buffer of their own, from this rank's rows ``own`` and the rows of other ranks (``sources``:
    (rank, global rows))."""

    call: _Call
    keys: slice
    own: slice
    sources: tuple


@dataclass(frozen=True)
class Llama3Plan:
    """What this rank computes and exchanges (host-side, from the offsets' values): the home calls
    (documents wholly within its rows), the away documents, the rows of its shard that other
    ranks read (``exports``: (rank, local rows)), and the chunks of heads that travel together."""

    lo: int
    home: tuple
    away: tuple
    exports: tuple
    chunks: tuple


def _local(rows: slice, base: int) -> slice:
    return slice(rows.start - base, rows.stop - base)


def _plan(q, cu_seqlens_q, cu_seqlens_k, local_k_slice, params, alibi: bool, stride: int, nheads_k: int,
          peers: Peers, bounds=None) -> Llama3Plan:
    """The plan of checked inputs (benchmarks/ring.py times the forward and backward on it): this
    rank's documents and every rank's key range, all-gathered (two integers a rank)."""
    docs = _documents(q.shape[0], peers.rank, cu_seqlens_q, cu_seqlens_k, local_k_slice, params, alibi, bounds)
    ranges = agree(_NAME, peers, {}, None, q.device, _key_range(docs, q.shape[0], peers.rank), 2)
    return _layout(docs, ranges, q.shape[0], peers.rank, params, cu_seqlens_q, stride, nheads_k)


def _key_range(docs, n: int, rank: int) -> list[int]:
    """[first, last + 1) of the global key rows this rank reads (its own rows if none)."""
    return [docs[0][2].start, docs[-1][2].stop] if docs else [rank * n, (rank + 1) * n]


def _documents(n: int, rank: int, cu_seqlens_q, cu_seqlens_k, local_k_slice, params, alibi: bool,
               bounds: list[int] | None = None) -> list:
    """[(b, query rows, key rows, doc, pos)] in global packed rows, keys cut to the window's reach;
    checks that the offsets are llama3_flash_attn_prepare_cu_seqlens's. With ``bounds`` (the global
    cu_seqlens, for dropout) ``doc`` is the index of sequence b's document in them and ``pos`` the
    position of its first local query in that document, which the single call's dropout hashes;
    without, ``doc`` is b and ``pos`` 0."""
    lo = rank * n
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    k0 = local_k_slice.start
    if cu_k[-1] != local_k_slice.stop - k0:
        V.fail(ValueError, f"{_NAME}: cu_seqlens_k ends at {cu_k[-1]} but local_k_slice covers "
                           f"{local_k_slice.stop - k0} keys")
    wl, wr = params.window_left, params.window_right
    docs = []  # (b, query rows, key rows after the window's cuts), global packed rows
    prev_k_hi = None
    for b in range(len(cu_q) - 1):
        q_lo, q_hi = lo + cu_q[b], lo + cu_q[b + 1]
        k_lo, k_hi = k0 + cu_k[b], k0 + cu_k[b + 1]
        if q_hi == q_lo:
            continue
        if k_lo > q_lo or k_hi < q_hi or (prev_k_hi is not None and k_lo < prev_k_hi):
            V.fail(ValueError, f"{_NAME}: the keys of sequence {b} (packed rows {k_lo}..{k_hi}) must cover its "
                               f"queries (rows {q_lo}..{q_hi}) and follow the keys of the sequence before: pass "
                               "the results of llama3_flash_attn_prepare_cu_seqlens")
        prev_k_hi = k_hi
        doc, pos = b, 0
        if bounds is not None:
            doc = bisect.bisect_right(bounds, q_lo) - 1  # the (non-empty) document holding row q_lo
            if not bounds[doc] <= k_lo <= q_hi <= bounds[doc + 1] or k_hi > bounds[doc + 1]:
                V.fail(ValueError, f"{_NAME}: sequence {b} (query rows {q_lo}..{q_hi}, key rows {k_lo}..{k_hi}) "
                                   f"is not within one document of cu_seqlens ({bounds[doc]}..{bounds[doc + 1]} "
                                   "holds its first row): pass the cu_seqlens given to "
                                   "llama3_flash_attn_prepare_cu_seqlens")
            pos = q_lo - bounds[doc]
        start = max(k_lo, q_lo - wl) if wl >= 0 else k_lo  # keys no query of the sequence reaches are cut
        end = min(k_hi, q_hi + wr) if wr >= 0 else k_hi
        if alibi and q_hi != end:
            V.fail(NotImplementedError, f"{_NAME}: with alibi_slopes, a sequence's keys may not run past its local "
                                        f"queries (sequence {b} does: causal=False across a rank border); use "
                                        "causal=True or window_size=(left, 0)")
        docs.append((b, slice(q_lo, q_hi), slice(start, end), doc, pos))
    return docs


def _layout(docs, ranges, n: int, rank: int, params, cu_seqlens_q, stride: int, nheads_k: int) -> Llama3Plan:
    """The plan of ``rank`` from its documents and every rank's key range (``ranges``)."""
    lo, hi = rank * n, (rank + 1) * n
    wl, wr = params.window_left, params.window_right
    device = cu_seqlens_q.device
    n_docs = cu_seqlens_q.shape[0] - 1
    exports = tuple((p, _local(slice(max(a, lo), min(b, hi)), lo)) for p, (a, b) in enumerate(ranges)
                    if p != rank and max(a, lo) < min(b, hi))
    runs = []  # home documents (keys = queries, on this rank), consecutive ones in one varlen call
    for d in docs:  # consecutive for dropout's hash too: documents that follow each other, from position 0
        if lo <= d[2].start and d[2].stop <= hi:
            if runs and runs[-1][-1][0] == d[0] - 1 and runs[-1][-1][3] == d[3] - 1 and runs[-1][0][4] == d[4] == 0:
                runs[-1].append(d)
            else:
                runs.append([d])
    home = []
    for run in runs:  # one run unless a sequence with no rows here sits among them
        rows = slice(run[0][1].start - lo, run[-1][1].stop - lo)
        offsets = [d[1].start - lo - rows.start for d in run] + [rows.stop - rows.start]
        cu = cu_seqlens_q if len(run) == n_docs else torch.tensor(offsets, dtype=torch.int32, device=device)
        longest = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
        hashed = _hashed(params, run[0][3], run[0][4], run[0][4])
        home.append(_Call(rows, rows, slice(run[0][0], run[-1][0] + 1), hashed, cu, cu, longest, longest))
    away = []
    for b, qs, ks, doc, pos in docs:
        if lo <= ks.start and ks.stop <= hi:
            continue
        shift = qs.stop - ks.stop  # (end of queries) - (end of keys), as in plan.py
        moved = replace(_hashed(params, doc, pos, pos + ks.start - qs.start),
                        window_left=wl - shift if wl >= 0 else -1, window_right=wr + shift if wr >= 0 else -1)
        sources = tuple((p, slice(max(ks.start, p * n), min(ks.stop, (p + 1) * n))) for p in range(len(ranges))
                        if p != rank and max(ks.start, p * n) < min(ks.stop, (p + 1) * n))
        away.append(_Away(_Call(_local(qs, lo), slice(0, ks.stop - ks.start), slice(b, b + 1), moved), ks,
                          slice(max(ks.start, lo), min(ks.stop, hi)), sources))
    chunks = tuple((h, h + stride) for h in range(0, nheads_k, stride))
    return Llama3Plan(lo, tuple(home), tuple(away), exports, chunks)


def _hashed(params: AttnParams, doc: int, q_pos: int, k_pos: int) -> AttnParams:
    """With dropout, ``params`` for a call whose first sequence is document ``doc`` of the packed
    batch, its first query and key at positions ``q_pos``, ``k_pos`` there: the coordinates the
    single call's dropout hashes (the chunk's first head is set per call, ``_args``)."""
    if params.dropout_p == 0:
        return params
    return replace(params, dropout_base=(doc, 0, q_pos, k_pos))


def _heads(h0: int, h1: int, group_size: int) -> slice:
    return slice(h0 * group_size, h1 * group_size)


def _post_kv(plan: Llama3Plan, k, v, c: int, peers):
    """Chunk ``c``'s heads of the away documents' keys/values: buffers (own rows copied, the
    others' rows received into them) and the transfer in flight, which also sends the rows of
    this shard that other ranks read."""
    h0, h1 = plan.chunks[c]
    bufs, recvs = [], []
    for a in plan.away:
        kb = k.new_empty((a.keys.stop - a.keys.start, h1 - h0, k.shape[2]))
        vb = v.new_empty((a.keys.stop - a.keys.start, h1 - h0, v.shape[2]))
        own_in, own = _local(a.own, a.keys.start), _local(a.own, plan.lo)
        kb[own_in].copy_(k[own, h0:h1])
        vb[own_in].copy_(v[own, h0:h1])
        for p, rows in a.sources:
            part = _local(rows, a.keys.start)
            recvs += [(p, kb[part], 4 * c), (p, vb[part], 4 * c + 1)]
        bufs.append((kb, vb))
    sends = [(p, t[rows, h0:h1].contiguous(), 4 * c + i) for p, rows in plan.exports for i, t in enumerate((k, v))]
    return bufs, peers.post(sends, recvs)


def _post_grads(plan: Llama3Plan, k, v, c: int, grads, peers):
    """Send the gradients of the others' rows of chunk ``c``'s away buffers back to their owners;
    receive those of this shard's exported rows. Returns (transfer, [(local rows, dk, dv)])."""
    h0, h1 = plan.chunks[c]
    sends = [(p, g[_local(rows, a.keys.start)], 4 * c + 2 + i) for a, pair in zip(plan.away, grads)
             for p, rows in a.sources for i, g in enumerate(pair)]
    received, recvs = [], []
    for p, rows in plan.exports:
        gk = k.new_empty((rows.stop - rows.start, h1 - h0, k.shape[2]))
        gv = v.new_empty((rows.stop - rows.start, h1 - h0, v.shape[2]))
        recvs += [(p, gk, 4 * c + 2), (p, gv, 4 * c + 3)]
        received.append((p, rows, gk, gv))
    return peers.post(sends, recvs), received


def _args(call: _Call, heads: slice, alibi, *tensors):
    """Backend arguments of one call (tensors already cut to its rows and heads); dropout hashes
    a chunk's head h as head heads.start + h of the batch's (``AttnParams.dropout_nheads``)."""
    params = call.params
    if params.dropout_p > 0 and heads.start:
        b0, _, i0, j0 = params.dropout_base
        params = replace(params, dropout_base=(b0, heads.start, i0, j0))
    kw = dict(params=params, alibi_slopes=None if alibi is None else alibi[call.docs, heads])
    if call.cu_q is None:
        return tuple(t.unsqueeze(0) for t in tensors), kw
    kw.update(cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=call.max_q, max_seqlen_k=call.max_k)
    return tensors, kw


def llama3_fwd(q, k, v, plan: Llama3Plan, peers, alibi=None, sink=None):
    """(out, lse, buffers): this rank's rows over their documents' keys; the away documents'
    key/value buffers are kept for the backward (no second transfer)."""
    backend = backend_for(q.device)
    g = q.shape[1] // k.shape[1]
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # v's head dim
    lse = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=acc_dtype(q))  # float64 for float64 q
    posted = [_post_kv(plan, k, v, c, peers) for c in range(len(plan.chunks))]
    everything = slice(0, q.shape[1])
    for c in plan.home:  # all heads at once while the away keys travel
        args, kw = _args(c, everything, alibi, q[c.q], k[c.kv], v[c.kv], out[c.q], lse[:, c.q])
        backend.attn_fwd(*args, learnable_sink=sink, **kw)
    kept = []
    for (h0, h1), (bufs, transfer) in zip(plan.chunks, posted):
        transfer.wait()
        heads = _heads(h0, h1, g)
        for a, (kb, vb) in zip(plan.away, bufs):
            c = a.call
            args, kw = _args(c, heads, alibi, q[c.q, heads], kb, vb, out[c.q, heads], lse[heads, c.q])
            backend.attn_fwd(*args, learnable_sink=None if sink is None else sink[heads], **kw)
        kept.append(bufs)
    return out, lse, kept


def llama3_bwd(dout, q, k, v, out, lse, dlse, plan: Llama3Plan, kept, peers, deterministic: bool, alibi=None):
    """(dq, dk, dv) of sum(out * dout) + sum(lse * dlse) (``dlse`` may be None). The away documents
    go first, so that the gradients of other ranks' rows travel back while the home call runs;
    returned gradients are added to this shard's in fp32, in rank order."""
    backend = backend_for(q.device)
    g = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def bwd(c: _Call, heads, kt, vt, dkt, dvt):
        rows = [dout[c.q, heads], q[c.q, heads], kt, vt, out[c.q, heads], lse[heads, c.q], dq[c.q, heads], dkt, dvt]
        if dlse is not None:
            rows.append(dlse[heads, c.q])
        args, kw = _args(c, heads, alibi, *rows)
        if dlse is not None:
            *args, kw["dlse"] = args
        backend.attn_bwd(*args, deterministic=deterministic, **kw)

    returning = []
    for i, ((h0, h1), bufs) in enumerate(zip(plan.chunks, kept)):
        heads, grads = _heads(h0, h1, g), []
        for a, (kb, vb) in zip(plan.away, bufs):
            dkb, dvb = torch.empty_like(kb), torch.empty_like(vb)
            bwd(a.call, heads, kb, vb, dkb, dvb)
            own_in, own = _local(a.own, a.keys.start), _local(a.own, plan.lo)
            dk[own, h0:h1], dv[own, h0:h1] = dkb[own_in], dvb[own_in]
            grads.append((dkb, dvb))
        returning.append((h0, h1, *_post_grads(plan, k, v, i, grads, peers)))
    for c in plan.home:
        bwd(c, slice(0, q.shape[1]), k[c.kv], v[c.kv], dk[c.kv], dv[c.kv])
    for _, _, transfer, _ in returning:
        transfer.wait()
    for below in (True, False):  # rows read by lower ranks (a prefix of the shard), then by higher ones
        parts = [(h0, h1, rows, gk, gv) for h0, h1, _, received in returning for p, rows, gk, gv in received
                 if (p < peers.rank) == below]
        if not parts:
            continue
        span = slice(min(x[2].start for x in parts), max(x[2].stop for x in parts))
        acc_k, acc_v = dk[span].to(acc_dtype(k)), dv[span].to(acc_dtype(k))
        for h0, h1, rows, gk, gv in parts:
            acc_k[_local(rows, span.start), h0:h1] += gk
            acc_v[_local(rows, span.start), h0:h1] += gv
        dk[span], dv[span] = acc_k, acc_v
    return dq, dk, dv


def _global_offsets(cu_seqlens, total: int, device, dropout_p: float) -> list[int] | None:
    """The global offsets' values (checked) where dropout needs them, else None."""
    if cu_seqlens is None:
        if dropout_p > 0:
            V.fail(ValueError, f"{_NAME}: dropout_p > 0 needs cu_seqlens=, the global offsets given to "
                               "llama3_flash_attn_prepare_cu_seqlens: the mask of the single call hashes each "
                               "document's index in them, which the local offsets do not tell")
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        V.fail(ValueError, f"{_NAME}: cu_seqlens must be a 1-D int32 tensor of length batch + 1 (>= 2), got "
                           f"{getattr(cu_seqlens, 'shape', cu_seqlens)!r}")
    V.check_int32_vector("cu_seqlens", cu_seqlens, cu_seqlens.shape[0], device)
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        V.fail(ValueError, f"{_NAME}: cu_seqlens must start at 0, never decrease and end at the {total} packed "
                           f"tokens of all ranks, got {bounds[0]} ... {bounds[-1]}")
    return bounds if dropout_p > 0 else None


class Llama3FlashAttnVarlenFunc(torch.autograd.Function):
    """Forward and backward across ``group``; differentiable in q, k, v, the LSE and the sinks."""

    @staticmethod
    def forward(ctx, q, k, v, sink, plan, alibi, group, deterministic):
        peers = Peers(group)
        out, lse, kept = llama3_fwd(q, k, v, plan, peers, alibi, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.plan, ctx.kept, ctx.alibi, ctx.group, ctx.deterministic = plan, kept, alibi, group, deterministic
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout, dlse = backward_inputs(dout, dlse, out)
        dq, dk, dv = llama3_bwd(dout, q, k, v, out, lse, dlse, ctx.plan, ctx.kept, Peers(ctx.group),
                                ctx.deterministic, ctx.alibi)
        dsink = None if sink is None else sink_grad(dout, out, lse, dlse, sink)
        return dq, dk, dv, dsink, None, None, None, None


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None, *, softcap=0.0,
                                  learnable_sink=None, cu_seqlens=None):
    """Attention of this rank's packed rows over the whole packed batch (keys/values all-gathered).

    q (total_local, nheads, headdim), k, v (total_local, nheads_k, headdim): rows
    [r T/W, (r+1) T/W) of the packed batch. ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``,
    ``max_seqlen_k`` and ``local_k_slice`` as returned by ``llama3_flash_attn_prepare_cu_seqlens``
    (with the same ``causal``); ``heads_k_stride`` key/value heads of the rows read from other
    ranks travel at a time (a divisor of nheads_k; smaller starts the documents that need them
    sooner, larger makes fewer, larger calls).
    ``causal`` and ``window_size`` act on positions inside each document. ``alibi_slopes`` fp32
    (nheads,) or (num_local_sequences, nheads) where no sequence's keys run past its queries
    (always with causal=True). v may have a head dim of its own, headdim_v (out and dv have it).
    Returns out (total_local, nheads, headdim_v), or with ``return_attn_probs`` ``(out,
    softmax_lse (nheads, total_local) fp32 (float64 for float64 q), None)``. Arguments as in
    ring-flash-attention; ``softcap`` and ``learnable_sink`` ((nheads,) fp32, once per row;
    its gradient is this rank's rows' share, summed across ranks like any replicated parameter's)
    are tileattn's additions. Differentiable in q, k, v, the sinks and the returned LSE.

    ``dropout_p`` > 0 drops what ``flash_attn_varlen_func`` on the whole packed batch drops with
    the same seed (drawn from each rank's generator of q's device: seed every rank alike). That
    call hashes each element's document index, head and positions inside the document; the
    local offsets do not tell a document's index (documents on other ranks and zero-length ones
    come before it), so dropout needs ``cu_seqlens`` (keyword, tileattn's addition): the global
    offsets given to ``llama3_flash_attn_prepare_cu_seqlens``.
    """
    def checks():
        return _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
                      dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs,
                      group, softcap, learnable_sink, cu_seqlens)

    def fields(c):
        return signature(**_options(_NAME, q, c.params, c.alibi, c.sink, deterministic), total_local=q.shape[0],
                         nheads_k=k.shape[1], headdim=q.shape[2], headdim_v=v.shape[2], heads_k_stride=c.stride,
                         cu_seqlens=[] if c.bounds is None else c.bounds)

    # every rank's key range (two integers) travels with its call's signature: each rank then knows
    # which of its rows the others read, and all raise if any rank refused its inputs
    c, ranges = settle(_NAME, group, checks, fields, q, always=True, n_extra=2,
                       extra=lambda c: _key_range(c.docs, q.shape[0], dist.get_rank(group)))
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    plan = _layout(c.docs, ranges, q.shape[0], dist.get_rank(group), c.params, cu_seqlens_q, c.stride, k.shape[1])
    alibi, sink = c.alibi, c.sink
    out, lse = Llama3FlashAttnVarlenFunc.apply(q, k, v, sink, plan, alibi, group, deterministic)
    return (out, lse, None) if return_attn_probs else out


@dataclass(frozen=True)
class _Checked:
    params: AttnParams
    bounds: list | None
    alibi: torch.Tensor | None
    sink: torch.Tensor | None
    stride: int
    docs: list


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice, dropout_p,
           softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap,
           learnable_sink, cu_seqlens) -> _Checked:
    """Every check of this rank's inputs (its offsets' values included) and its documents."""
    V.check_qkv(q, k, v, packed=True, headdim_v=True)
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
                          deterministic=deterministic, return_attn_probs=return_attn_probs, group=group)
    check_group(_NAME, group)  # before the world's size is asked
    world_size = dist.get_world_size(group)
    bounds = _global_offsets(cu_seqlens, world_size * q.shape[0], q.device, params.dropout_p)
    if bounds is not None:  # every call hashes heads as the single call does: h of q.shape[1] per document
        params = replace(params, dropout_nheads=q.shape[1])
    if (not isinstance(local_k_slice, slice) or not all(isinstance(x, int) for x in (local_k_slice.start,
                                                                                     local_k_slice.stop))
            or local_k_slice.step not in (None, 1) or not 0 <= local_k_slice.start <= local_k_slice.stop
            <= world_size * k.shape[0]):
        V.fail(ValueError, f"{_NAME}: local_k_slice must be a slice of the {world_size * k.shape[0]} gathered keys, "
                           f"got {local_k_slice!r}")
    V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, local_k_slice.stop - local_k_slice.start, max_seqlen_k)
    alibi = V.check_alibi(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], q.device)
    sink = V.check_sink(learnable_sink, q, q.shape[1])
    V.check_backward(cu_seqlens_q.shape[0] - 1, q, k, v, sink)
    docs = _documents(q.shape[0], dist.get_rank(group), cu_seqlens_q, cu_seqlens_k, local_k_slice, params,
                      alibi is not None, bounds)
    return _Checked(params, bounds, alibi, sink, heads_k_stride, docs)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                           return_attn_probs=False, group=None, *, softcap=0.0,
                                           learnable_sink=None, cu_seqlens=None):
    """``llama3_flash_attn_varlen_func`` with kv (total_local, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        V.fail(ValueError, f"{_NAME}: kv must be (total, 2, nheads_k, headdim), got {getattr(kv, 'shape', kv)}")
    return llama3_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                                         causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         softcap=softcap, learnable_sink=learnable_sink, cu_seqlens=cu_seqlens)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0,
                                            learnable_sink=None, cu_seqlens=None):
    """``llama3_flash_attn_varlen_func`` with qkv (total_local, 3, nheads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        V.fail(ValueError, f"{_NAME}: qkv must be (total, 3, nheads, headdim), got {getattr(qkv, 'shape', qkv)}")
    return llama3_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                                         causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         softcap=softcap, learnable_sink=learnable_sink, cu_seqlens=cu_seqlens)
