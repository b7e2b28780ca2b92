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
alignment counts from there. The cache is then read as packed keys in place when its rows are a
whole number of slot strides apart (contiguous, or transformers' (batch, nheads_k, seqlen,
headdim) transposed), else copied. It combines with cache_batch_idx and rotary embedding, not
with a paged cache (NotImplementedError; flash-attn refuses that too).

With ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2) the new keys are rotated
before they are written, key j at position cache_seqlens[b] + j; q is rotated at
cache_seqlens[b] + i (query i) when causal or local, otherwise all of q at cache_seqlens[b]
— flash-attn's positions, also when seqlen_q != seqlen_new (speculative decoding, chunked
appends) and with cache_leftpad (positions are the absolute cache slots). Features pair
GPT-J style when ``rotary_interleaved``, GPT-NeoX style otherwise (``tileattn.ops.rotary``).

All arguments are checked before anything is rotated or written (``tileattn.ops._validate``):
a bad option leaves the cache untouched. The checks that read no tensor values run once per
call signature (``tileattn.ops._memo``); those that read values run on every call. A kept
signature's later calls on the Triton backend launch what its first call prepared
(``_custom.prepare``), and one with nothing to derive per call (no row index, left pad, ALiBi,
sinks or descales; an append, rotated or not, whose q is rotated beside its keys: ``_lane_for``)
does only its value check, the append's launch (``gpu.prepare_append``) and the attention's. On a
GPU, where the check would be a kernel of its own, those launches' kernels do it
(``FOLD_APPEND_CHECK``, ``PreparedFwd.folds_cache_check``): the append's programs assert the
lengths and block ids they write by before they write, the attention's those they read by before
they read a key. Programs of good sequences may have written their new keys before another
program's assertion stops the append: inside the cache, and unobservable (a failed device
assertion leaves the CUDA context unusable).

``v_cache`` (and ``v``) may have a head dim of its own, headdim_v (the output has it too); a
``v_cache`` that is a view of ``k_cache[..., :headdim_v]`` (MLA's absorbed latent cache, keys
and values in one storage) is read in place, and the append then writes the new keys once.

A float8_e4m3fn cache (``tileattn.ops.fp8``) takes ``k_descale``/``v_descale`` (batch, nheads_k)
fp32: the real keys are the stored values times the descale. New ``k``, ``v`` then come in q's
dtype and are quantised with those scales as they are written (round to nearest, saturate to
+-448). Not with ``cache_leftpad``.

When batch x heads cannot fill the GPU the keys are split across thread blocks
(flash-decoding) and the partial (o, lse) states merged; ``num_splits=0`` picks the split
count, n > 0 forces it. No call synchronises the host with the device (the value checks on
CUDA tensors are asynchronous; see ``_validate``), so a decoding step can also be replayed
from a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.autograd.graph import increment_version

from ..contract import AttnParams
from . import _validate as V
from ._custom import attention, prepare
from ._memo import Memo, signature
from .backend import backend_for
from .fp8 import quantize
from .rotary import apply_rotary

__all__ = ["flash_attn_with_kvcache", "append_to_cache"]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            learnable_sink=None, k_descale=None, v_descale=None):
    """Attention of q (batch, seqlen_q, nheads, headdim) over a (contiguous or paged) KV cache.

    ``learnable_sink`` fp32 (nheads,): a sink logit per query head (see ``flash_attn_func``);
    with split keys it enters each row once, in the merge of the splits.

    Returns out (batch, seqlen_q, nheads, headdim), or ``(out, softmax_lse)`` with lse
    (batch, nheads, seqlen_q) fp32 when ``return_softmax_lse``. ``k_descale``/``v_descale``
    (batch, nheads_k) fp32 go with a float8_e4m3fn cache (module docstring).
    """
    # Every check first: nothing is rotated or written before all arguments passed. The checks
    # of metadata run once per signature (``_memo``); those that read values run on every call.
    key = signature((q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table, alibi_slopes, learnable_sink, k_descale, v_descale),
                    (softmax_scale, causal, softcap, rotary_interleaved, num_splits, return_softmax_lse), window_size,
                    kv=(1, 2))
    plan = _CHECKED.get(key)
    if plan is not None and plan.direct:
        # A kept signature with a lane and nothing to derive per call (``_lane_for``): its tensors'
        # metadata passed the checks before, so the values' check, the append and the attention
        # launch are all that is left to do. Where the launches' kernels check the values themselves
        # (``plan.fold``), they take the device check's place: one launch fewer.
        q = V.last_dim_contiguous(q)
        folded = V.check_cache_values(cache_seqlens, plan.new_tokens, plan.capacity, block_table, k_cache.shape[1],
                                      k_cache.shape[0], rotary_len=plan.rotary_len, rotary_reach=plan.rotary_reach,
                                      kept=plan, folded=plan.fold)
        seqused_k = cache_seqlens
        if k is not None:
            q, seqused_k = plan.appender.step(k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos,
                                              rotary_sin, q, folded)
            increment_version(k_cache)  # written through data pointers: as ``_append`` tells autograd
            increment_version(v_cache)
        if folded:
            out, lse = plan.lane(q, k_cache, v_cache, None, None, seqused_k, block_table, None, None,
                                 check_cache=True)
        else:
            out, lse = plan.lane(q, k_cache, v_cache, None, None, seqused_k, block_table, None, None)
        return (out, lse) if return_softmax_lse else out
    q_in = q
    if plan is None:
        plan = _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                      softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                      return_softmax_lse, k_descale, v_descale)
        _CHECKED.put(key, plan)
        plan.lane = None if key is not None else False  # only a kept signature's calls take a lane
    batch, paged, params = q.shape[0], block_table is not None, plan.params
    k_descale, v_descale = V.check_descales(k_cache, q, k_descale, v_descale, batch, v_cache=v_cache)
    if cache_batch_idx is not None:
        # Row cache_batch_idx[b] of a contiguous cache is a one-page block table with pages of
        # seqlen_cache keys: the paged path reads (and appends to) it in place, no copy.
        block_table = cache_batch_idx.view(batch, 1)
    capacity = plan.capacity
    cache_seqlens = V.cache_lengths(cache_seqlens, batch, capacity, paged, q.device)
    alibi = V.check_alibi(alibi_slopes, batch, q.shape[2], q.device)
    sink = V.check_sink(learnable_sink, q, q.shape[2])
    V.check_cache_values(cache_seqlens, plan.new_tokens, capacity, block_table, k_cache.shape[1], k_cache.shape[0],
                         rotary_len=plan.rotary_len, rotary_reach=plan.rotary_reach,
                         table_name="block_table" if paged else "cache_batch_idx", leftpad=cache_leftpad,
                         kept=None if key is None else plan)

    seqused_k = cache_seqlens
    if k is not None:
        q, seqused_k = _append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                               rotary_interleaved, plan.per_token_q, k_descale, v_descale, plan.backend)
    q = V.last_dim_contiguous(q)
    if cache_leftpad is not None:
        out, lse = _attend_after_leftpad(q, k_cache, v_cache, plan, alibi, seqused_k, cache_leftpad, cache_batch_idx,
                                         sink, return_softmax_lse)
    else:
        if plan.lane:
            out, lse = plan.lane(q, k_cache, v_cache, alibi, sink, seqused_k, block_table, k_descale, v_descale)
        else:
            out, lse = attention(q, k_cache, v_cache, params, alibi_slopes=alibi, max_seqlen_q=q.shape[1],
                                 max_seqlen_k=capacity, seqused_k=seqused_k, block_table=block_table,
                                 num_splits=plan.num_splits, learnable_sink=sink, k_descale=k_descale,
                                 v_descale=v_descale, backend=plan.backend)
            if plan.lane is None:  # the signature's first call: its later calls' launch, decided once
                plan.lane = prepare(q, k_cache, v_cache, out, lse, params, alibi_slopes=alibi, max_seqlen_q=q.shape[1],
                                    max_seqlen_k=capacity, seqused_k=seqused_k, block_table=block_table,
                                    num_splits=plan.num_splits, learnable_sink=sink, k_descale=k_descale,
                                    backend=plan.backend) or False
                plan.fold = getattr(plan.lane, "folds_cache_check", False)
                plan.direct = _lane_for(plan, q_in, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                        block_table, rotary_interleaved, cache_batch_idx, cache_leftpad, alibi_slopes,
                                        learnable_sink, k_descale)
    return (out, lse) if return_softmax_lse else out


# The KV cache's value check folded into an appending lane's two launches (the append's ``CHECK``,
# the attention's ``CHECK_CACHE``) in place of a launch of its own before them, where the kernels
# assert (CUDA tensors). False: those lanes launch the separate check, then the append (an A/B).
FOLD_APPEND_CHECK = True


def _lane_for(plan: "_Checked", q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
              interleaved: bool, cache_batch_idx, cache_leftpad, alibi_slopes, learnable_sink, k_descale) -> bool:
    """Whether a signature's later calls take the lane at the top of ``flash_attn_with_kvcache``
    (arguments as the first call's, q before any rotation), with ``plan.appender`` and ``plan.fold``
    set for it: the rule, in one place. The lane needs the signature's prepared attention
    (``plan.lane``), a cache_seqlens tensor and no row index, left pad, ALiBi, sinks or descales
    (derived per call); an append needs the Triton backend's prepared append, a new token at least,
    v as wide as k, q rotated in the append's kernel (as many query tokens as new keys) and nothing
    to copy per call (unit last strides). ``plan.fold``: the attention's kernel checks what it reads
    (``PreparedFwd.folds_cache_check``) and, with an append, ``FOLD_APPEND_CHECK`` and the append's
    kernel checks what it writes (``AppendPlan.checking``): together the rule of
    ``_validate.check_cache_values``, rotary tables included (the append reads their rows, and only
    its tokens' positions)."""
    if (not plan.lane or cache_seqlens is None or cache_batch_idx is not None or cache_leftpad is not None
            or alibi_slopes is not None or learnable_sink is not None or k_descale is not None):
        return False
    if k is None:  # (rotary tables come with new keys only: check_rotary)
        return True
    prepare_append = getattr(plan.backend, "prepare_append", None)
    if (prepare_append is None or k.shape[1] == 0 or v.shape[-1] != k.shape[-1]
            or rotary_cos is not None and q.shape[1] != k.shape[1]
            or any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache))):
        return False
    rotated = rotary_cos is not None
    plan.appender = prepare_append(k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos=rotary_cos,
                                   rotary_sin=rotary_sin, interleaved=interleaved, q=q if rotated else None,
                                   q_per_token=plan.per_token_q, seqused_out=cache_seqlens)
    plan.fold = plan.fold and FOLD_APPEND_CHECK and plan.appender.checking is not None
    return True


@dataclasses.dataclass(slots=True)
class _Checked:
    """What ``_check`` worked out for one signature of ``flash_attn_with_kvcache``."""

    params: AttnParams
    num_splits: int
    capacity: int  # keys a sequence's cache holds
    new_tokens: int  # keys appended
    rotary_len: int | None  # positions in the rotary tables
    rotary_reach: int  # positions past cache_seqlens that get rotated
    per_token_q: bool  # causal or local: q rotated per token
    backend: object  # the module backend_for(q.device) returns
    lane: object = False  # the signature's prepared launch (``_custom.prepare``), None: not yet asked
    device_check: object = None  # the value check's launch, once made (``_validate.check_cache_values``)
    fold: bool = False  # the lane's kernels can check the cache's values themselves (``_lane_for``)
    direct: bool = False  # later calls take the lane at the top of flash_attn_with_kvcache (``_lane_for``)
    appender: object = None  # with an append, that lane's prepared append (``gpu.prepare_append``)
    pitch: int | None = None  # with cache_leftpad: the cache rows' token pitch (``check_leftpad``)


_CHECKED = Memo()


def _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
           softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, return_softmax_lse, k_descale,
           v_descale) -> _Checked:
    """Every check of ``flash_attn_with_kvcache``'s arguments that reads no tensor's values."""
    V.check_flags(rotary_interleaved=rotary_interleaved, return_softmax_lse=return_softmax_lse)
    V.check_qkv(q, k_cache, v_cache, packed=False, cache=True, headdim_v=True)
    batch = q.shape[0]
    V.check_descales(k_cache, q, k_descale, v_descale, batch, v_cache=v_cache)
    paged = block_table is not None
    if cache_batch_idx is not None:
        if paged:
            raise NotImplementedError("flash_attn_with_kvcache: cache_batch_idx with a paged cache (block_table); "
                                      "flash-attn refuses it too")
        V.check_int32_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
        block_table = cache_batch_idx.view(batch, 1)
    capacity = V.cache_capacity(k_cache, block_table, batch, q.device)
    pitch = None if cache_leftpad is None else check_leftpad(cache_leftpad, k_cache, v_cache, capacity, paged,
                                                             k_descale, batch, q.device)
    V.check_new_kv(k, v, k_cache, v_cache, batch, dtype=None if k_descale is None else q.dtype)
    new_tokens = 0 if k is None else k.shape[1]
    rotary_len = V.check_rotary(rotary_cos, rotary_sin, k, q.shape[-1], q.device)
    params = V.make_params(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, dropout_p=0.0)
    per_token_q = params.window_left >= 0 or params.window_right >= 0
    return _Checked(params, V.num_splits(num_splits), capacity, new_tokens, rotary_len,
                    max(new_tokens, q.shape[1] if per_token_q else 1), per_token_q, backend_for(q.device),
                    pitch=pitch)


def check_leftpad(cache_leftpad, k_cache, v_cache, capacity: int, paged: bool, k_descale, batch: int, device) -> int:
    """The checks of ``cache_leftpad`` that read no values; returns the token pitch its packed
    keys are read with (``as_tokens``)."""
    if paged:
        raise NotImplementedError("flash_attn_with_kvcache: cache_leftpad with a paged cache (block_table); "
                                  "flash-attn refuses it too")
    if k_descale is not None:
        raise NotImplementedError("flash_attn_with_kvcache: cache_leftpad with a float8_e4m3fn cache")
    V.check_int32_vector("cache_leftpad", cache_leftpad, batch, device)
    pitch = _token_pitch(k_cache, v_cache)
    if (k_cache.shape[0] - 1) * pitch + capacity >= 2**31:
        V.fail(ValueError, f"cache_leftpad needs the cache's tokens numbered below 2**31, got {k_cache.shape[0]} rows "
                           f"{pitch} tokens apart, of {capacity} slots each")
    return pitch


def _token_pitch(k_cache, v_cache) -> int:
    """How many tokens apart consecutive cache rows start in the packed keys of ``as_tokens``: the
    distance of the rows in slot strides when it is a whole number and the same in both caches
    (they are then read in place), else the slot count (they are flattened, copied if need be)."""
    rows, slots = k_cache.shape[:2]
    if rows > 1:
        pitches = {c.stride(0) // c.stride(1) if c.stride(1) > 0 and c.stride(0) % c.stride(1) == 0 else None
                   for c in (k_cache, v_cache)}
        pitch = pitches.pop()
        if not pitches and pitch is not None:
            return pitch
    return slots


def as_tokens(k_cache, v_cache, pitch: int):
    """The caches (rows, slots, nheads_k, headdim) as packed keys (tokens, nheads_k, headdim) in
    which slot j of row r is token r * pitch + j (``check_leftpad``'s pitch). Rows ``slots`` apart
    are flattened (copied if they are not); others are read in place, through views that keep the
    caches' head and feature strides (the tokens between a row's last slot and the next row's
    first are other memory of the cache, never read as keys)."""
    rows, slots = k_cache.shape[:2]
    if pitch == slots:
        return k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    tokens = (rows - 1) * pitch + slots
    return tuple(c.as_strided((tokens, *c.shape[2:]), (c.stride(1), *c.stride()[2:]), c.storage_offset())
                 for c in (k_cache, v_cache))


def leftpad_offsets(batch: int, seqlen_q: int, k_cache, pitch: int, leftpad, seqused_k, cache_batch_idx=None):
    """(cu_seqlens_q, cu_seqlens_k, seqused_k) int32 of the packed call that attends over cache slots
    leftpad[b] .. seqused_k[b] - 1 of each sequence b, its keys read from ``as_tokens``: sequence b's
    keys start at token r * pitch + leftpad[b], r = cache_batch_idx[b] (or b), and number
    seqused_k[b] - leftpad[b]; its seqlen_q queries are rows b * seqlen_q ... of q packed."""
    rows, cu_q = query_offsets(batch, seqlen_q, leftpad.device)
    return (cu_q, *key_offsets(rows, k_cache, pitch, leftpad, seqused_k, cache_batch_idx))


def query_offsets(batch: int, seqlen_q: int, device) -> tuple:
    """(rows, cu_seqlens_q) of ``leftpad_offsets``: rows 0 .. batch int32, the query offsets
    seqlen_q apart (what depends on the batch alone: a ``DecodePlan`` keeps it from step to step)."""
    rows = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return rows, rows * seqlen_q


def key_offsets(rows, k_cache, pitch: int, leftpad, seqused_k, cache_batch_idx=None) -> tuple:
    """(cu_seqlens_k, seqused_k) of ``leftpad_offsets``, ``rows`` from ``query_offsets``."""
    batch = rows.shape[0] - 1
    tokens = (k_cache.shape[0] - 1) * pitch + k_cache.shape[1]  # as_tokens' count
    cu_k = torch.empty(batch + 1, dtype=torch.int32, device=leftpad.device)
    # the starts r * pitch + leftpad (below 2**31: check_leftpad), then the token count (only the starts are read)
    torch.add(leftpad, rows[:-1] if cache_batch_idx is None else cache_batch_idx, alpha=pitch, out=cu_k[:batch])
    cu_k[batch:].fill_(tokens)
    return cu_k, seqused_k - leftpad


def unpack_lse(lse, batch: int, seqlen_q: int):
    """The packed call's lse (nheads, batch * seqlen_q) as (batch, nheads, seqlen_q), contiguous."""
    return lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1).contiguous()


def _attend_after_leftpad(q, k_cache, v_cache, plan: _Checked, alibi, seqused_k, leftpad, cache_batch_idx, sink,
                          need_lse: bool):
    """Attention over cache slots leftpad[b] .. seqused_k[b] - 1 of each sequence b; (out, lse), lse
    None unless ``need_lse``. The cache is read as packed keys (``as_tokens``, ``leftpad_offsets``),
    q is packed alike, seqlen_q rows per sequence, and the varlen kernel does the rest, with no
    copy of a cache whose rows are a whole number of slots apart (contiguous, or transformers'
    (batch, nheads_k, seqlen, headdim) transposed)."""
    batch, seqlen_q, nheads, headdim = q.shape
    k_tokens, v_tokens = as_tokens(k_cache, v_cache, plan.pitch)
    cu_q, cu_k, used = leftpad_offsets(batch, seqlen_q, k_cache, plan.pitch, leftpad, seqused_k, cache_batch_idx)
    out, lse = attention(q.reshape(batch * seqlen_q, nheads, headdim), k_tokens, v_tokens, plan.params,
                         alibi_slopes=alibi, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=seqlen_q,
                         max_seqlen_k=k_cache.shape[1], seqused_k=used, num_splits=plan.num_splits,
                         learnable_sink=sink, backend=plan.backend)
    return out.view(batch, seqlen_q, nheads, -1), unpack_lse(lse, batch, seqlen_q) if need_lse else None


def _append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cos, sin, interleaved: bool,
            per_token_q: bool, k_descale=None, v_descale=None, backend=None):
    """Write the new keys and values into the cache (rotated first when ``cos``/``sin`` are
    given, and q with them; quantised with the descales of an FP8 cache); returns q and the
    number of keys each sequence then has.

    The Triton backend does it in one kernel (``tileattn.gpu.append_kv``), which also writes the
    new lengths; the torch ops below do it elsewhere, under torch.compile, which traces them, and
    when v has a head dim of its own (the kernel moves one head dim; ``append_to_cache`` also
    writes MLA's latent once when v_cache is a view of k_cache).
    """
    append_kv = getattr(backend or backend_for(k.device), "append_kv", None)  # the Triton backend's
    if (append_kv is not None and not torch.compiler.is_compiling()
            and v.shape[-1] == k.shape[-1]):
        seqused = torch.empty(cache_seqlens.shape, dtype=cache_seqlens.dtype, device=cache_seqlens.device)
        fuse_q = cos is not None and q.shape[1] == k.shape[1]  # the kernel rotates query token i beside key i
        if cos is not None and not fuse_q:
            q, _ = _rotate(q, k[:, :0], cos, sin, cache_seqlens, interleaved, per_token_q)  # q alone
        q_rot = append_kv(
            k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos=cos, rotary_sin=sin,
            interleaved=interleaved, q=q if fuse_q else None, q_per_token=per_token_q, seqused_out=seqused,
            k_descale=k_descale, v_descale=v_descale)
        # the kernel wrote through data pointers: tell autograd, as torch's own in-place writes do (a
        # tensor saved for a backward that shares the cache's storage must fail that backward, not
        # silently give gradients of the overwritten values; the torch path below bumps them itself)
        increment_version(k_cache)
        increment_version(v_cache)
        return (q if q_rot is None else q_rot), seqused
    if cos is not None:
        q, k = _rotate(q, k, cos, sin, cache_seqlens, interleaved, per_token_q)
    append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
    return q, cache_seqlens + k.shape[1]


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


def append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table=None, k_descale=None,
                    v_descale=None) -> None:
    """Write k, v (batch, seqlen_new, nheads_k, headdim) into the cache at cache_seqlens, in place.

    On the device: index_put with the positions computed there (no host synchronisation),
    contiguous or paged. CPU tensors of a small batch are copied slice by slice instead,
    which skips advanced indexing's per-call cost (reading their lengths costs nothing). When
    v_cache is a view of k_cache[..., :headdim_v] and v of k[..., :headdim_v] (MLA's latent: the
    values are the keys' first entries), the keys' write already holds the values: one write.
    With descales (an FP8 cache) the values are quantised first (``tileattn.ops.fp8.quantize``).
    """
    if k_descale is not None:
        k, v = quantize(k, k_descale), quantize(v, v_descale)
    batch, seqlen_new = k.shape[0], k.shape[1]
    compiling = torch.compiler.is_compiling()  # traced: no data pointers, no host reads of the lengths
    if not compiling and _is_prefix_view(v_cache, k_cache) and _is_prefix_view(v, k):
        v_cache = v = None  # (traced, v is written too: the same values, over the keys' first entries)
    if k.device.type == "cpu" and batch <= _HOST_APPEND_MAX_BATCH and not compiling:
        _append_on_host(k_cache, v_cache, k, v, cache_seqlens.tolist(),
                        None if block_table is None else block_table.tolist())
        return
    pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)  # (batch, seqlen_new)
    if block_table is None:
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, seqlen_new)
        k_cache[rows, pos] = k
        if v is not None:
            v_cache[rows, pos] = v
    else:
        block_size = k_cache.shape[1]
        blocks = block_table.long().gather(1, pos // block_size)
        slots = pos % block_size
        k_cache[blocks, slots] = k
        if v is not None:
            v_cache[blocks, slots] = v


_HOST_APPEND_MAX_BATCH = 16


def _is_prefix_view(part: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``part`` is ``whole[..., :n]`` in memory (same start and strides, fewer last-dim entries)."""
    return (part.data_ptr() == whole.data_ptr() and part.shape[:-1] == whole.shape[:-1]
            and part.stride() == whole.stride() and part.shape[-1] <= whole.shape[-1])


def _append_on_host(k_cache, v_cache, k, v, lengths: list[int], table: list[list[int]] | None) -> None:
    """``append_to_cache`` as slice copies: a sequence's new tokens go page by page (a contiguous
    cache row is one page of seqlen_cache slots)."""
    page = k_cache.shape[1]
    if table is None and lengths and lengths.count(lengths[0]) == len(lengths):  # one slice of every row
        start, n = lengths[0], k.shape[1]
        k_cache[:, start:start + n].copy_(k)
        if v is not None:
            v_cache[:, start:start + n].copy_(v)
        return
    for b, start in enumerate(lengths):
        j = 0
        while j < k.shape[1]:
            pos = start + j
            row = b if table is None else table[b][pos // page]
            n = min(page - pos % page, k.shape[1] - j)
            k_cache[row, pos % page:pos % page + n] = k[b, j:j + n]
            if v is not None:
                v_cache[row, pos % page:pos % page + n] = v[b, j:j + n]
            j += n
