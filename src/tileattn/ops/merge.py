"""The merge of partial attention states: the one function behind split-KV decoding and ring attention.

Two attentions of the same queries over disjoint key sets, ``(o_a, lse_a)`` and
``(o_b, lse_b)``, combine exactly:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

An empty state (a row that saw no key) has lse = -inf and contributes nothing; two empty
states merge to (0, -inf), never NaN.

Layouts: ``o`` is (batch, seqlen, nheads, headdim) with ``lse`` (batch, nheads, seqlen), or
packed ``o`` (total, nheads, headdim) with ``lse`` (nheads, total) — lse's last two axes are
o's first (query, head) axes swapped.
"""

from __future__ import annotations

import torch

from ._validate import check_states

__all__ = ["merge_states", "merge_many", "merge_into", "merge_sink"]


def _weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse), 0 for an empty part, laid out to broadcast against o."""
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.where(torch.isneginf(lse_part), torch.zeros_like(lse_part), torch.exp(lse_part - safe))
    return w.transpose(-1, -2).unsqueeze(-1)


def _empty_safe(combine, lses: tuple, empty: torch.Tensor) -> torch.Tensor:
    """``combine(*lses)`` (logaddexp, logsumexp) with -inf where every part is empty, whose gradient
    is 0 there: the log-sum-exp of -inf alone is -inf, but its backward divides by exp(-inf) and
    gives NaN (to every part's lse, even from a loss on o alone). The parts' entries of such rows
    are combined as zeros instead and the result put back to -inf; the other rows are untouched."""
    zero = torch.zeros((), dtype=lses[0].dtype, device=lses[0].device)
    lse = combine(*(torch.where(empty, zero, x) for x in lses))
    return torch.where(empty, torch.full_like(zero, float("-inf")), lse)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial states; returns ``(o, lse)`` with o in o_a's dtype and lse in fp32."""
    check_states((o_a, o_b), (lse_a, lse_b), "merge_states")
    acc = torch.promote_types(torch.float32, lse_a.dtype)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = _empty_safe(torch.logaddexp, (lse_a, lse_b), torch.isneginf(lse_a) & torch.isneginf(lse_b))
    o = _weight(lse_a, lse) * o_a.to(acc) + _weight(lse_b, lse) * o_b.to(acc)
    return o.to(o_a.dtype), lse


def merge_many(outs, lses):
    """Merge a list of partial states over disjoint key sets (all at once, fp32 accumulation)."""
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError("merge_many needs as many lse tensors as outputs, at least one")
    check_states(outs, lses, "merge_many")
    acc = torch.promote_types(torch.float32, lses[0].dtype)
    lse_all = torch.stack([x.to(acc) for x in lses])  # [S, ..., H, Sq]
    lse = _empty_safe(lambda x: torch.logsumexp(x, dim=0), (lse_all,), torch.isneginf(lse_all).all(0))
    o = sum(_weight(l_i, lse) * o_i.to(acc) for o_i, l_i in zip(outs, lse_all))
    return o.to(outs[0].dtype), lse


def merge_into(o_run: torch.Tensor, lse_run: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """``merge_states`` in place into a running fp32 state (views allowed): two passes over o_run
    instead of building a new output, for loops that merge many parts into one (ring attention)."""
    if o_run.shape != o_b.shape or lse_run.shape != lse_b.shape:
        raise ValueError(f"states differ in shape: o {tuple(o_run.shape)} vs {tuple(o_b.shape)}, "
                         f"lse {tuple(lse_run.shape)} vs {tuple(lse_b.shape)}")
    lse = torch.logaddexp(lse_run, lse_b.to(lse_run.dtype))
    o_run.mul_(_weight(lse_run, lse)).addcmul_(o_b, _weight(lse_b, lse))
    lse_run.copy_(lse)


def merge_sink(o: torch.Tensor, lse: torch.Tensor, learnable_sink: torch.Tensor):
    """Add learnable sinks (nheads,) to a state: the sink is the state (out 0, lse sink_h), merged once.

    Partial states over disjoint keys are computed and merged without sinks (a sink in each
    part would count once per part), then this once: what split-KV decoding does, and what
    ring attention or a user merging partial attentions should do. Differentiable in all inputs.
    """
    sink = learnable_sink.to(torch.promote_types(torch.float32, lse.dtype))
    return merge_states(o, lse, torch.zeros_like(o), sink[:, None].expand(lse.shape))
