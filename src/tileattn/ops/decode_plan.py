"""A decoding step planned once and run per layer: ``DecodePlan`` (FlashInfer's plan/run split).

Every layer of a decoding step attends with the same batch, cache lengths, block table and
options; only q, the layer's cache and its new keys differ. ``flash_attn_with_kvcache`` checks
all of it and works the launch out on every call; a serving loop can do that once per step::

    plan = tileattn.DecodePlan(q, k_caches[0], v_caches[0], cache_seqlens, block_table,
                               seqlen_new=1, causal=True)           # once per step
    for layer in range(n_layers):
        out = plan.run(q[layer], k_caches[layer], v_caches[layer], k=k_new[layer], v=v_new[layer])

``plan.run(...)`` returns what ``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, ...,
cache_seqlens=cache_seqlens, block_table=block_table, ...)`` returns, bit for bit. The plan
checks the inputs and the cache lengths and table once, works out the split layout and the
kernels (``tileattn.gpu.attention.plan_fwd``) and allocates the split workspace once, and the
lse when it is not returned (the layers run one after the other on the stream, so they share
them); ``run`` only compares each layer's tensors with the planned shapes and launches: the
append of the new keys (rotated when asked) and attention, no host-device synchronisation, so
a step can be captured in a CUDA graph. An FP8 cache's ``k_descale``/``v_descale`` are the
step's, given to the plan. Not planned: ``cache_batch_idx`` (use ``flash_attn_with_kvcache``).

A plan is one step's: it checks the step's lengths and block table (against the cache's capacity,
the rotary tables) when it is made, not in ``run``. ``run`` reads ``cache_seqlens`` as it is then
(with ``seqlen_new > 0`` the append writes the lengths attention reads), so a plan kept while
the lengths advance in place computes what a new plan would, but nothing checks the new lengths:
make a new plan per step, and for a graph replayed step after step capture the plan's
construction (its device-side checks) with its runs.

The next step's plan can come from this one: ``plan = plan.next_step(q, k_caches[0], v_caches[0],
cache_seqlens, cache_leftpad=...)`` is the plan ``DecodePlan`` would make with the same options,
but when only what a decoding loop changes changed (the lengths and left pads, and the caches'
slot count and strides: transformers' caches grow by one key a step) it checks and works out
only what depends on those, and keeps the options' checks, the query offsets and the split
workspace.

``cache_leftpad`` (batch,) int32, as for ``flash_attn_with_kvcache``: sequence b attends to slots
cache_leftpad[b] ... of its contiguous cache row (a left-padded batch, as transformers' generate()
decodes it). The plan works out once the packed offsets that read the slots in place (every
layer's cache must then have the planned strides: transformers' transposed caches do). With
``learnable_sink`` (nheads,) fp32, a layer's sinks (their shape, dtype and device are what every
layer's must have), each ``run`` takes its own layer's sinks.

``v_cache`` (and each layer's new ``v``) may have a head dim of its own, headdim_v, as for
``flash_attn_with_kvcache``; the output has it too. MLA's latent cache, ``v_cache =
k_cache[..., :headdim_v]`` (keys and values in one storage), is planned as such: every layer's
v_cache must then be that view of its k_cache (the Triton plan reads the value tile from the key
tile, and the append writes the latent once), and a layer whose v_cache is not is refused.
"""

from __future__ import annotations

import torch

from . import _validate as V
from ._custom import attention
from .backend import backend_for, backend_name
from .kvcache import _append, _is_prefix_view, as_tokens, check_leftpad, key_offsets, query_offsets, unpack_lse

__all__ = ["DecodePlan"]


class DecodePlan:
    """One decoding step's attention, planned for every layer (see the module docstring).

    ``q``, ``k_cache``, ``v_cache`` are any one layer's (their shapes, strides, dtype and device
    are what every layer's must have); ``seqlen_new`` is how many tokens each layer appends
    (0: none), each layer passing ``k`` of shape (batch, seqlen_new, nheads_k, headdim) and ``v``
    of shape (batch, seqlen_new, nheads_k, headdim_v) (v_cache's head dim). The other arguments
    mean what they mean to ``flash_attn_with_kvcache``.
    """

    def __init__(self, q, k_cache, v_cache, cache_seqlens, block_table=None, *, seqlen_new: int = 0,
                 rotary_cos=None, rotary_sin=None, rotary_interleaved=True, softmax_scale=None, causal=False,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                 k_descale=None, v_descale=None, cache_leftpad=None, learnable_sink=None):
        # the checks of flash_attn_with_kvcache, once for the step (the new k, v: in ``run``)
        V.check_flags(rotary_interleaved=rotary_interleaved, return_softmax_lse=return_softmax_lse)
        V.check_qkv(q, k_cache, v_cache, packed=False, cache=True, headdim_v=True)
        self._options = dict(seqlen_new=seqlen_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                             rotary_interleaved=rotary_interleaved, softmax_scale=softmax_scale, causal=causal,
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
                             return_softmax_lse=return_softmax_lse, learnable_sink=learnable_sink,
                             block_table=block_table, k_descale=k_descale, v_descale=v_descale)  # for next_step
        seqlen_new = V.integer("seqlen_new", seqlen_new, 0)
        if seqlen_new:  # every layer's caches have these strides (``run`` checks them)
            V.check_writable("k_cache", k_cache)
            V.check_writable("v_cache", v_cache)
        num_splits = V.num_splits(num_splits)
        batch = q.shape[0]
        self.descales = V.check_descales(k_cache, q, k_descale, v_descale, batch, v_cache=v_cache)
        self._new_dtype = q.dtype if self.descales[0] is not None else k_cache.dtype  # FP8: quantised as written
        paged = block_table is not None
        self.sinks = V.check_sink(learnable_sink, q, q.shape[2]) is not None
        # rotary needs new keys to rotate: the check asks only whether there are any
        self._rotary_len = V.check_rotary(rotary_cos, rotary_sin, k_cache if seqlen_new else None, q.shape[-1],
                                          q.device)
        self.params = V.make_params(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                    softcap=softcap, dropout_p=0.0)
        per_token_q = self.params.window_left >= 0 or self.params.window_right >= 0  # causal or local
        self._rotary_reach = max(seqlen_new, q.shape[1] if per_token_q else 1)
        self.alibi = V.check_alibi(alibi_slopes, batch, q.shape[2], q.device)
        self.block_table, self.seqlen_new = block_table, seqlen_new
        self.rotary = (rotary_cos, rotary_sin, rotary_interleaved, per_token_q)
        self.return_softmax_lse, self.num_splits = return_softmax_lse, num_splits
        self.seqlen_q = q.shape[1]
        q = V.last_dim_contiguous(q)
        self._new_shapes = {"k": (batch, seqlen_new, *k_cache.shape[2:]), "v": (batch, seqlen_new, *v_cache.shape[2:])}
        self._out_shape = (*q.shape[:-1], v_cache.shape[-1])  # v's head dim
        self._lse_shape = (batch, q.shape[2], q.shape[1])
        self._queries = None  # with cache_leftpad: ``query_offsets`` of the packed call (rows, cu_seqlens_q)
        if cache_leftpad is not None:  # q, out and lse as the packed call has them
            self._out_shape = (batch * q.shape[1], q.shape[2], v_cache.shape[-1])
            self._lse_shape = (q.shape[2], batch * q.shape[1])
            self._queries = query_offsets(batch, q.shape[1], q.device)
        self._backend = backend_name(q.device)
        self._sink = learnable_sink if self.sinks else None  # for plan_fwd (its layout, which every layer's has)
        self._outputs = None  # out and lse as ``run`` allocates them, for plan_fwd (the launch depends on their layout)
        if self._backend == "triton":
            self._outputs = (torch.empty(self._out_shape, dtype=q.dtype, device=q.device),
                             torch.empty(self._lse_shape, dtype=torch.float32, device=q.device))
        self._fwd = self._workspace = None
        self._step(q, k_cache, v_cache, cache_seqlens, cache_leftpad, paged)

    def _step(self, q, k_cache, v_cache, cache_seqlens, cache_leftpad, paged: bool) -> None:
        """What depends on the step's caches (their slot count and strides), lengths and left pads:
        their checks, the packed offsets, the launch (``plan_fwd``) and its split workspace (kept
        from the plan this one continues when the new launch's has the same shapes). ``q`` has a
        unit last stride."""
        batch, block_table = q.shape[0], self.block_table
        capacity = V.cache_capacity(k_cache, block_table, batch, q.device)
        cache_seqlens = V.cache_lengths(cache_seqlens, batch, capacity, paged, q.device)
        k_descale = self.descales[0]
        self.pitch = None if cache_leftpad is None else check_leftpad(cache_leftpad, k_cache, v_cache, capacity, paged,
                                                                      k_descale, batch, q.device)
        V.check_cache_values(cache_seqlens, self.seqlen_new, capacity, block_table, k_cache.shape[1], k_cache.shape[0],
                             rotary_len=self._rotary_len, rotary_reach=self._rotary_reach, leftpad=cache_leftpad)
        self.cache_seqlens, self.capacity = cache_seqlens, capacity
        self.seqused_k = cache_seqlens + self.seqlen_new if self.seqlen_new else cache_seqlens
        self.packed = None  # with cache_leftpad: (cu_seqlens_q, cu_seqlens_k, seqused_k) of the packed call
        self.leftpad = cache_leftpad
        if cache_leftpad is not None:
            rows, cu_q = self._queries
            self.packed = (cu_q, *key_offsets(rows, k_cache, self.pitch, cache_leftpad, self.seqused_k))
        self._shapes = self._signature(q, k_cache, v_cache)
        if self._outputs is not None:
            last_fwd, last_workspace = self._fwd, self._workspace
            q, k, v, cu_q, cu_k, seqused_k = self._operands(q, k_cache, v_cache, self.seqused_k)
            self._fwd = backend_for(q.device).plan_fwd(
                q, k, v, *self._outputs, params=self.params, alibi_slopes=self.alibi, cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, max_seqlen_q=self.seqlen_q, max_seqlen_k=capacity, seqused_k=seqused_k,
                block_table=block_table, num_splits=self.num_splits, learnable_sink=self._sink, k_descale=k_descale)
            # the steps, like the layers, run one after the other on the stream: they may share it
            same = last_fwd is not None and getattr(last_fwd, "workspace_shapes", None) is not None and getattr(
                self._fwd, "workspace_shapes", None) == last_fwd.workspace_shapes
            self._workspace = last_workspace if same else self._fwd.new_workspace(q.device)

    def next_step(self, q, k_cache, v_cache, cache_seqlens, *, cache_leftpad=None) -> DecodePlan:
        """The plan of the next decoding step: what ``DecodePlan(q, k_cache, v_cache, cache_seqlens,
        cache_leftpad=cache_leftpad, <this plan's other arguments>)`` makes, bit for bit the same
        outputs, made cheaply when only what a decoding loop changes changed.

        That is: new lengths and left pads (any values: checked as ``DecodePlan`` checks them), and
        caches that differ from the planned ones only in their slot count and strides
        (transformers' caches, one key longer every step). What depends on those is checked and
        worked out again as ``DecodePlan`` does (``_step``); the options, their checks and the
        query offsets are kept, and so is the split workspace when the new launch's has the same
        shapes (steps, like layers, run one after the other on the stream). Anything else that
        differs (q, the batch, dtypes, devices, head dims, the backend, whether there is
        cache_leftpad), a plan with a block table or FP8 descales, or a non-tensor argument makes
        the plan anew through ``DecodePlan``: the same result, and bad input raises as it does
        there. This plan stays valid."""
        if not self._continued_by(q, k_cache, v_cache, cache_leftpad):
            return DecodePlan(q, k_cache, v_cache, cache_seqlens, cache_leftpad=cache_leftpad, **self._options)
        plan = DecodePlan.__new__(DecodePlan)
        plan.__dict__.update(self.__dict__)
        if self.seqlen_new:
            V.check_writable("k_cache", k_cache)
            V.check_writable("v_cache", v_cache)
        plan._step(V.last_dim_contiguous(q), k_cache, v_cache, cache_seqlens, cache_leftpad, False)
        return plan

    def _continued_by(self, q, k_cache, v_cache, cache_leftpad) -> bool:
        """Whether a step over these tensors differs from this plan's at most in what ``_step``
        checks and works out again: then every check of ``__init__`` that ``_step`` does not
        repeat (``check_qkv``'s among them) gives the answer it gave."""
        if (self.block_table is not None or self.descales != (None, None) or (cache_leftpad is None) != (
                self.leftpad is None) or not all(isinstance(t, torch.Tensor) for t in (q, k_cache, v_cache))):
            return False
        ks, vs = k_cache.shape, v_cache.shape
        if len(ks) != 4 or len(vs) != 4:
            return False
        q = V.last_dim_contiguous(q)
        return (self._slotless(self._signature(q, k_cache, v_cache)) == self._slotless(self._shapes)
                and ks[1] == vs[1] and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
                and backend_name(q.device) == self._backend)

    def _operands(self, q, k_cache, v_cache, seqused_k) -> tuple:
        """(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k) of a layer's attention call over ``seqused_k``
        keys per sequence: its own tensors, or with ``cache_leftpad`` the packed views of them
        (``kvcache.as_tokens``)."""
        if self.packed is None:
            return q, k_cache, v_cache, None, None, seqused_k
        batch, seqlen_q, nheads, headdim = q.shape
        cu_q, cu_k, used = self.packed
        if seqused_k is not self.seqused_k:  # the lengths this layer's append wrote
            used = seqused_k - self.leftpad
        return q.reshape(batch * seqlen_q, nheads, headdim), *as_tokens(k_cache, v_cache, self.pitch), cu_q, cu_k, used

    def fits(self, q, k_cache, v_cache) -> bool:
        """Whether ``run`` takes these tensors (the shapes, strides, dtype and device planned)."""
        return self._signature(V.last_dim_contiguous(q), k_cache, v_cache) == self._shapes

    @staticmethod
    def _slotless(signature: tuple) -> tuple:
        """A ``_signature`` less what ``next_step`` lets change: the caches' slot count and strides."""
        q_shape, q_stride, q_dtype, device, k_shape, _, v_shape, _, *rest = signature
        return (q_shape, q_stride, q_dtype, device, (k_shape[0], *k_shape[2:]), (v_shape[0], *v_shape[2:]), *rest)

    @staticmethod
    def _signature(q, k_cache, v_cache) -> tuple:
        # whether v_cache is k_cache's leading columns (MLA's latent) is part of it: the plan reads
        # the value tile from the key tile then, and the append writes the latent once
        return (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.shape,
                v_cache.stride(), k_cache.dtype, v_cache.dtype, k_cache.device, v_cache.device,
                _is_prefix_view(v_cache, k_cache))

    def run(self, q, k_cache, v_cache, k=None, v=None, learnable_sink=None):
        """One layer's attention: out (batch, seqlen_q, nheads, headdim_v), or ``(out, lse)``.

        q and the caches must have the shapes, strides, dtype and device the plan was made with;
        ``k``, ``v`` are the layer's new keys and values when the plan has ``seqlen_new > 0``;
        ``learnable_sink`` the layer's sinks when the plan was made with sinks (and only then).
        """
        q = V.last_dim_contiguous(q)
        if self._signature(q, k_cache, v_cache) != self._shapes:
            V.fail(ValueError, "q, k_cache, v_cache differ from the tensors the plan was made with (shape, strides, "
                               "dtype, device, or whether v_cache is a view of k_cache's leading columns): make a "
                               "new DecodePlan")
        return self._run(q, k_cache, v_cache, k, v, learnable_sink)

    def _run_fitted(self, q, k_cache, v_cache, k=None, v=None, learnable_sink=None):
        """``run`` for a caller that has just asked ``fits(q, k_cache, v_cache)`` (True) or made the
        plan (or ``next_step``'s) from these very tensors: their signature is not compared again.
        Everything else ``run`` checks is checked. Private: for tileattn's own callers (transformers'
        integration), which make that comparison themselves; users call ``run``."""
        return self._run(V.last_dim_contiguous(q), k_cache, v_cache, k, v, learnable_sink)

    def _run(self, q, k_cache, v_cache, k, v, learnable_sink):
        if (learnable_sink is not None) != self.sinks:
            V.fail(ValueError, "the plan was made with learnable_sink: pass each layer's" if self.sinks else
                               "the plan was made without learnable_sink: make one with sinks")
        sink = V.check_sink(learnable_sink, q, q.shape[2])
        seqused_k = self.seqused_k
        if self.seqlen_new:
            for name, t in (("k", k), ("v", v)):
                want = self._new_shapes[name]
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != self._new_dtype \
                        or t.device != k_cache.device:
                    V.fail(ValueError, f"the plan appends {name} of shape {want} ({self._new_dtype}, "
                                       f"{k_cache.device}), got {getattr(t, 'shape', t)}")
            cos, sin, interleaved, per_token_q = self.rotary
            # attention over the lengths the append wrote: cache_seqlens as it is now, plus the new keys
            q, seqused_k = _append(q, k_cache, v_cache, k, v, self.cache_seqlens, self.block_table, cos, sin,
                                   interleaved, per_token_q, *self.descales)
        elif k is not None or v is not None:
            V.fail(ValueError, "the plan was made with seqlen_new=0: it appends no k, v")
        batch, seqlen_q, nheads = q.shape[:3]
        q, k_cache, v_cache, cu_q, cu_k, seqused_k = self._operands(q, k_cache, v_cache, seqused_k)
        if self._fwd is not None:
            out = torch.empty(self._out_shape, dtype=q.dtype, device=q.device)
            # the lse nobody reads: the plan's (runs, like the split workspace, follow each other on the stream)
            lse = torch.empty(self._lse_shape, dtype=torch.float32, device=q.device) if self.return_softmax_lse \
                else self._outputs[1]
            self._fwd.run(q, k_cache, v_cache, out, lse, self.params, self.alibi, cu_q, cu_k, seqused_k,
                          self.block_table, self._workspace, learnable_sink=sink, k_descale=self.descales[0],
                          v_descale=self.descales[1])
        else:
            out, lse = attention(q, k_cache, v_cache, self.params, alibi_slopes=self.alibi, cu_seqlens_q=cu_q,
                                 cu_seqlens_k=cu_k, max_seqlen_q=seqlen_q, max_seqlen_k=self.capacity,
                                 seqused_k=seqused_k, block_table=self.block_table, num_splits=self.num_splits,
                                 learnable_sink=sink, k_descale=self.descales[0], v_descale=self.descales[1])
        if cu_q is not None:
            out = out.view(batch, seqlen_q, nheads, -1)
            lse = unpack_lse(lse, batch, seqlen_q) if self.return_softmax_lse else None
        return (out, lse) if self.return_softmax_lse else out
