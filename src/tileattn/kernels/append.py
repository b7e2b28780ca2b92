"""Appending new keys and values to a KV cache, rotated first when asked: one launch per call.

For sequence ``b`` with ``cache_seqlens[b] = L`` and new token ``i`` (``0 <= i < seqlen_new``),
the key and value of every KV head go to cache position ``p = L + i``: row ``p`` of a contiguous
cache ``(batch, seqlen_cache, Hk, D)``, or slot ``p % PAGE_SIZE`` of page
``block_table[b, p // PAGE_SIZE]`` of a paged pool ``(num_blocks, PAGE_SIZE, Hk, D)``. Positions
past the cache's capacity are not written (the ops layer rejects them before any launch).

With ``ROTARY_HALF > 0`` (rotary_dim / 2) the new key is rotated at its position first and, with
``ROTATE_Q``, the query token too (at ``p``, or at ``L`` for every token unless ``Q_PER_TOKEN``),
into ``QOut``. The first ``2 * ROTARY_HALF`` features are rotated pairwise by the angles of row
``p`` of ``Cos``/``Sin``::

    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)     (fp32, stored in x's dtype)

pairing features (2j, 2j + 1) when ``INTERLEAVED`` (GPT-J) and (j, j + ROTARY_HALF) otherwise
(GPT-NeoX), as ``tileattn.ops.rotary.apply_rotary`` does. With ``WRITE_SEQUSED`` the program of
token 0 also writes ``L + seqlen_new`` (the keys attention then sees) to ``SequsedOut[b]``.
With ``IS_FP8`` the cache is float8_e4m3fn and the (rotated) key and the value are stored as
``clamp(x / descale[b, h], -448, 448)`` rounded to nearest, descales ``KDescale``/``VDescale``
contiguous (batch, Hk) fp32 (``tileattn.ops.fp8.quantize``).

``CHECK`` (compiled with Triton's ``debug`` option and ``sanitize_overflow`` off, so its assertion
is the only one) folds the KV cache's value check (``checks.py``) into the append, as far as it
writes: before any load through a cache value, each program checks its sequence's length within
0..``check_top`` (the capacity, and the rotary tables' rows when rotating, less ``seqlen_new``)
and, paged, the block-table entry of the page it writes within 0..``num_blocks - 1``, and asserts
it with the check kernel's message (``tl.device_assert``). A program that finds a bad value writes
nothing to the cache or to ``QOut`` and reads no rotary row, even if the assertion returned, and
its sequence's length after the append goes out as -1, which the attention launch after it
refuses in turn (its ``CHECK_CACHE``). The pages the append does not write are the attention's to
check (the ops layer launches it with its own check, ``tileattn.ops.kvcache``). Programs of good
sequences may have written their slots before another program's assertion stops the grid: those
writes stay inside the cache, and a failed device assertion leaves the CUDA context unusable, so
nothing can read them.
"""

import triton
import triton.language as tl

from .checks import ASSERT_MESSAGE, block_id_out_of_range, length_out_of_range


@triton.jit
def _rotated(src, offs_d, mask, cos_row, sin_row, stride_cos_d, stride_sin_d, row_ok,
             ROTARY_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The rows at ``src`` (``[BLOCK_H, 1]`` pointers) loaded over ``offs_d`` and rotated by the
    angles at ``cos_row``/``sin_row`` (read where ``row_ok``); features past ``2 * ROTARY_HALF``
    come back unchanged."""
    x = tl.load(src + offs_d[None, :], mask=mask, other=0.0)  # [BLOCK_H, HEAD_DIM_PAD]
    rot = offs_d < 2 * ROTARY_HALF  # [HEAD_DIM_PAD]
    if INTERLEAVED:
        partner = offs_d ^ 1
        angle = offs_d // 2
        first = offs_d % 2 == 0
    else:
        first = offs_d < ROTARY_HALF
        partner = tl.where(first, offs_d + ROTARY_HALF, offs_d - ROTARY_HALF)
        angle = tl.where(first, offs_d, offs_d - ROTARY_HALF)
    x_p = tl.load(src + partner[None, :], mask=mask & rot[None, :], other=0.0)  # [BLOCK_H, HEAD_DIM_PAD]
    c = tl.load(cos_row + angle * stride_cos_d, mask=rot & row_ok, other=1.0).to(tl.float32)  # [HEAD_DIM_PAD]
    s = tl.load(sin_row + angle * stride_sin_d, mask=rot & row_ok, other=0.0).to(tl.float32)
    s = tl.where(first, -s, s)  # x1' = x1 c - x2 s,  x2' = x2 c + x1 s
    y = x.to(tl.float32) * c[None, :] + x_p.to(tl.float32) * s[None, :]
    return tl.where(rot[None, :], y, x.to(tl.float32)).to(x.dtype)


@triton.jit
def _quantized(x, Descale, idx, mask, IS_FP8: tl.constexpr):
    """x [BLOCK_H, HEAD_DIM_PAD] as it is stored: with ``IS_FP8`` divided by its head's descale
    ``Descale[idx]``, saturated to +-448 and rounded to e4m3's grid (3 mantissa bits, steps of
    2^-9 below 2^-6; to nearest, ties to even) in fp32, so the store's conversion is exact
    whatever rounding it uses (the interpreter's truncates); else x unchanged."""
    stored = x
    if IS_FP8:
        d = tl.load(Descale + idx, mask=mask, other=1.0)  # [BLOCK_H, 1]
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), d), -448.0, 448.0,
                     propagate_nan=tl.PropagateNan.ALL)  # [BLOCK_H, HEAD_DIM_PAD]; NaN stays NaN
        e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # y's exponent, at least -6
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): e4m3's spacing at y
        t = tl.abs(y) * ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # |y| / step, exact
        r = tl.math.floor(t + 0.5)
        r = tl.where((r - t == 0.5) & ((r.to(tl.int32) & 1) != 0), r - 1.0, r)  # a tie goes to the even step
        sign = tl.where(y.to(tl.int32, bitcast=True) < 0, -1.0, 1.0)  # y's sign, -0 included (-x is 0 - x)
        stored = r * step * sign
    return stored


@triton.jit(do_not_specialize=["seqlen_new", "check_top", "num_blocks"])
def _append_kv_kernel(
    KNew, VNew, KCache, VCache, CacheSeqlens, BlockTable, Cos, Sin, Q, QOut, SequsedOut, KDescale, VDescale,
    stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_tb, stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
    stride_qb, stride_qs, stride_qh, stride_qob, stride_qos, stride_qoh,
    seqlen_new, capacity, nheads_k, nheads, check_top, num_blocks,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_PAGED: tl.constexpr, ROTARY_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, ROTATE_Q: tl.constexpr,
    Q_PER_TOKEN: tl.constexpr, WRITE_SEQUSED: tl.constexpr, IS_FP8: tl.constexpr = False, CHECK: tl.constexpr = False,
):
    """Grid: axis 0 = (sequence b, new token i), axis 1 = blocks of ``BLOCK_H`` heads (KV heads,
    and query heads when ``ROTATE_Q``)."""
    pid = tl.program_id(0)
    b = pid // seqlen_new
    i = pid % seqlen_new
    b64 = b.to(tl.int64)
    start = tl.load(CacheSeqlens + b)
    pos = start + i  # this token's position in its sequence
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    d_ok = offs_d[None, :] < HEAD_DIM  # [1, HEAD_DIM_PAD]

    if CHECK:  # this program's values, before any load or store through them (module docstring)
        ok = length_out_of_range(start, check_top) == 0
    else:  # checked before the launch
        ok = pos < capacity
    if IS_PAGED:
        page = tl.load(BlockTable + b64 * stride_tb + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        if CHECK:
            ok = ok & (block_id_out_of_range(page, num_blocks) == 0)
        k_dst = KCache + page * stride_kcb + (pos % PAGE_SIZE).to(tl.int64) * stride_kcs
        v_dst = VCache + page * stride_vcb + (pos % PAGE_SIZE).to(tl.int64) * stride_vcs
    else:
        k_dst = KCache + b64 * stride_kcb + pos.to(tl.int64) * stride_kcs
        v_dst = VCache + b64 * stride_vcb + pos.to(tl.int64) * stride_vcs
    if CHECK:
        tl.device_assert(ok, ASSERT_MESSAGE)
        rows_ok = ok  # a bad program reads no rotary row and writes nothing
    else:
        rows_ok = True
    kv_mask = (offs_h[:, None] < nheads_k) & d_ok & ok  # [BLOCK_H, HEAD_DIM_PAD]
    k_src = KNew + b64 * stride_knb + i * stride_kns + offs_h[:, None].to(tl.int64) * stride_knh  # [BLOCK_H, 1]
    if ROTARY_HALF > 0:
        b_k = _rotated(k_src, offs_d, kv_mask, Cos + pos.to(tl.int64) * stride_cos_s, Sin + pos.to(tl.int64) * stride_sin_s,
                       stride_cos_d, stride_sin_d, rows_ok, ROTARY_HALF, INTERLEAVED)
    else:
        b_k = tl.load(k_src + offs_d[None, :], mask=kv_mask)  # [BLOCK_H, HEAD_DIM_PAD]
    h_ok = offs_h[:, None] < nheads_k  # [BLOCK_H, 1]
    descale_idx = b64 * nheads_k + offs_h[:, None]  # [BLOCK_H, 1] (b, KV head) of an FP8 cache's descales
    b_k = _quantized(b_k, KDescale, descale_idx, h_ok, IS_FP8)
    tl.store(k_dst + offs_h[:, None].to(tl.int64) * stride_kch + offs_d[None, :],
             b_k.to(KCache.dtype.element_ty), mask=kv_mask)
    v_src = VNew + b64 * stride_vnb + i * stride_vns + offs_h[:, None].to(tl.int64) * stride_vnh
    b_v = tl.load(v_src + offs_d[None, :], mask=kv_mask)  # [BLOCK_H, HEAD_DIM_PAD]
    b_v = _quantized(b_v, VDescale, descale_idx, h_ok, IS_FP8)
    tl.store(v_dst + offs_h[:, None].to(tl.int64) * stride_vch + offs_d[None, :],
             b_v.to(VCache.dtype.element_ty), mask=kv_mask)

    if ROTATE_Q:
        q_pos = pos if Q_PER_TOKEN else start
        q_mask = (offs_h[:, None] < nheads) & d_ok & rows_ok  # [BLOCK_H, HEAD_DIM_PAD]
        q_src = Q + b64 * stride_qb + i * stride_qs + offs_h[:, None].to(tl.int64) * stride_qh
        b_q = _rotated(q_src, offs_d, q_mask, Cos + q_pos.to(tl.int64) * stride_cos_s,
                       Sin + q_pos.to(tl.int64) * stride_sin_s, stride_cos_d, stride_sin_d, rows_ok, ROTARY_HALF,
                       INTERLEAVED)
        q_dst = QOut + b64 * stride_qob + i * stride_qos + offs_h[:, None].to(tl.int64) * stride_qoh
        tl.store(q_dst + offs_d[None, :], b_q, mask=q_mask)
    if WRITE_SEQUSED:
        if (i == 0) & (tl.program_id(1) == 0):
            if CHECK:  # a bad sequence: a length the attention's own check refuses
                tl.store(SequsedOut + b, tl.where(ok, start + seqlen_new, -1))
            else:
                tl.store(SequsedOut + b, start + seqlen_new)
