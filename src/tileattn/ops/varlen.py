"""Packed variable-length batches: ``flash_attn_varlen_func`` and its packed forms.

Tokens of all sequences are packed along one axis, q (total_q, nheads, headdim) and k, v
(total_k, nheads_k, headdim); ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, batch + 1) hold
the running offsets, so sequence b owns rows cu_seqlens[b]:cu_seqlens[b + 1]. Each sequence
attends only to its own keys, with masks aligned bottom-right per sequence. A sequence of
length zero is allowed; a query row that sees no key gets output 0 and lse -inf.

``block_table`` (batch, max_blocks) int32 reads the keys of sequence b from a paged pool
k, v (num_blocks, block_size, nheads_k, headdim) instead (forward only). Its length is then
``seqused_k[b]`` (int32 (batch,)), or cu_seqlens_k[b + 1] - cu_seqlens_k[b] when seqused_k is
not given; with seqused_k, cu_seqlens_k may be None. This is the one call a serving engine
makes per layer for a mixed batch, as vLLM calls flash-attn::

    flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k,
                           seqused_k=seqused_k, block_table=block_table, causal=True, out=out)

each sequence's new tokens (1 when decoding, a few speculative ones, a prefill chunk, or none)
being the last rows of its seqused_k keys (causal aligned bottom-right, per sequence). With
packed keys, ``seqused_k`` likewise limits sequence b to its first seqused_k[b] keys.

``out`` (total_q, nheads, headdim_v) in q's dtype, any strides, receives the output in place.
A float8_e4m3fn pool takes ``k_descale``/``v_descale`` (batch, nheads_k) fp32 (``ops.fp8``).
``num_splits``: None splits the keys of a cache (``seqused_k`` or ``block_table``) when the grid
is small and never splits packed keys; 0 always lets the launcher choose; n > 0 forces n. No
host-device synchronisation happens on CUDA tensors (value checks run on the device,
``tileattn.ops._validate``), so the call can be replayed from a CUDA graph.
"""

from __future__ import annotations

import torch

from . import _validate as V
from ._custom import attention
from .attention import with_dropout_seed

__all__ = ["flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, learnable_sink=None,
                           seqused_k=None, out=None, num_splits=None, k_descale=None, v_descale=None,
                           return_softmax_lse=False):
    """Attention over a packed batch; returns out (total_q, nheads, headdim).

    ``learnable_sink`` fp32 (nheads,): a sink logit per query head (see ``flash_attn_func``).
    v may have a head dim of its own (headdim_v); the output then has it.

    With ``return_attn_probs`` returns ``(out, softmax_lse, None)``: lse (nheads, total_q)
    fp32, and None where flash-attn gives a probability tensor (tileattn builds that test-only
    N x N tensor for ``flash_attn_func`` alone); with ``return_softmax_lse``, ``(out, softmax_lse)``.
    """
    V.check_flags(deterministic=deterministic, return_attn_probs=return_attn_probs,
                  return_softmax_lse=return_softmax_lse)
    paged = block_table is not None
    V.check_qkv(q, k, v, packed=True, cache=paged, headdim_v=True)
    keys_by_seqused = paged and seqused_k is not None and cu_seqlens_k is None  # then cu_seqlens_k may be None
    batch = V.check_offsets(cu_seqlens_q, cu_seqlens_q if keys_by_seqused else cu_seqlens_k, q)
    max_seqlen_q = V.integer("max_seqlen_q", max_seqlen_q, 0)
    max_seqlen_k = V.integer("max_seqlen_k", max_seqlen_k, 0)
    params = V.make_params(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, dropout_p=dropout_p)
    alibi = V.check_alibi(alibi_slopes, batch, q.shape[1], q.device)
    sink = V.check_sink(learnable_sink, q, q.shape[1])
    V.check_backward(batch, q, k, v, sink)
    k_descale, v_descale = V.check_descales(k, q, k_descale, v_descale, batch, v_cache=v)
    if seqused_k is not None:
        V.check_int32_vector("seqused_k", seqused_k, batch, q.device)
    num_splits = (0 if seqused_k is not None or paged else 1) if num_splits is None else V.num_splits(num_splits)
    V.check_out(out, q, v)
    V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    if paged:
        V.check_block_table(block_table, batch, q.device)
        lengths_name = "seqused_k"
        if seqused_k is None:  # the keys of sequence b are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] of its pages
            V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None, max_seqlen_k)
            seqused_k, lengths_name = cu_seqlens_k[1:] - cu_seqlens_k[:-1], "cu_seqlens_k"
        V.check_cache_values(seqused_k, 0, block_table.shape[1] * k.shape[1], block_table, k.shape[1], k.shape[0],
                             lengths_name=lengths_name)
        cu_seqlens_k = None
    else:
        V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
        if seqused_k is not None:
            V.check_used_keys(seqused_k, cu_seqlens_k)

    params = with_dropout_seed(params, q.device)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    out, lse = attention(q, k, v, params, alibi_slopes=alibi, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                         block_table=block_table, deterministic=deterministic, learnable_sink=sink,
                         num_splits=num_splits, k_descale=k_descale, v_descale=v_descale, out=out)
    if return_attn_probs:
        return out, lse, None
    if return_softmax_lse:
        return out, lse
    return out


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
