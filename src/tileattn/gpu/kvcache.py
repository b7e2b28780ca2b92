"""Launcher of the append kernel (``tileattn.kernels.append``): a decoding step's new keys and
values written into its KV cache in one launch, rotated first when asked.

Inputs are validated by ``tileattn.ops.kvcache`` (shapes, dtypes, devices, and that every
position written lies inside the cache). Like the forward's, the launch is planned once per
shape class (``AppendPlan``) and then only launched (``_launch.Launch``); nothing here reads
device memory on the host, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from ..kernels.append import _append_kv_kernel
from ._launch import cdiv, contiguous_strides, int_class, launch_for, next_power_of_2, plan_for

__all__ = ["append_kv", "clear_plans", "AppendPlan"]

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
    key = (k.shape, k.stride(), v.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
           k.dtype, v.dtype, k_cache.dtype, v_cache.dtype, cache_seqlens.dtype, k.device,
           None if block_table is None else (block_table.shape[1], block_table.stride(0), block_table.dtype),
           None if rotary_cos is None else (rotary_cos.shape[1], rotary_cos.stride(), rotary_cos.dtype,
                                            rotary_sin.stride(), rotary_sin.dtype, bool(interleaved)),
           None if q is None else (q.shape, q.stride(), q.dtype, bool(q_per_token)),
           None if seqused_out is None else seqused_out.dtype,
           None if k_descale is None else k_descale.dtype)
    plan = plan_for(_PLANS, key, AppendPlan)
    return plan.run(k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, q, seqused_out,
                    k_descale, v_descale)


class AppendPlan:
    """The append launch of one shape class (built from ``append_kv``'s key alone)."""

    def __init__(self, key: tuple):
        (k_shape, k_stride, v_stride, kc_shape, kc_stride, vc_stride, k_dtype, v_dtype, kc_dtype, vc_dtype,
         lens_dtype, _device, table, rotary, q, seqused, descale) = key
        batch, seqlen_new, nheads_k, head_dim = k_shape
        paged = table is not None
        page_size = kc_shape[1]
        capacity = table[0] * page_size if paged else kc_shape[1]
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
                     seqlen_new, capacity, nheads_k, nheads)
        flags = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h,
                     PAGE_SIZE=page_size if paged else 1, IS_PAGED=paged,
                     ROTARY_HALF=rotary[0] if rotary else 0, INTERLEAVED=bool(rotary and rotary[5]),
                     ROTATE_Q=rotate_q, Q_PER_TOKEN=bool(rotate_q and q[3]), WRITE_SEQUSED=seqused is not None,
                     IS_FP8=descale is not None)
        tensors = (k_dtype, v_dtype, kc_dtype, vc_dtype, lens_dtype, table and table[2], rotary and rotary[2],
                   rotary and rotary[4], q and q[2], q and q[2], seqused, descale, descale)
        self.launch = launch_for(_append_kv_kernel, flags, dict(num_warps=4),
                                 (tensors, int_class(_append_kv_kernel, _FIRST_INT, self.ints)))

    def run(self, k_cache, v_cache, k, v, cache_seqlens, block_table, cos, sin, q, seqused_out, k_descale=None,
            v_descale=None):
        q_out = None if self.q_shape is None else torch.empty(self.q_shape, dtype=q.dtype, device=q.device)
        if self.grid[0] == 0:  # nothing new: attention sees the cached keys
            if seqused_out is not None:
                seqused_out.copy_(cache_seqlens)
        else:
            self.launch(self.grid, k, v, k_cache, v_cache, cache_seqlens, block_table, cos, sin,
                        q if q_out is not None else None, q_out, seqused_out, k_descale, v_descale, *self.ints)
        return q_out
