"""Dense attention with flash-attn's public functions: ``flash_attn_func`` and its packed forms.

    out = softmax(scale * q k^T + masks/biases) v,   lse = logsumexp of each score row

q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim);
nheads % nheads_k == 0 (grouped-query / multi-query attention by index, no copies).
``causal`` with seqlen_q != seqlen_k is aligned to the bottom-right corner, as flash-attn
>= 2.1: query i sees key j iff j <= i + seqlen_k - seqlen_q. With seqlen_q = 2, seqlen_k = 5::

    1 1 1 1 0
    1 1 1 1 1

and with seqlen_q = 5, seqlen_k = 2 (the first three rows see nothing: output 0, lse -inf)::

    0 0
    0 0
    0 0
    1 0
    1 1
"""

from __future__ import annotations

import dataclasses

import torch

from ..contract import AttnParams
from ..dropout_mask import M32, fmix32
from . import _validate as V
from ._custom import attention, prepare
from ._memo import Memo, signature
from ._probs import attention_probs
from .backend import backend_for

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "draw_dropout_seed",
           "with_dropout_seed"]


def draw_dropout_seed(dropout_p: float, device: torch.device = torch.device("cpu")) -> int:
    """A fresh seed for the dropout hash; 0 when dropout is off.

    It comes from the default generator of the inputs' device, as flash-attn's does: on
    CUDA, from the generator's (seed, offset) state, read and advanced on the host (no
    synchronisation), so ``torch.cuda.manual_seed`` makes dropout reproducible; on the CPU,
    a draw from torch's CPU generator (``torch.manual_seed``).
    """
    if dropout_p == 0.0:
        return 0
    if device.type == "cuda":
        gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
        offset = gen.get_offset()
        gen.set_offset(offset + 4)  # Philox offsets advance in steps of 4
        return fmix32((gen.initial_seed() & M32) ^ fmix32((offset // 4) & M32)) & 0x7FFFFFFF
    return int(torch.randint(0, 2**31 - 1, (1,), device="cpu").item())  # not on a default device


def with_dropout_seed(params: AttnParams, device: torch.device) -> AttnParams:
    """``params`` with a seed drawn for this call (``draw_dropout_seed``) when dropout is on."""
    if params.dropout_p == 0.0:
        return params
    return dataclasses.replace(params, dropout_seed=draw_dropout_seed(params.dropout_p, device))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, learnable_sink=None):
    """Exact attention of q (batch, seqlen_q, nheads, headdim) over k (batch, seqlen_k, nheads_k, headdim)
    and v (batch, seqlen_k, nheads_k, headdim_v); headdim_v may differ from headdim (MLA: q/k 192, v 128),
    up to 512, and the output then has headdim_v; headdim is at most 576 (MLA's absorbed latent). On
    the GPU head dims above 256 run forward only: a call that may need gradients raises
    NotImplementedError there (the CPU tiles train them).

    Arguments as in flash-attn: ``dropout_p`` (set it to 0.0 in evaluation), ``softmax_scale``
    (default headdim ** -0.5), ``causal`` (bottom-right aligned), ``window_size=(left, right)``
    sliding window (-1 = unbounded), ``softcap`` (> 0: scores become softcap * tanh(s / softcap)),
    ``alibi_slopes`` fp32 (nheads,) or (batch, nheads) adding -slope * |i + seqlen_k - seqlen_q - j|,
    ``deterministic`` (the backward then adds every gradient element in a fixed order; by default
    Hopper's at head dims 64 and 128 reduces dQ's shares in a varying order), ``return_attn_probs``,
    ``learnable_sink`` fp32 (nheads,): a logit per query head that joins each row's softmax
    denominator without a value row (gpt-oss; flash-attn 4's name), differentiable.

    Returns out (batch, seqlen_q, nheads, headdim); with ``return_attn_probs`` also
    ``(out, softmax_lse, attn_probs)``: lse (batch, nheads, seqlen_q) fp32 (the sink included,
    differentiable: a loss on it, e.g. a z-loss, gets its gradient) and the
    probabilities (batch, nheads, seqlen_q, seqlen_k) with dropped entries negated — an
    O(N^2) tensor meant for tests, as in flash-attn.
    """
    key = signature((q, k, v, alibi_slopes, learnable_sink),
                    (dropout_p, softmax_scale, causal, softcap, deterministic, return_attn_probs), window_size,
                    kv=(1, 2))
    checked = _CHECKED.get(key)
    if checked is None:  # the metadata checks, once per signature (``_memo``)
        checked = _check(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                         return_attn_probs, learnable_sink)
        _CHECKED.put(key, checked)
        checked.lane = None if key is not None else False  # only a kept signature's calls take a lane
    lane = checked.lane
    if lane and alibi_slopes is None and learnable_sink is None and checked.unit_last and not return_attn_probs:
        return lane(q, k, v, None, None, None, None, None, None)[0]  # the common call: nothing to check or copy
    batch, seqlen_q = q.shape[0], q.shape[1]
    alibi = None if alibi_slopes is None else V.check_alibi(alibi_slopes, batch, q.shape[2], q.device)
    sink = None if learnable_sink is None else V.check_sink(learnable_sink, q, q.shape[2])

    params = checked.params if checked.params.dropout_p == 0.0 else with_dropout_seed(checked.params, q.device)
    if not checked.unit_last:  # a copy of those whose last dim is strided
        q, k, v = V.last_dim_contiguous(q), V.last_dim_contiguous(k), V.last_dim_contiguous(v)
    if lane:
        out, lse = lane(q, k, v, alibi, sink, None, None, None, None)
    else:
        out, lse = attention(q, k, v, params, alibi_slopes=alibi, max_seqlen_q=seqlen_q, max_seqlen_k=k.shape[1],
                             deterministic=deterministic, learnable_sink=sink, backend=checked.backend)
        if lane is None:  # the signature's first call: its later calls' launch, decided once
            checked.lane = prepare(q, k, v, out, lse, params, alibi_slopes=alibi, max_seqlen_q=seqlen_q,
                                   max_seqlen_k=k.shape[1], seqused_k=None, block_table=None, num_splits=1,
                                   learnable_sink=sink, k_descale=None, backend=checked.backend,
                                   deterministic=deterministic) or False
    if return_attn_probs:
        return out, lse, attention_probs(q, k, lse, params, alibi)
    return out


@dataclasses.dataclass(slots=True)
class _Checked:
    """What ``_check`` worked out for one signature of ``flash_attn_func``."""

    params: AttnParams
    backend: object  # the module backend_for(q.device) returns
    unit_last: bool  # q, k and v have a unit stride on their last dim (no copy to make)
    lane: object = False  # the signature's prepared launch (``_custom.prepare``), None: not yet asked


_CHECKED = Memo()


def _check(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs, learnable_sink) -> _Checked:
    """Every check of ``flash_attn_func``'s arguments (none reads a tensor's values)."""
    V.check_qkv(q, k, v, packed=False, headdim_v=True)
    V.check_flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    batch = q.shape[0]
    if k.shape[0] != batch:
        V.fail(ValueError, f"q and k/v must have one batch size, got {batch} and {k.shape[0]}")
    params = V.make_params(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, dropout_p=dropout_p)
    V.check_alibi(alibi_slopes, batch, q.shape[2], q.device)
    V.check_backward(batch, q, k, v, V.check_sink(learnable_sink, q, q.shape[2]))
    return _Checked(params, backend_for(q.device), q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` on qkv packed as (batch, seqlen, 3, nheads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        V.fail(ValueError, f"qkv must be (batch, seqlen, 3, nheads, headdim), got {getattr(qkv, 'shape', qkv)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` with k, v packed as kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        V.fail(ValueError, f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got {getattr(kv, 'shape', kv)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)
