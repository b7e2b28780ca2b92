"""The ring's forward and backward: attention calls planned per (rank, src), transfers overlapped.

Every rank holds its queries and one shard of keys/values. At step s it attends to the shard of
``src = (r - s) mod W`` with the calls its plan names (``plan.py``), each the backend contract
of ``tileattn.contract``, and merges each call's partial state into its running one with the
library's merge of (o, lse) states (``tileattn.ops.merge``)::

    lse = log(exp(lse_run) + exp(lse_blk)),   o = exp(lse_run - lse) o_run + exp(lse_blk - lse) o_blk

Traffic and passes over memory, kept low:

* only the rows of a shard that the receiver reads travel (``_span``: half of a zigzag shard
  when src < rank, the keys within a window's reach), and a step at which no rank computes is
  skipped with its transfers; the exchange of step s + 1 is posted before step s computes;
* the running state is fp32 (float64 for float64 inputs, ``acc_dtype``, as everywhere below);
  the first call over every row writes it directly (both backends store into an output of
  another dtype), later ones are merged in place (``merge_into``).

A shard's keys and values travel as one message (``Shard``): stacked, (2, ...), when they share a
shape, else side by side on the last axis, (..., headdim + headdim_v), when v has a head dim of
its own; the running output and dv then have headdim_v, dq and dk headdim.

Backward (the FlashAttention trick, per call): with the FINAL output O and LSE, a call's
probabilities are ``P = exp(S - lse)`` and ``delta = rowsum(dO * O)`` is the same for every
call, so each call's (dq, dk, dv) is exactly its share of the gradient. The shards travel
again; dq accumulates locally in fp32; the gradient of a borrowed shard (written by the call
itself when one call covers it, else summed in fp32) goes straight back to its owner in the
inputs' dtype, and the owner adds the returns in step order (deterministic) into its fp32
accumulator. Every local partial state and partial gradient stays fp32 until the one rounding
to the inputs' dtype at the end, as in one call; a returned gradient is rounded once more, on
its way (a seed scan of the bf16 ring cases found no tolerance miss that fp32 returns avoid,
and fp32 would double the bytes of the backward's returns).

A plan gives, per (rank, src), a list of ``Call``: the local query rows, the held key rows,
the moved window (``plan.window_pair``) and, for packed batches, the ``cu_seqlens`` of the
selected rows (``None`` for a call on the rows of one document, made as a batch-1 dense call).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..contract import AttnParams
from ..ops import _validate as V
from ..ops.backend import backend_for
from ..ops.merge import merge_into
from .comm import Peers

__all__ = ["Call", "Shard", "acc_dtype", "ring_fwd", "ring_bwd", "sink_grad"]


@dataclass(frozen=True)
class Call:
    """Local query rows ``q`` attend held key rows ``kv`` (slices, or index tensors)."""

    q: slice | torch.Tensor
    kv: slice | torch.Tensor
    params: AttnParams
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    alibi: torch.Tensor | None = None  # ALiBi slopes (batch or 1, nheads) of the call's sequences


class Plan:
    """The calls of every (rank, src) of one ring call; ``calls(rank, src)`` is a pure function of
    shapes and options, so every rank knows what every other rank needs from it."""

    packed: bool  # tokens on dim 0 ((total, heads, dim), lse (heads, total)), else dim 1
    length: int  # tokens of a local shard

    def calls(self, rank: int, src: int) -> list[Call]:
        raise NotImplementedError

    def steps(self, world_size: int) -> list[int]:
        """The steps s at which some rank attends to the shard of (rank - s) mod W."""
        return [s for s in range(world_size)
                if s == 0 or any(self.calls(r, (r - s) % world_size) for r in range(world_size))]


class Shard:
    """How a shard's k and v share one tensor (one message per step): stacked (2, ..., headdim)
    when they have one shape, else concatenated on the last axis (..., headdim + headdim_v), v
    having a head dim of its own. ``axis`` is the token axis of that tensor."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, packed: bool):
        self.stacked = k.shape == v.shape
        self.headdim = k.shape[-1]
        token_axis = 0 if packed else 1
        self.axis = token_axis + 1 if self.stacked else token_axis

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.stack([k, v]) if self.stacked else torch.cat([k, v], -1)

    def split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of a packed shard, or of its gradient."""
        return (kv[0], kv[1]) if self.stacked else (kv[..., :self.headdim], kv[..., self.headdim:])


def acc_dtype(q: torch.Tensor) -> torch.dtype:
    """The ring's state and accumulators: fp32, or float64 for float64 inputs (the CPU path's, whose
    single call keeps float64 throughout and returns a float64 LSE: an fp32 state would round a
    float64 ring to fp32 precision)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _take(x: torch.Tensor, rows, axis: int) -> torch.Tensor:
    if isinstance(rows, slice):
        return x.narrow(axis, rows.start, rows.stop - rows.start)
    return x.index_select(axis, rows)


def _lse_shape(q: torch.Tensor, packed: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])


def _varlen_args(call: Call) -> dict:
    if call.cu_q is None:
        return {}
    return dict(cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=call.max_q, max_seqlen_k=call.max_k)


def _one_doc(call: Call, packed: bool, *tensors):
    """Rows of one document of a packed batch go to the backend as a batch-1 dense call."""
    return tuple(t.unsqueeze(0) for t in tensors) if packed and call.cu_q is None else tensors


def _fwd_call(backend, call: Call, q, kv, packed: bool, into=None):
    """One call's (o, lse) over ``kv`` = (k, v); written into ``into`` = (out, lse) rows when given
    (the backends store in the output's dtype, so the ring's fp32 state can be written directly)."""
    axis = 0 if packed else 1
    q_c, k_c, v_c = _take(q, call.q, axis), _take(kv[0], call.kv, axis), _take(kv[1], call.kv, axis)
    if into is None:
        # fp32 like the running state it is merged into: a partial output rounded to q's dtype
        # first would carry two roundings into the result where one call has one
        o_c = q_c.new_empty((*q_c.shape[:-1], v_c.shape[-1]), dtype=acc_dtype(q))  # v's head dim
        lse_c = torch.empty(_lse_shape(q_c, packed), device=q.device, dtype=acc_dtype(q))
    else:
        o_c, lse_c = _take(into[0], call.q, axis), _take(into[1], call.q, axis + 1)
    backend.attn_fwd(*_one_doc(call, packed, q_c, k_c, v_c, o_c, lse_c), params=call.params, alibi_slopes=call.alibi,
                     **_varlen_args(call))
    return o_c, lse_c


def _merge_rows(out, lse, rows, o_c, lse_c, packed: bool) -> None:
    axis = 0 if packed else 1
    if isinstance(rows, slice):
        merge_into(_take(out, rows, axis), _take(lse, rows, axis + 1), o_c, lse_c)
        return
    o_run, lse_run = _take(out, rows, axis), _take(lse, rows, axis + 1)
    merge_into(o_run, lse_run, o_c, lse_c)
    out.index_copy_(axis, rows, o_run)
    lse.index_copy_(axis + 1, rows, lse_run)


def _whole(rows, length: int) -> bool:
    return isinstance(rows, slice) and rows.start == 0 and rows.stop == length


def _add_rows(acc, rows, part, axis: int) -> None:
    if isinstance(rows, slice):
        _take(acc, rows, axis).add_(part)
    else:
        acc.index_add_(axis, rows, part.to(acc.dtype))


def _span(calls: list[Call], length: int) -> slice | None:
    """The rows of a held shard that ``calls`` read, as one range: only these travel (a zigzag
    shard's first half when src < rank, the keys within a window). All rows if a call gathers by
    index; None if there is no call."""
    if not calls:
        return None
    if not all(isinstance(c.kv, slice) for c in calls):
        return slice(0, length)
    return slice(min(c.kv.start for c in calls), max(c.kv.stop for c in calls))


def _within(rows, span: slice):
    """Rows of a shard -> rows of the received span of it."""
    if isinstance(rows, slice):
        return slice(rows.start - span.start, rows.stop - span.start)
    return rows  # index rows travel with the whole shard (span.start == 0)


def _narrow(x, span: slice, axis: int):
    return x.narrow(axis, span.start, span.stop - span.start)


def _post_kv(peers: Peers, plan: Plan, own, axis: int, step: int):
    """Post step ``step``'s exchange: the rows of my shard ``own`` (token axis ``axis``) that
    rank + step reads go to it, the rows of rank - step's shard that I read come from it."""
    r, w = peers.rank, peers.world_size
    mine = _span(plan.calls((r + step) % w, r), plan.length)
    theirs = _span(plan.calls(r, (r - step) % w), plan.length)
    send = None if mine is None else _narrow(own, mine, axis).contiguous()
    recv = None if theirs is None else _narrow(own, theirs, axis)
    return peers.exchange(send, r + step, recv, r - step, tag=step)


def _post_grad(peers: Peers, plan: Plan, own, axis: int, grad, step: int):
    """Return ``grad`` (the gradient of the rows of rank - step's shard that I read, in the inputs'
    dtype, or None) to its owner; the gradient of the rows of my shard ``own`` that rank + step
    read comes back from it, in ``own``'s dtype."""
    r, w = peers.rank, peers.world_size
    mine = _span(plan.calls((r + step) % w, r), plan.length)
    recv = None if mine is None else _narrow(own, mine, axis)
    return peers.exchange(grad, r - step, recv, r + step, tag=w + step)


def ring_fwd(q, k, v, plan: Plan, peers: Peers, sink=None):
    """(out in q's dtype with v's head dim, lse in ``acc_dtype``) of this rank's queries over every
    rank's keys/values; learnable sinks ``sink`` (nheads,) merged once into the final state."""
    backend = backend_for(q.device)
    axis = 0 if plan.packed else 1
    out = torch.empty((*q.shape[:-1], v.shape[-1]), device=q.device, dtype=acc_dtype(q))
    lse = torch.empty(_lse_shape(q, plan.packed), device=q.device, dtype=acc_dtype(q))
    fresh = True  # nothing merged yet: a first call over every row writes the state directly
    shard = Shard(k, v, plan.packed)
    own = shard.pack(k, v)  # one message per step
    steps = plan.steps(peers.world_size)
    incoming = None
    for i, step in enumerate(steps):
        current = incoming
        if i + 1 < len(steps):  # the next shard travels while this one is used
            incoming = _post_kv(peers, plan, own, shard.axis, steps[i + 1])
        calls = plan.calls(peers.rank, (peers.rank - step) % peers.world_size)
        kv, span = (own, slice(0, plan.length)) if step == 0 else (current.wait(), _span(calls, plan.length))
        kv = None if kv is None else shard.split(kv)  # None: nothing read from src
        for call in calls:
            call = replace(call, kv=_within(call.kv, span))
            if fresh and _whole(call.q, q.shape[axis]):
                _fwd_call(backend, call, q, kv, plan.packed, into=(out, lse))
            else:
                if fresh:
                    out.zero_()
                    lse.fill_(float("-inf"))
                o_c, lse_c = _fwd_call(backend, call, q, kv, plan.packed)
                _merge_rows(out, lse, call.q, o_c, lse_c, plan.packed)
            fresh = False
    if fresh:  # no call at all (no key visible to any query here)
        out.zero_()
        lse.fill_(float("-inf"))
    if sink is not None:  # the sink as a state (out 0, lse sink_h), once per row
        merge_into(out, lse, out.new_zeros(()).expand(out.shape), sink.to(lse.dtype)[:, None].expand(lse.shape))
    return out.to(q.dtype), lse


def backward_inputs(dout, dlse, out):
    """The gradients an autograd backward receives, as the kernels take them: a missing ``dout``
    (only the LSE was used) as zeros, the last dim contiguous; ``dlse`` contiguous (e.g. the zero
    strides of ``lse.sum()``'s gradient) or None."""
    dout = torch.zeros_like(out) if dout is None else V.last_dim_contiguous(dout)
    return dout, None if dlse is None else dlse.contiguous()


def sink_grad(dout, out, lse, dlse, sink):
    """The gradient of learnable sinks from this rank's rows: ``dsink_h = -sum P_sink delta`` with
    ``P_sink = exp(sink_h - lse)`` and ``delta = rowsum(dout * out) - dlse`` (``tileattn.reference``).
    Layouts: dense out (B, S, H, D) with lse (B, H, S), packed out (T, H, D) with lse (H, T)."""
    acc = lse.dtype  # fp32, float64 for float64 inputs
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(-1, -2)  # lse's layout
    if dlse is not None:
        delta = delta - dlse.to(acc)
    p_sink = torch.exp(sink.to(acc)[:, None] - lse)
    return -(p_sink * delta).reshape(-1, *lse.shape[-2:]).sum((0, 2)).to(sink.dtype)


def _bwd_call(backend, call: Call, dout, q, kv, out, lse, dlse, packed: bool, deterministic: bool, dq_into=None,
              dkv_into=None):
    """One call's (dq, dk, dv) over ``kv`` = (k, v), written into ``dq_into`` / ``dkv_into`` = (dk, dv)
    (query rows / key rows of the call) when given."""
    axis = 0 if packed else 1
    q_c, k_c, v_c = _take(q, call.q, axis), _take(kv[0], call.kv, axis), _take(kv[1], call.kv, axis)
    # fp32 partials: each call's share is added to others before the one rounding at the end
    acc = acc_dtype(q)
    dq_c = torch.empty_like(q_c, dtype=acc) if dq_into is None else _take(dq_into, call.q, axis)
    if dkv_into is None:
        dk_c, dv_c = torch.empty_like(k_c, dtype=acc), torch.empty_like(v_c, dtype=acc)
    else:
        dk_c, dv_c = _take(dkv_into[0], call.kv, axis), _take(dkv_into[1], call.kv, axis)
    rows = [_take(dout, call.q, axis), q_c, k_c, v_c, _take(out, call.q, axis), _take(lse, call.q, axis + 1), dq_c,
            dk_c, dv_c]
    extra = {}
    if dlse is not None:
        *rows, extra["dlse"] = _one_doc(call, packed, *rows, _take(dlse, call.q, axis + 1))
    else:
        rows = _one_doc(call, packed, *rows)
    backend.attn_bwd(*rows, params=call.params, deterministic=deterministic, alibi_slopes=call.alibi, **extra,
                     **_varlen_args(call))
    return dq_c, dk_c, dv_c


def ring_bwd(dout, q, k, v, out, lse, plan: Plan, peers: Peers, deterministic: bool, dlse=None):
    """Gradients (dq, dk, dv) of sum(out * dout) + sum(lse * dlse), with the final ``out`` and
    ``lse`` of the forward: every call's share, as each call's probabilities are exp(S - lse) and
    its delta is rowsum(dout * out) - dlse.

    Where one call covers all rows its gradients are written straight into the fp32 accumulators
    (the first call) or into the message returning a borrowed shard's gradient, in the inputs'
    dtype (a step's only call over every received row); otherwise they are added up in fp32 (and
    a borrowed shard's sum rounded to the inputs' dtype before it travels).
    """
    backend = backend_for(q.device)
    axis = 0 if plan.packed else 1
    r, w = peers.rank, peers.world_size
    shard = Shard(k, v, plan.packed)
    own = shard.pack(k, v)
    dq = torch.empty(q.shape, device=q.device, dtype=acc_dtype(q))
    dkv = torch.empty(own.shape, device=q.device, dtype=acc_dtype(q))  # gradient of my own shard, packed alike
    fresh_q = fresh_kv = True
    steps = plan.steps(w)
    incoming, returning = None, None
    for i, step in enumerate(steps):
        current = incoming
        if i + 1 < len(steps):  # the next shard travels while this one is used
            incoming = _post_kv(peers, plan, own, shard.axis, steps[i + 1])
        calls = plan.calls(r, (r - step) % w)
        kv, span = (own, slice(0, plan.length)) if step == 0 else (current.wait(), _span(calls, plan.length))
        grad = None  # the gradient of the received rows, to return (step > 0)
        direct_grad = step > 0 and len(calls) == 1 and _whole(_within(calls[0].kv, span), kv.shape[shard.axis])
        if direct_grad:
            grad = torch.empty_like(kv)  # written by the call: its fp32 accumulation rounded once, on store
        elif step > 0 and calls:
            grad = torch.zeros(kv.shape, device=q.device, dtype=acc_dtype(q))
        for call in calls:
            call = replace(call, kv=_within(call.kv, span))
            direct_q = fresh_q and _whole(call.q, q.shape[axis])
            if fresh_q and not direct_q:
                dq.zero_()
            fresh_q = False
            if step == 0:
                direct_kv = fresh_kv and len(calls) == 1 and _whole(call.kv, plan.length)
                if fresh_kv and not direct_kv:
                    dkv.zero_()
                fresh_kv = False
                target = dkv if direct_kv else None
            else:
                target = grad if direct_grad else None
            dq_c, dk_c, dv_c = _bwd_call(backend, call, dout, q, shard.split(kv), out, lse, dlse, plan.packed,
                                         deterministic, dq_into=dq if direct_q else None,
                                         dkv_into=None if target is None else shard.split(target))
            if not direct_q:
                _add_rows(dq, call.q, dq_c, axis)
            if target is None:
                acc_k, acc_v = shard.split(dkv if step == 0 else grad)
                _add_rows(acc_k, call.kv, dk_c, axis)
                _add_rows(acc_v, call.kv, dv_c, axis)
        if step == 0:
            if fresh_kv:
                dkv.zero_()
                fresh_kv = False
            continue
        # the gradient of src's rows goes back to src in the inputs' dtype (added into src's fp32
        # accumulator there); mine come back from rank + step
        back = _post_grad(peers, plan, own, shard.axis, None if grad is None else grad.to(own.dtype), step)
        if returning is not None:
            _add_returned(dkv, *returning)
        returning = (back, _span(plan.calls((r + step) % w, r), plan.length), shard.axis)
    if returning is not None:
        _add_returned(dkv, *returning)
    if fresh_q:
        dq.zero_()
    dk, dv = shard.split(dkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_returned(dkv, transfer, span, axis: int) -> None:
    returned = transfer.wait()
    if returned is not None:
        dkv.narrow(axis, span.start, span.stop - span.start).add_(returned)
