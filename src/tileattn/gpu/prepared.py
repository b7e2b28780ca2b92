"""The forward launch of one call signature, decided once: ``prepare_fwd``.

``attn_fwd`` decides on every call which kernel runs (the Hopper kernel or the portable one),
builds the plan key, looks the plan up and assembles ~35 kernel arguments. For a caller whose
calls all share shapes, strides, dtypes, device, options and which optional tensors are given
(the ops layer's memo, ``tileattn.ops._memo``), none of that changes from call to call:
``prepare_fwd`` works it out once and returns the launch with only the tensors left to pass.

It prepares only calls the Hopper kernel declines by their shapes alone, the first tests of
``hopper_fwd_reason`` (a KV cache, an explicit split count, fewer than ``MIN_SEQLEN_Q`` query
rows), since the rest of that rule reads the environment and the pointers' alignment on every
call; and calls without dropout (whose seed changes every call). ``clear_plans`` (new tile
constants) sends every prepared launch back to ``attn_fwd``.
"""

from __future__ import annotations

from . import attention as A
from .hopper import MIN_SEQLEN_Q

__all__ = ["prepare_fwd", "PreparedFwd"]


def prepare_fwd(q, k, v, out, lse, *, params, alibi_slopes, max_seqlen_q: int, max_seqlen_k: int, seqused_k,
                block_table, num_splits: int, learnable_sink, k_descale) -> "PreparedFwd | None":
    """``attn_fwd`` on dense (not packed) tensors, prepared for every call with these tensors'
    metadata and these options (see the module docstring), or None where it cannot be. ``out``
    and ``lse`` stand for the outputs of every call: contiguous, ``out`` in q's dtype."""
    by_shape = block_table is not None or seqused_k is not None or num_splits > 1 or q.shape[1] < MIN_SEQLEN_Q
    if not by_shape or params.dropout_p > 0:
        return None
    plan = A.plan_fwd(q, k, v, out, lse, params=params, alibi_slopes=alibi_slopes, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, block_table=block_table,
                      num_splits=num_splits, learnable_sink=learnable_sink, k_descale=k_descale)
    if plan.fwd is None or plan.long is not None:  # a config still to tune, a mixed batch: per call
        return None
    return PreparedFwd(plan, (*plan.call_ints(k, v), *A.scalar_args(params, q.shape[-2])),
                       dict(params=params, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, num_splits=num_splits),
                       (tuple(out.shape), tuple(lse.shape), lse.dtype))


class PreparedFwd:
    """``prepare_fwd``'s launch: ``prepared(q, k, v, alibi_slopes, learnable_sink, seqused_k,
    block_table, k_descale, v_descale)`` allocates (out, lse) as ``prepare_fwd``'s were, does
    into them what ``attn_fwd`` with the prepared options does (split partials in a fresh
    workspace, then their merge) and returns them. ``calls`` counts its calls."""

    __slots__ = ("plan", "tail", "options", "out_shape", "lse_shape", "lse_dtype", "generation", "calls")

    def __init__(self, plan: A.FwdPlan, tail: tuple, options: dict, outputs: tuple):
        self.plan, self.tail, self.options, self.generation, self.calls = plan, tail, options, A.generation, 0
        self.out_shape, self.lse_shape, self.lse_dtype = outputs

    def __call__(self, q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale, v_descale):
        out, lse = q.new_empty(self.out_shape), q.new_empty(self.lse_shape, dtype=self.lse_dtype)
        self.calls += 1
        plan = self.plan
        if self.generation != A.generation:  # the plans were forgotten: their tiles may be stale
            A.attn_fwd(q, k, v, out, lse, alibi_slopes=alibi_slopes, seqused_k=seqused_k, block_table=block_table,
                       learnable_sink=learnable_sink, k_descale=k_descale, v_descale=v_descale, **self.options)
        elif plan.combine is None:
            plan.fwd(plan.grid, q, k, v, out, lse, alibi_slopes, learnable_sink, None, None, seqused_k, block_table,
                     k_descale, v_descale, *self.tail)
        else:
            o_parts, lse_parts = plan.new_workspace(q.device)
            plan.fwd(plan.grid, q, k, v, o_parts, lse_parts, alibi_slopes, learnable_sink, None, None, seqused_k,
                     block_table, k_descale, v_descale, *self.tail)
            plan.combine(plan.combine_grid, o_parts, lse_parts, out, lse, learnable_sink, *plan.combine_ints)
        return out, lse
