"""Decoding and chunked prefill over a KV cache: ``flash_attn_with_kvcache``.

The cache is either contiguous, k_cache (batch, seqlen_cache, nheads_k, headdim), or paged:
a pool (num_blocks, block_size, nheads_k, headdim) read through ``block_table`` (batch,
max_blocks) int32, where key p of sequence b lives at
``pool[block_table[b, p // block_size], p % block_size]``. Any block_size works.

``cache_seqlens`` (batch,) int32 says how many keys each sequence has. New keys and values
``k``, ``v`` (batch, seqlen_new, nheads_k, headdim) are written into the cache in place at
positions cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1, then q attends to all
cache_seqlens[b] + seqlen_new keys; causal is aligned bottom-right, so a q of seqlen_new
tokens is exactly the tail of the sequence. (The caller advances cache_seqlens afterwards,
as with flash-attn.) ``cache_batch_idx`` (batch,) int32 picks the contiguous cache's row
of each sequence (a cache with more rows than the batch); rows named twice get the append
of either sequence. ``cache_leftpad`` (batch,) int32 says where each sequence's keys
start in a contiguous cache: sequence b attends to slots cache_leftpad[b] ...
cache_seqlens[b] + seqlen_new - 1 (the slots before it are padding, never read); causal
alignment counts from there. It is not combined with a paged cache, cache_batch_idx or
rotary embedding (NotImplementedError). With ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2) the new
keys are rotated at their positions before they are written, and q at the same positions
when causal or local (otherwise all of q at position cache_seqlens), pairing features
GPT-J style when ``rotary_interleaved``, GPT-NeoX style otherwise (``tileattn.ops.rotary``).

When batch x heads cannot fill the GPU the keys are split across thread blocks
(flash-decoding) and the partial (o, lse) states merged; ``num_splits=0`` picks the split
count, n > 0 forces it. No host-device synchronisation happens while a CUDA graph is
captured, so a decoding step can be replayed from a graph.
"""

from __future__ import annotations

import torch

from . import _validate as V
from ._custom import attention
from .rotary import apply_rotary, check_rotary
from .varlen import _check_block_table, _check_pool

__all__ = ["flash_attn_with_kvcache", "append_to_cache"]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q (batch, seqlen_q, nheads, headdim) over a (contiguous or paged) KV cache.

    Returns out (batch, seqlen_q, nheads, headdim), or ``(out, softmax_lse)`` with lse
    (batch, nheads, seqlen_q) fp32 when ``return_softmax_lse``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        V.fail(ValueError, f"q must be 4-D (batch, seqlen_q, nheads, headdim), got {getattr(q, 'shape', q)}")
    V.check_flags(rotary_interleaved=rotary_interleaved, return_softmax_lse=return_softmax_lse)
    batch = q.shape[0]
    _check_pool(k_cache, v_cache, q)
    V.check_qkv(q, k_cache, v_cache, packed=False)
    paged = block_table is not None
    if cache_batch_idx is not None:
        if paged:
            raise NotImplementedError("flash_attn_with_kvcache: cache_batch_idx with a paged cache (block_table)")
        V.check_int32_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
        # Row cache_batch_idx[b] of a contiguous cache is a one-page block table with pages of
        # seqlen_cache keys: the paged path reads (and appends to) it in place, no copy.
        block_table = cache_batch_idx.view(batch, 1)
    if block_table is not None:
        _check_block_table(block_table, batch, q.device)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            V.fail(ValueError, f"k_cache has batch {k_cache.shape[0]} but q has {batch}")
        capacity = k_cache.shape[1]
    cache_seqlens = _cache_lengths(cache_seqlens, batch, capacity, paged, q.device)
    if cache_leftpad is not None:
        if block_table is not None:
            raise NotImplementedError("flash_attn_with_kvcache: cache_leftpad with a paged cache (block_table) or "
                                      "cache_batch_idx")
        if rotary_cos is not None:
            raise NotImplementedError("flash_attn_with_kvcache: cache_leftpad with rotary_cos/rotary_sin")
        V.check_int32_vector("cache_leftpad", cache_leftpad, batch, q.device)
        if batch * capacity >= 2**31:
            V.fail(ValueError, f"cache_leftpad needs batch x seqlen_cache < 2**31, got {batch} x {capacity}")
    if (k is None) != (v is None):
        V.fail(ValueError, "pass both k and v to append, or neither")
    if k is not None:
        _check_new(k, v, k_cache, batch)
    new_tokens = 0 if k is None else k.shape[1]
    rotary_len = None
    if (rotary_cos is None) != (rotary_sin is None):
        V.fail(ValueError, "pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is not None:
        if k is None:
            V.fail(ValueError, "rotary_cos/rotary_sin rotate the new k and q: pass k and v too")
        if q.shape[1] != k.shape[1]:
            V.fail(ValueError, f"with rotary embedding q and the new k must have one seqlen, got {q.shape[1]} "
                               f"and {k.shape[1]}")
        rotary_len = check_rotary(rotary_cos, rotary_sin, q.shape[-1], q.device)
    V.check_cache_values(cache_seqlens, new_tokens, capacity, block_table, k_cache.shape[1], k_cache.shape[0],
                         rotary_len=rotary_len, table_name="block_table" if paged else "cache_batch_idx",
                         leftpad=cache_leftpad)
    seqused_k = cache_seqlens
    if rotary_cos is not None:
        q, k = _rotate(q, k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved,
                       causal or tuple(window_size) != (-1, -1))
    if k is not None:
        append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table)
        seqused_k = cache_seqlens + k.shape[1]
    if not isinstance(num_splits, int) or num_splits < 0:
        V.fail(ValueError, f"num_splits must be an int >= 0 (0 = automatic), got {num_splits!r}")
    params = V.make_params(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, dropout_p=0.0)
    alibi = V.check_alibi(alibi_slopes, batch, q.shape[2], q.device)
    q = V.last_dim_contiguous(q)
    if cache_leftpad is not None:
        out, lse = _attend_after_leftpad(q, k_cache, v_cache, params, alibi, seqused_k, cache_leftpad, num_splits)
    else:
        out, lse = attention(q, k_cache, v_cache, params, alibi_slopes=alibi, max_seqlen_q=q.shape[1],
                             max_seqlen_k=capacity, seqused_k=seqused_k, block_table=block_table,
                             num_splits=num_splits)
    return (out, lse) if return_softmax_lse else out


def _attend_after_leftpad(q, k_cache, v_cache, params, alibi, seqused_k, leftpad, num_splits):
    """Attention over cache rows leftpad[b] .. seqused_k[b] - 1 of each sequence b.

    The cache is read as packed keys (batch x seqlen_cache rows): sequence b's keys start at
    row b * seqlen_cache + leftpad[b] and number seqused_k[b] - leftpad[b]. q is packed alike,
    seqlen_q rows per sequence. The varlen kernel then does the rest, with no copy of the
    cache when its first two dimensions are contiguous.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    slots = k_cache.shape[1]
    starts = torch.arange(batch, dtype=torch.int32, device=q.device) * slots + leftpad
    cu_k = torch.cat([starts, starts.new_full((1,), batch * slots)])  # only the starts are read
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    out, lse = attention(q.reshape(batch * seqlen_q, nheads, headdim), k_cache.flatten(0, 1),
                         v_cache.flatten(0, 1), params, alibi_slopes=alibi, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=seqlen_q, max_seqlen_k=slots, seqused_k=seqused_k - leftpad,
                         num_splits=num_splits)
    return out.view(q.shape), lse.view(nheads, batch, seqlen_q).transpose(0, 1).contiguous()


def _rotate(q, k, cos, sin, cache_seqlens, interleaved: bool, per_token_q: bool):
    """Rotate the new keys at positions cache_seqlens + i, and q likewise when causal or local
    (otherwise every query token sits at position cache_seqlens), as flash-attn does."""
    steps = torch.arange(k.shape[1], device=k.device)
    k_pos = cache_seqlens.long()[:, None] + steps  # (batch, seqlen_new)
    if per_token_q:
        q_pos = cache_seqlens.long()[:, None] + torch.arange(q.shape[1], device=q.device)
    else:
        q_pos = cache_seqlens.long()[:, None].expand(q.shape[0], q.shape[1])
    return apply_rotary(q, cos, sin, q_pos, interleaved), apply_rotary(k, cos, sin, k_pos, interleaved)


def _cache_lengths(cache_seqlens, batch: int, capacity: int, paged: bool, device) -> torch.Tensor:
    """cache_seqlens as an int32 tensor (batch,) on q's device (values checked by the caller)."""
    if cache_seqlens is None:
        if paged:
            V.fail(ValueError, "a paged cache (block_table) needs cache_seqlens")
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    V.check_int32_vector("cache_seqlens", cache_seqlens, batch, device)
    return cache_seqlens


def _check_new(k, v, k_cache, batch: int) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            V.fail(ValueError, f"new {name} must be 4-D (batch, seqlen_new, nheads_k, headdim), got {getattr(t, 'shape', t)}")
        if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:]:
            V.fail(ValueError, f"new {name} has shape {tuple(t.shape)}; expected ({batch}, seqlen_new, "
                               f"{k_cache.shape[2]}, {k_cache.shape[3]})")
        if t.dtype != k_cache.dtype or t.device != k_cache.device:
            V.fail(TypeError, f"new {name} must match the cache's dtype and device ({k_cache.dtype}, {k_cache.device})")
    if k.shape != v.shape:
        V.fail(ValueError, f"new k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")


def append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table=None) -> None:
    """Write k, v (batch, seqlen_new, nheads_k, headdim) into the cache at cache_seqlens, in place.

    Pure tensor indexing on the device (no host synchronisation), contiguous or paged.
    """
    batch, seqlen_new = k.shape[0], k.shape[1]
    pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)  # (batch, seqlen_new)
    if block_table is None:
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, seqlen_new)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        block_size = k_cache.shape[1]
        blocks = block_table.long().gather(1, pos // block_size)
        slots = pos % block_size
        k_cache[blocks, slots] = k
        v_cache[blocks, slots] = v
