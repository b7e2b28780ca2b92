"""The forward launch of one call signature, decided once: ``prepare_fwd``.

``attn_fwd`` decides on every call which kernel runs (the Hopper kernel or the portable one),
builds the plan key, looks the plan up and assembles ~35 kernel arguments. For a caller whose
calls all share shapes, strides, dtypes, device, options and which optional tensors are given
(the ops layer's memo, ``tileattn.ops._memo``), only the Hopper decision can change from call
to call: ``prepare_fwd`` works the rest out once and returns the launch with only the tensors
left to pass.

The Hopper rule (``hopper_fwd_reason``) is asked in two parts. What the signature fixes (a KV
cache, an explicit split count, fewer than ``MIN_SEQLEN_Q`` query rows, dtypes, head
dims, strides, options: ``fwd_signature_reason``) once, here; where that says yes (prefill shapes),
the rest, which reads the environment and the pointers' alignment (``call_reason``), on every call,
as ``attn_fwd`` would, and a call it accepts goes to the signature's Gluon launch (``HopperFwd``:
grid, integer arguments, descriptor fields and argument classes kept from its first call); the
portable plan serves the calls it declines (through ``attn_fwd`` while that plan still has a tile
to tune: its first such call tunes it). Calls with dropout (whose seed changes every call) get no
launch. ``clear_plans`` (new tile constants) sends every prepared portable launch back to
``attn_fwd``.

A launch over a KV cache whose plan can fold the cache's value check into its kernel
(``FwdPlan.checking_launch``) has ``folds_cache_check``: a call with ``check_cache=True`` then
launches that kernel, which asserts the lengths and block-table entries each program reads by
before it reads a key, instead of the plain one. The ops layer asks for it in place of launching
``gpu.checks``' kernel first (``tileattn.ops.kvcache``): one launch fewer per decoding call.

A split launch whose plan has a merged form (``FwdPlan.merged``) launches it for an eager call
(``gpu.combine.eager_counters``: not while the stream captures a CUDA graph), its last split
programs merging the partials in place of the combine launch (the cache's check folded in too
where asked): one launch per decoding call in all.
"""

from __future__ import annotations

import torch

from . import attention as A
from ._launch import contiguous_strides
from .combine import eager_counters
from .hopper import MIN_SEQLEN_Q, HopperFwd, call_reason, fwd_signature_reason

__all__ = ["prepare_fwd", "PreparedFwd"]


def prepare_fwd(q, k, v, out, lse, *, params, alibi_slopes, max_seqlen_q: int, max_seqlen_k: int, seqused_k,
                block_table, num_splits: int, learnable_sink, k_descale) -> "PreparedFwd | None":
    """``attn_fwd`` on dense (not packed) tensors, prepared for every call with these tensors'
    metadata and these options (see the module docstring), or None where it cannot be. ``out``
    and ``lse`` stand for the outputs of every call: contiguous, ``out`` in q's dtype."""
    if params.dropout_p > 0:
        return None
    by_shape = block_table is not None or seqused_k is not None or num_splits > 1 or q.shape[1] < MIN_SEQLEN_Q
    plan = A.plan_fwd(q, k, v, out, lse, params=params, alibi_slopes=alibi_slopes, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, block_table=block_table,
                      num_splits=num_splits, learnable_sink=learnable_sink, k_descale=k_descale)
    if not isinstance(plan, A.FwdPlan):  # the Gluon FP8 decode's plan: per call (attn_fwd asks its rule)
        return None
    if plan.long is not None or by_shape and plan.fwd is None:  # a mixed batch, a tile still to tune: per call
        return None
    # out like q when q is contiguous and as wide as v (torch.empty_like: no shape to parse)
    out_like_q = out.shape == q.shape and q.stride() == contiguous_strides(q.shape)
    hopper = fwd_signature_reason(q, k, v, params, alibi_slopes=alibi_slopes, varlen=False,
                                  paged=block_table is not None, seqused_k=seqused_k, num_splits=num_splits,
                                  max_seqlen_q=max_seqlen_q, out=out, lse=lse) is None
    # the cache's value check folded into the kernel: public calls only (the diagonal where the last
    # query block's splits read every page in use, kernels/attn_fwd.py)
    checking = (plan.checking_launch(), plan.checking_launch(merged=True)) \
        if not hopper and params.diag_shift == 0 else (None, None)
    return PreparedFwd(plan, (*plan.call_ints(k, v), *A.scalar_args(params, q.shape[-2])),
                       dict(params=params, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, num_splits=num_splits),
                       (tuple(out.shape), tuple(lse.shape), lse.dtype),
                       HopperFwd(params, max_seqlen_q, max_seqlen_k) if hopper else None, out_like_q, *checking)


class PreparedFwd:
    """``prepare_fwd``'s launch: ``prepared(q, k, v, alibi_slopes, learnable_sink, seqused_k,
    block_table, k_descale, v_descale)`` allocates (out, lse) as ``prepare_fwd``'s were, does
    into them what ``attn_fwd`` with the prepared options does (with ``hopper``, the signature's
    ``HopperFwd``: the Hopper kernel when the call's part of its rule takes the call; else split
    partials in a fresh workspace, then their merge: by the split launch itself, the plan's
    ``merged``, where ``eager_counters`` gives counters, else by the combine launch) and returns them.
    ``calls`` counts its calls.

    ``checking`` / ``merged_checking``: the plan's kernel / merged kernel with the KV cache's value
    check folded in (``folds_cache_check``), which a call with ``check_cache`` launches instead: the
    lengths' top is the cache's capacity and there are no left pads (the ops layer's lane calls).
    Should the plans have been forgotten since, such a call launches ``gpu.checks``' kernel before
    ``attn_fwd``, as the ops layer would."""

    __slots__ = ("plan", "tail", "options", "out_shape", "lse_shape", "lse_dtype", "hopper", "out_like_q", "generation",
                 "calls", "checking", "merged_checking", "folds_cache_check")

    def __init__(self, plan: A.FwdPlan, tail: tuple, options: dict, outputs: tuple, hopper: HopperFwd | None = None,
                 out_like_q: bool = False, checking=None, merged_checking=None):
        self.plan, self.tail, self.options, self.generation, self.calls = plan, tail, options, A.generation, 0
        self.out_shape, self.lse_shape, self.lse_dtype = outputs
        self.hopper, self.out_like_q = hopper, out_like_q
        self.checking, self.merged_checking, self.folds_cache_check = checking, merged_checking, checking is not None

    def __call__(self, q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale, v_descale,
                 check_cache: bool = False):
        out = torch.empty_like(q) if self.out_like_q else q.new_empty(self.out_shape)
        lse = q.new_empty(self.lse_shape, dtype=self.lse_dtype)
        self.calls += 1
        hopper = self.hopper
        if hopper is not None and call_reason(q, k, v) is None:  # as attn_fwd asks hopper_fwd_reason (dense, unsplit)
            hopper(q, k, v, out, lse, learnable_sink)
            return out, lse
        plan = self.plan
        fwd = self.checking if check_cache else plan.fwd
        if self.generation != A.generation or plan.fwd is None:  # plans forgotten (stale tiles), or a tile to tune
            if check_cache:
                self._check_apart(seqused_k, block_table, k.shape[1])
            A.attn_fwd(q, k, v, out, lse, alibi_slopes=alibi_slopes, seqused_k=seqused_k, block_table=block_table,
                       learnable_sink=learnable_sink, k_descale=k_descale, v_descale=v_descale, **self.options)
        else:
            # the kernel writes out/lse, or split partials that its own last programs merge into them
            # (``merged``: MergeOut, MergeLse, Counters) or the combine launch after it
            dst, merge, combine = (out, lse), (None, None, None), None
            if plan.combine is not None:
                dst = plan.new_workspace(q.device)
                counters = eager_counters(plan)
                if counters is not None:  # one launch: its last split programs merge the splits
                    fwd = self.merged_checking if check_cache else plan.merged
                    merge = (out, lse, counters)
                else:
                    combine = plan.combine
            fwd(plan.grid, q, k, v, *dst, *merge, alibi_slopes, learnable_sink, None, None, seqused_k, block_table,
                k_descale, v_descale, *self.tail)
            if combine is not None:
                combine(plan.combine_grid, *dst, out, lse, learnable_sink, *plan.combine_ints)
        return out, lse

    def _check_apart(self, seqused_k, block_table, page_size: int) -> None:
        """The check ``checking`` folds, as a launch of its own (``gpu.checks``)."""
        from ..kernels.checks import ASSERT_MESSAGE
        from .checks import CacheCheck

        plan = self.plan
        ok = CacheCheck(seqused_k, plan.cache_top, None, block_table, 0, page_size, plan.num_blocks,
                        asserting=seqused_k.is_cuda)(seqused_k, None, block_table)
        if ok is not None:  # CPU tensors (Triton's interpreter): the flag
            torch._assert_async(ok, ASSERT_MESSAGE.value)
