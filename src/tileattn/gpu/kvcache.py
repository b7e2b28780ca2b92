"""Launcher of the append kernel (``tileattn.kernels.append``): a decoding step's new keys and
values written into its KV cache in one launch, rotated first when asked.

Inputs are validated by ``tileattn.ops.kvcache`` (shapes, dtypes, devices, and that every
position written lies inside the cache). Like the forward's, the launch is planned once per
shape class (``AppendPlan``) and then only launched (``_launch.Launch``); nothing here reads
device memory on the host, so a step can be captured in a CUDA graph. ``prepare_append`` hands
the plan itself to a caller whose calls share that metadata (the ops layer's decoding lane),
which then launches it with ``AppendPlan.step``.

A plan also holds its kernel with the cache's value check folded in (``AppendPlan.checking``: the
kernel's ``CHECK``, compiled with Triton's ``debug`` option and ``sanitize_overflow`` off): each
program asserts its sequence's length leaves room for the new tokens (and the rotary tables' rows)
and, paged, that the block id of the page it writes lies in the pool, before it writes. A call with
``check=True`` launches it in place of a separate check (``gpu.checks``) before the append.
"""

from __future__ import annotations

import torch

from ..kernels.append import _append_kv_kernel
from ._launch import cdiv, contiguous_strides, int_class, launch_for, next_power_of_2, plan_for

__all__ = ["append_kv", "clear_plans", "prepare_append", "AppendPlan"]

_MAX_TILE = 4096  # elements of one [heads, head dim] tile a program moves at once
_PLANS: dict[tuple, "AppendPlan"] = {}
_FIRST_INT = _append_kv_kernel.arg_names.index("stride_knb")


def clear_plans() -> None:
    """Forget every append plan (as ``attention.clear_plans``)."""
    _PLANS.clear()


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None, *, rotary_cos=None, rotary_sin=None,
              interleaved: bool = True, q=None, q_per_token: bool = True, seqused_out=None, k_descale=None,
              v_descale=None):
    """Write k, v (batch, seqlen_new, nheads_k, headdim) into the cache at positions
    ``cache_seqlens[b] + i``, contiguous (batch, seqlen_cache, ...) or paged through
    ``block_table``. With ``rotary_cos``/``rotary_sin`` the keys are rotated at their positions
    first and, when ``q`` is given, q too (at the keys' positions if ``q_per_token``, else all at
    ``cache_seqlens[b]``): the rotated q is returned, a new tensor. ``seqused_out`` (batch,)
    int32, when given, receives ``cache_seqlens + seqlen_new``. A float8_e4m3fn cache takes
    ``k_descale``/``v_descale`` contiguous (batch, nheads_k) fp32: k, v are quantised with them.
    """
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension to be appended to in place")
    k, v, q = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (k, v, q))
    plan = prepare_append(k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos=rotary_cos,
                          rotary_sin=rotary_sin, interleaved=interleaved, q=q, q_per_token=q_per_token,
                          seqused_out=seqused_out, k_descale=k_descale)
    return plan.run(k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, q, seqused_out,
                    k_descale, v_descale)


def prepare_append(k_cache, v_cache, k, v, cache_seqlens, block_table=None, *, rotary_cos=None, rotary_sin=None,
                   interleaved: bool = True, q=None, q_per_token: bool = True, seqused_out=None,
                   k_descale=None) -> "AppendPlan":
    """``append_kv``'s plan for tensors with these tensors' metadata (arguments as ``append_kv``'s;
    k, v, q and the caches contiguous in their last dimension), for a caller that appends such
    tensors again and again: ``plan.run`` or ``plan.step`` per call."""
    key = (k.shape, k.stride(), v.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
           k.dtype, v.dtype, k_cache.dtype, v_cache.dtype, cache_seqlens.dtype, k.device,
           None if block_table is None else (block_table.shape[1], block_table.stride(0), block_table.dtype),
           None if rotary_cos is None else (rotary_cos.shape, rotary_cos.stride(), rotary_cos.dtype,
                                            rotary_sin.stride(), rotary_sin.dtype, bool(interleaved)),
           None if q is None else (q.shape, q.stride(), q.dtype, bool(q_per_token)),
           None if seqused_out is None else seqused_out.dtype,
           None if k_descale is None else k_descale.dtype)
    return plan_for(_PLANS, key, AppendPlan)


class AppendPlan:
    """The append launch of one shape class (built from ``append_kv``'s key alone): ``launch``, and
    ``checking``, the same kernel with the cache's value check folded in (module docstring; None
    when there is nothing to append, so no program to check)."""

    def __init__(self, key: tuple):
        (k_shape, k_stride, v_stride, kc_shape, kc_stride, vc_stride, k_dtype, v_dtype, kc_dtype, vc_dtype,
         lens_dtype, _device, table, rotary, q, seqused, descale) = key
        batch, seqlen_new, nheads_k, head_dim = k_shape
        paged = table is not None
        page_size = kc_shape[1]
        capacity = table[0] * page_size if paged else kc_shape[1]
        # the lengths the check lets through: room for the new tokens, in the cache and in the rotary tables
        check_top = min(capacity, rotary[0][0] if rotary else capacity) - seqlen_new
        rotate_q = q is not None and rotary is not None
        if q is not None and not rotate_q:
            raise ValueError("append_kv returns a rotated q: pass rotary_cos and rotary_sin with q")
        nheads = q[0][2] if rotate_q else nheads_k
        head_dim_pad = max(16, next_power_of_2(head_dim))
        heads = max(nheads, nheads_k)
        block_h = min(next_power_of_2(heads), max(1, _MAX_TILE // head_dim_pad))
        self.grid = (batch * seqlen_new, cdiv(heads, block_h), 1)
        self.q_shape = q[0] if rotate_q else None
        q_out_stride = contiguous_strides(q[0]) if rotate_q else (0, 0, 0)
        cos_stride = rotary[1] if rotary else (0, 0)
        sin_stride = rotary[3] if rotary else (0, 0)
        self.ints = (*k_stride[:3], *v_stride[:3], *kc_stride[:3], *vc_stride[:3],
                     table[1] if paged else 0, *cos_stride, *sin_stride,
                     *(q[1][:3] if rotate_q else (0, 0, 0)), *q_out_stride[:3],
                     seqlen_new, capacity, nheads_k, nheads, check_top, kc_shape[0] if paged else 0)
        flags = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h,
                     PAGE_SIZE=page_size if paged else 1, IS_PAGED=paged,
                     ROTARY_HALF=rotary[0][1] if rotary else 0, INTERLEAVED=bool(rotary and rotary[5]),
                     ROTATE_Q=rotate_q, Q_PER_TOKEN=bool(rotate_q and q[3]), WRITE_SEQUSED=seqused is not None,
                     IS_FP8=descale is not None)
        tensors = (k_dtype, v_dtype, kc_dtype, vc_dtype, lens_dtype, table and table[2], rotary and rotary[2],
                   rotary and rotary[4], q and q[2], q and q[2], seqused, descale, descale)
        signature = (tensors, int_class(_append_kv_kernel, _FIRST_INT, self.ints))
        self.launch = launch_for(_append_kv_kernel, dict(flags, CHECK=False), dict(num_warps=4), signature)
        self.checking = None if self.grid[0] == 0 else launch_for(
            _append_kv_kernel, dict(flags, CHECK=True), dict(num_warps=4, debug=True, sanitize_overflow=False), signature)
        self.q_like = rotate_q and q[1] == contiguous_strides(q[0])  # q_out allocated as torch.empty_like(q)

    def run(self, k_cache, v_cache, k, v, cache_seqlens, block_table, cos, sin, q, seqused_out, k_descale=None,
            v_descale=None, check: bool = False):
        """The append (``append_kv``); with ``check``, through ``checking``. Returns the rotated q or None."""
        q_out = None if self.q_shape is None else torch.empty_like(q) if self.q_like else q.new_empty(self.q_shape)
        if self.grid[0] == 0:  # nothing new: attention sees the cached keys
            if seqused_out is not None:
                seqused_out.copy_(cache_seqlens)
        else:
            (self.checking if check else self.launch)(
                self.grid, k, v, k_cache, v_cache, cache_seqlens, block_table, cos, sin,
                q if q_out is not None else None, q_out, seqused_out, k_descale, v_descale, *self.ints)
        return q_out

    def step(self, k_cache, v_cache, k, v, cache_seqlens, block_table, cos, sin, q, check):
        """A decoding step's append for a plan prepared with ``seqused_out`` (``prepare_append``): (q, the
        lengths after it, a new tensor), q rotated when the plan rotates it."""
        seqused = torch.empty_like(cache_seqlens)
        q_out = self.run(k_cache, v_cache, k, v, cache_seqlens, block_table, cos, sin, q, seqused, check=check)
        return q if q_out is None else q_out, seqused
