"""Packed variable-length batches: ``flash_attn_varlen_func`` and its packed forms.

Tokens of all sequences are packed along one axis, q (total_q, nheads, headdim) and k, v
(total_k, nheads_k, headdim); ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, batch + 1) hold
the running offsets, so sequence b owns rows cu_seqlens[b]:cu_seqlens[b + 1]. Each sequence
attends only to its own keys, with masks aligned bottom-right per sequence. A sequence of
length zero is allowed; a query row that sees no key gets output 0 and lse -inf.

``block_table`` (batch, max_blocks) int32 reads the keys of sequence b from a paged pool
k, v (num_blocks, block_size, nheads_k, headdim) instead; its length is then
cu_seqlens_k[b + 1] - cu_seqlens_k[b] (forward only).
"""

from __future__ import annotations

import torch

from . import _validate as V
from ._custom import attention
from .attention import draw_dropout_seed

__all__ = ["flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over a packed batch; returns out (total_q, nheads, headdim).

    With ``return_attn_probs`` returns ``(out, softmax_lse, None)``: lse (nheads, total_q)
    fp32, and None where flash-attn gives a probability tensor (tileattn builds that test-only
    N x N tensor for ``flash_attn_func`` alone).
    """
    V.check_flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    paged = block_table is not None
    if paged:
        V.check_qkv(q, q, q, packed=True)
        _check_pool(k, v, q)
    else:
        V.check_qkv(q, k, v, packed=True)
    batch = _check_offsets(cu_seqlens_q, cu_seqlens_k, q, max_seqlen_q, max_seqlen_k)
    V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    seqused_k = None
    if paged:
        _check_block_table(block_table, batch, q.device)
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        V.check_cache_values(seqused_k, 0, block_table.shape[1] * k.shape[1], block_table, k.shape[1], k.shape[0])
        cu_seqlens_k = None
    else:
        V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    params = V.make_params(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, dropout_p=dropout_p, dropout_seed=draw_dropout_seed(dropout_p))
    alibi = V.check_alibi(alibi_slopes, batch, q.shape[1], q.device)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    out, lse = attention(q, k, v, params, alibi_slopes=alibi, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                         block_table=block_table, deterministic=deterministic)
    if return_attn_probs:
        return out, lse, None
    return out


def _check_offsets(cu_seqlens_q, cu_seqlens_k, q, max_seqlen_q, max_seqlen_k) -> int:
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        V.fail(ValueError, "cu_seqlens_q must be a 1-D int32 tensor of length batch + 1 (>= 2)")
    batch = cu_seqlens_q.shape[0] - 1
    V.check_int32_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, q.device)
    V.check_int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, q.device)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            V.fail(TypeError, f"{name} must be a non-negative int, got {m!r}")
    return batch


def _check_pool(k_pool, v_pool, q) -> None:
    for name, t in (("k", k_pool), ("v", v_pool)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            V.fail(ValueError, f"the {name} cache must be 4-D: (batch, seqlen_cache, nheads_k, headdim), or with "
                               f"block_table a pool (num_blocks, block_size, nheads_k, headdim); got "
                               f"{getattr(t, 'shape', t)}")
        if t.dtype != q.dtype or t.device != q.device:
            V.fail(TypeError, f"{name} cache must match q's dtype and device ({q.dtype}, {q.device}), "
                              f"got {t.dtype}, {t.device}")
    if k_pool.shape != v_pool.shape:
        V.fail(ValueError, f"k and v caches must have one shape, got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    V.check_heads(q, k_pool)


def _check_block_table(block_table, batch: int, device) -> None:
    """Type, shape and device of a block table (its values: ``_validate.check_cache_values``)."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        V.fail(TypeError, "block_table must be an int32 tensor of shape (batch, max_blocks_per_seq)")
    if block_table.shape[0] != batch:
        V.fail(ValueError, f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
    if block_table.device != device:
        V.fail(ValueError, f"block_table is on {block_table.device} but q is on {device}")


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn_varlen_func`` on qkv packed as (total, 3, nheads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        V.fail(ValueError, f"qkv must be (total, 3, nheads, headdim), got {getattr(qkv, 'shape', qkv)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_varlen_func`` with kv packed as (total_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        V.fail(ValueError, f"kv must be (total_k, 2, nheads_k, headdim), got {getattr(kv, 'shape', kv)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
