"""The ring's forward and backward: attention calls planned per (rank, src), transfers overlapped.

Every rank holds its queries and one shard of keys/values. At step s it attends to the shard of
``src = (r - s) mod W`` with the calls its plan names (``plan.py``), each the backend contract
of ``tileattn.contract``, and merges each call's partial state into its running one with the
library's merge of (o, lse) states (``tileattn.ops.merge``)::

    lse = log(exp(lse_run) + exp(lse_blk)),   o = exp(lse_run - lse) o_run + exp(lse_blk - lse) o_blk

Steps at which no rank computes anything are skipped, and so are their transfers; the
exchange of step s + 1 is posted before step s computes.

Backward (the FlashAttention trick, per call): with the FINAL output O and LSE, a call's
probabilities are ``P = exp(S - lse)`` and ``delta = rowsum(dO * O)`` is the same for every
call, so each call's (dq, dk, dv) is exactly its share of the gradient. The shards travel
again; dq accumulates locally in fp32; the gradient of a borrowed shard is summed per step and
sent straight back to its owner, which adds the returns in step order (deterministic).

A plan gives, per (rank, src), a list of ``Call``: the local query rows, the held key rows,
the moved window (``plan.window_pair``) and, for packed batches, the ``cu_seqlens`` of the
selected rows (``None`` for a call on the rows of one document, made as a batch-1 dense call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract import AttnParams
from ..ops.backend import backend_for
from ..ops.merge import merge_into
from .comm import Peers

__all__ = ["Call", "ring_fwd", "ring_bwd"]


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


class Plan:
    """The calls of every (rank, src) of one ring call; ``calls(rank, src)`` is a pure function of
    shapes and options, so every rank knows what every other rank needs from it."""

    packed: bool  # tokens on dim 0 ((total, heads, dim), lse (heads, total)), else dim 1

    def calls(self, rank: int, src: int) -> list[Call]:
        raise NotImplementedError

    def steps(self, world_size: int) -> list[int]:
        """The steps s at which some rank attends to the shard of (rank - s) mod W."""
        return [s for s in range(world_size)
                if s == 0 or any(self.calls(r, (r - s) % world_size) for r in range(world_size))]


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


def _fwd_call(backend, call: Call, q, kv, packed: bool):
    axis = 0 if packed else 1
    q_c, k_c, v_c = _take(q, call.q, axis), _take(kv[0], call.kv, axis), _take(kv[1], call.kv, axis)
    o_c = torch.empty_like(q_c)
    lse_c = torch.empty(_lse_shape(q_c, packed), device=q.device, dtype=torch.float32)
    backend.attn_fwd(*_one_doc(call, packed, q_c, k_c, v_c, o_c, lse_c), params=call.params, **_varlen_args(call))
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


def _add_rows(acc, rows, part, axis: int) -> None:
    if isinstance(rows, slice):
        _take(acc, rows, axis).add_(part)
    else:
        acc.index_add_(axis, rows, part.to(acc.dtype))


def _exchange_kv(peers: Peers, plan: Plan, kv, step: int, tag: int):
    """Post step ``step``'s exchange: my shard to rank + step if it needs it, a shard from rank - step
    if I need it."""
    r, w = peers.rank, peers.world_size
    send = kv if plan.calls((r + step) % w, r) else None
    recv = kv if plan.calls(r, (r - step) % w) else None
    return peers.exchange(send, r + step, recv, r - step, tag)


def ring_fwd(q, k, v, plan: Plan, peers: Peers):
    """(out in q's dtype, lse fp32) of this rank's queries over every rank's keys/values."""
    backend = backend_for(q.device)
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    lse = torch.full(_lse_shape(q, plan.packed), float("-inf"), device=q.device, dtype=torch.float32)
    own = torch.stack([k, v])  # one message per step
    steps = plan.steps(peers.world_size)
    incoming = None
    for i, step in enumerate(steps):
        current = incoming
        if i + 1 < len(steps):  # the next shard travels while this one is used
            incoming = _exchange_kv(peers, plan, own, steps[i + 1], tag=steps[i + 1])
        kv = own if step == 0 else current.wait()
        for call in plan.calls(peers.rank, (peers.rank - step) % peers.world_size):
            o_c, lse_c = _fwd_call(backend, call, q, kv, plan.packed)
            _merge_rows(out, lse, call.q, o_c, lse_c, plan.packed)
    return out.to(q.dtype), lse


def ring_bwd(dout, q, k, v, out, lse, plan: Plan, peers: Peers, deterministic: bool):
    """Gradients (dq, dk, dv) of sum(out * dout), with the final ``out`` and ``lse`` of the forward."""
    backend = backend_for(q.device)
    axis = 0 if plan.packed else 1
    r, w = peers.rank, peers.world_size
    own = torch.stack([k, v])
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dkv = torch.zeros(own.shape, device=q.device, dtype=torch.float32)  # gradient of my own shard
    steps = plan.steps(w)
    incoming, returning = None, None
    for i, step in enumerate(steps):
        current = incoming
        if i + 1 < len(steps):  # the next shard travels while this one is used
            incoming = _exchange_kv(peers, plan, own, steps[i + 1], tag=steps[i + 1])
        kv = own if step == 0 else current.wait()
        calls = plan.calls(r, (r - step) % w)
        part = dkv if step == 0 else (torch.zeros(own.shape, device=q.device, dtype=torch.float32) if calls else None)
        for call in calls:
            q_c, k_c, v_c = (_take(t, rows, axis) for t, rows in ((q, call.q), (kv[0], call.kv), (kv[1], call.kv)))
            dq_c, dk_c, dv_c = torch.empty_like(q_c), torch.empty_like(k_c), torch.empty_like(v_c)
            args = _one_doc(call, plan.packed, _take(dout, call.q, axis), q_c, k_c, v_c, _take(out, call.q, axis),
                            _take(lse, call.q, axis + 1), dq_c, dk_c, dv_c)
            backend.attn_bwd(*args, params=call.params, deterministic=deterministic, **_varlen_args(call))
            _add_rows(dq, call.q, dq_c, axis)
            _add_rows(part[0], call.kv, dk_c, axis)
            _add_rows(part[1], call.kv, dv_c, axis)
        if step == 0:
            continue
        # the gradient of src's shard goes back to src; mine comes back from rank + step
        back = peers.exchange(part.to(own.dtype) if part is not None else None, r - step,
                              own if plan.calls((r + step) % w, r) else None, r + step, tag=w + step)
        if returning is not None:
            _add_returned(dkv, returning.wait())
        returning = back
    if returning is not None:
        _add_returned(dkv, returning.wait())
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _add_returned(dkv, returned) -> None:
    if returned is not None:
        dkv.add_(returned)
