"""Shared-prefix (cascade) attention: ``cascade_attn_with_kvcache``.

Requests that share a prompt prefix (a system prompt) keep its keys once in the paged pool;
each request's own keys (its suffix) live in blocks of its own. Attention of request b over
``prefix ++ suffix_b`` splits by keys into two partial states that merge exactly
(``tileattn.ops.merge.merge_states``)::

    (o_p, lse_p) = attention of q_b over the prefix's keys   (one call for every request)
    (o_s, lse_s) = attention of q_b over suffix_b's keys      (one paged call, causal)
    out_b        = merge(o_p, lse_p, o_s, lse_s)               (one launch: the backend's merge_parts)

When the prefix call splits its keys (flash-decoding, on the Triton path), its split partial
states are not merged on their own: they join the suffix's state in that one final merge. On
Hopper the prefix call is the Gluon forward kernel (TMA copies of the prefix's pages, the query
heads of each KV head packed as the rows of one tile), split over the keys to fill the GPU.

On CUDA the prefix call runs on a second stream beside the suffix call: the prefix call is
compute-bound (a prefill's shape), the suffix call reads each request's own keys once
(memory-bound). Their programs need too many registers and too much shared memory to share an
SM, so they overlap only at their tails (docs/perf-notes.md). Both are captured by a CUDA graph
like any other call.

The prefix call packs the query rows of all requests (batch x seqlen_q of them) as the rows of
one sequence, not causal: every query sits after the whole prefix and sees all of it, so each
prefix key tile is read once per tile of query rows rather than once per request. FlashInfer's
two-level ``MultiLevelCascadeAttentionWrapper`` is the model.

Layouts: q (batch, seqlen_q, nheads, headdim); the pool k_cache, v_cache (num_blocks,
block_size, nheads_k, headdim) holds the prefix's blocks, ``prefix_block_table``
(prefix_blocks,) int32 with ``prefix_len`` keys (an int, or an int32 tensor (1,) a CUDA graph
can replay with other values), and each request's own blocks, ``block_table`` (batch,
max_blocks) int32 with ``cache_seqlens`` (batch,) int32 keys after the prefix. New ``k``, ``v``
(batch, seqlen_new, nheads_k, headdim) are appended to each suffix first, as
``flash_attn_with_kvcache`` does. ``v_cache`` (and ``v``) may have a head dim of its own,
headdim_v (the output, both partial states and their merge have it too), also as MLA's latent
pool, ``v_cache = k_cache[..., :headdim_v]`` (keys and values in one storage).

Causal is aligned bottom-right on the whole sequence: query i of request b sits at position
prefix_len + L_b - seqlen_q + i (L_b its suffix length after the append), so the queries must
lie in the suffix (L_b >= seqlen_q). Sliding windows and ALiBi depend on positions inside the
prefix and are not offered; softcap is.

An FP8 pool (float8_e4m3fn, ``tileattn.ops.fp8``) takes ``k_descale``/``v_descale`` (batch,
nheads_k) for the requests' own keys (new k, v are quantised with them) and
``prefix_k_descale``/``prefix_v_descale`` (1, nheads_k) for the prefix's, written once.
"""

from __future__ import annotations

import contextlib

import torch

from . import _validate as V
from ._custom import attention
from .kvcache import _append
from .backend import backend_for, backend_name

__all__ = ["cascade_attn_with_kvcache"]


def cascade_attn_with_kvcache(q, k_cache, v_cache, prefix_block_table, prefix_len, block_table, cache_seqlens, *,
                              k=None, v=None, softmax_scale=None, causal=True, softcap=0.0, num_splits=0,
                              return_softmax_lse=False, k_descale=None, v_descale=None, prefix_k_descale=None,
                              prefix_v_descale=None):
    """Attention of each request over a shared prefix and its own suffix, the prefix read once for
    all requests. Returns out (batch, seqlen_q, nheads, headdim_v), or ``(out, softmax_lse)`` with
    lse (batch, nheads, seqlen_q) fp32 when ``return_softmax_lse``.

    Equal to ``flash_attn_with_kvcache`` over a block table whose rows are the prefix's blocks
    followed by each request's (when the prefix fills whole blocks).
    """
    # Every check first: nothing is appended before all arguments passed.
    V.check_flags(causal=causal, return_softmax_lse=return_softmax_lse)
    V.check_qkv(q, k_cache, v_cache, packed=False, cache=True, headdim_v=True)
    batch, seqlen_q, nheads, headdim = q.shape
    headdim_v = v_cache.shape[-1]
    k_descale, v_descale = V.check_descales(k_cache, q, k_descale, v_descale, batch, v_cache=v_cache)
    prefix_k_descale, prefix_v_descale = V.check_descales(k_cache, q, prefix_k_descale, prefix_v_descale, 1,
                                                          prefix="prefix_", v_cache=v_cache)
    if block_table is None:
        V.fail(ValueError, "cascade_attn_with_kvcache reads a paged pool: block_table is required")
    capacity = V.cache_capacity(k_cache, block_table, batch, q.device)
    prefix_table, prefix_used = V.check_prefix(prefix_block_table, prefix_len, q.device)
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    cache_seqlens = V.cache_lengths(cache_seqlens, batch, capacity, True, q.device)
    V.check_new_kv(k, v, k_cache, v_cache, batch, dtype=None if k_descale is None else q.dtype)
    new_tokens = 0 if k is None else k.shape[1]
    num_splits = V.num_splits(num_splits)
    params = V.make_params(headdim, softmax_scale=softmax_scale, causal=causal, window_size=(-1, -1),
                           softcap=softcap, dropout_p=0.0)
    prefix_params = V.make_params(headdim, softmax_scale=softmax_scale, causal=False, window_size=(-1, -1),
                                  softcap=softcap, dropout_p=0.0)
    V.check_cache_values(prefix_used, 0, prefix_table.shape[1] * block_size, prefix_table, block_size, num_blocks,
                         table_name="prefix_block_table", lengths_name="prefix_len")
    V.check_cache_values(cache_seqlens, new_tokens, capacity, block_table, block_size, num_blocks)
    if causal:
        V.check_queries_in_suffix(cache_seqlens, new_tokens, seqlen_q)

    suffix_used = cache_seqlens
    if k is not None:
        q, suffix_used = _append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, None, None, True, causal,
                                 k_descale, v_descale)
    q = V.last_dim_contiguous(q)
    backend = backend_for(q.device)
    # the prefix: every request's query rows as the rows of one sequence (prefill-shaped,
    # compute-bound); planned first, so its split count sizes the buffer of partial states
    rows = q.reshape(1, batch * seqlen_q, nheads, headdim)
    prefix_args = dict(max_seqlen_q=batch * seqlen_q, max_seqlen_k=prefix_table.shape[1] * block_size,
                       seqused_k=prefix_used, block_table=prefix_table, num_splits=num_splits,
                       k_descale=prefix_k_descale)
    rows_shape, rows_lse_shape = (1, batch * seqlen_q, nheads, headdim_v), (1, nheads, batch * seqlen_q)
    plan, splits = None, 0
    if backend_name(q.device) == "triton":  # a split prefix's partial states join the final merge unmerged
        plan = backend.plan_partials(rows, k_cache, v_cache, params=prefix_params, **prefix_args)
        splits = plan.num_splits if plan is not None else 0
    parts = max(splits, 1) + 1  # the prefix's partial states, then the suffix's
    # every partial state in one fp32 buffer, merged by one launch (``merge_parts``): outputs
    # (parts, B, Sq, H, Dv); lse (parts, H, B, Sq), the prefix's order (its rows are (b, s) for each head)
    o_parts = torch.empty((parts, *q.shape[:-1], headdim_v), dtype=torch.float32, device=q.device)
    lse_parts = torch.empty((parts, nheads, batch, seqlen_q), dtype=torch.float32, device=q.device)
    o_prefix, lse_prefix = o_parts[:-1].view(-1, *rows_shape), lse_parts[:-1].view(-1, *rows_lse_shape)
    side = _side_stream(q.device)
    with _forked(side):  # on CUDA beside the suffix call (memory-bound)
        if splits:
            plan.run_partials(rows, k_cache, v_cache, prefix_params, prefix_used, prefix_table, o_prefix, lse_prefix,
                              prefix_k_descale, prefix_v_descale)
        else:
            _, lse_p = attention(rows, k_cache, v_cache, prefix_params, out=o_prefix[0], v_descale=prefix_v_descale,
                                 **prefix_args)
            lse_prefix[0].copy_(lse_p)
    # each request's own keys, causal within them
    _, lse_s = attention(q, k_cache, v_cache, params, max_seqlen_q=seqlen_q, max_seqlen_k=capacity,
                         seqused_k=suffix_used, block_table=block_table, num_splits=num_splits, out=o_parts[-1],
                         k_descale=k_descale, v_descale=v_descale)
    lse_parts[-1].copy_(lse_s.transpose(0, 1))
    _join(side)
    out = torch.empty((*q.shape[:-1], headdim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty_like(lse_s)
    backend.merge_parts(o_parts, lse_parts.permute(0, 2, 1, 3), out, lse)
    return (out, lse) if return_softmax_lse else out


_SIDE: dict = {}


def _side_stream(device: torch.device):
    """A second CUDA stream per device (None off CUDA or under Triton's interpreter)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


@contextlib.contextmanager
def _forked(side):
    """Run the block on ``side`` after everything queued so far on the current stream (a CUDA
    graph being captured follows the fork). Tensors it allocates there are read by the current
    stream only after ``_join``; a later reuse of their memory on ``side`` comes after the next
    fork, so after those reads."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def _join(side) -> None:
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
