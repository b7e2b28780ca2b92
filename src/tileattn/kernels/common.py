"""Jit helpers shared by every attention kernel: score modifications, masks, dropout bits.

Scores are kept in log2 units inside the kernels (exp2 is the cheap instruction):
``s2 = log2(e) * s`` where ``s`` is the natural-unit score of tileattn.reference:

    s = scale * q.k;  softcap: s = cap * tanh(s / cap);  alibi: s -= slope * |i + off - j|;
    masked (outside the window, or past the sequence's keys): s = -inf.

``off = seqlen_k - seqlen_q`` aligns causal/window masks bottom-right. A window bound below
zero means unbounded; causal is the window (left, 0) and is normalised so by the ops layer.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a global jit code may read must be a tl.constexpr instance
LN2 = tl.constexpr(0.6931471805599453)  # (Gluon's constexpr is the same class: its kernels import these too)


@triton.jit
def online_rescale(m_old, m_new, GUARD: tl.constexpr):
    """The online-softmax rescale when the running maximum goes from ``m_old`` to ``m_new`` (log2 units).

    Returns ``(m_use, alpha)``: the maximum to subtract from the new scores and
    ``alpha = 2^(m_old - m_use)``, the factor for the running sum and output. With ``GUARD``,
    where ``m_new`` is still -inf (every key or state so far masked or empty) ``m_use`` is 0, so
    the new terms are 0 and alpha is 0 instead of 2^(-inf - -inf) = NaN. Without it (all
    scores known finite) the comparison is skipped.
    """
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    return m_use, tl.math.exp2(m_old - m_use)


@triton.jit
def finish_rows(m, l):
    """The end of the online softmax for rows of running maximum ``m`` (log2 units) and sum ``l``:
    ``(l_safe, lse)``, the divisor of the rows' outputs and their log-sum-exp in natural log. A row
    that saw no key (``l`` 0: every score masked, no sink) gets divisor 1, so its output stays 0, and
    lse -inf."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    return l_safe, tl.where(empty, float("-inf"), (m + tl.math.log2(l_safe)) * LN2)


@triton.jit
def tanh(x, PRECISE: tl.constexpr):
    """tanh(x) in fp32, in one of two forms (ops the interpreter has too); the softcap multiplies
    it by the cap, so the scores carry cap x its absolute error. The launchers pick the form per
    call (``gpu._tuning.softcap_form``).

    Cheap (``PRECISE`` False): ``2 sigmoid(2x) - 1``, ~3 ops. Absolute error up to 1.8e-7 over all
    x (float32 with a correctly rounded exp: numpy, the interpreter), near 0 too, where tanh is
    small: relative error unbounded there. On a GPU, whose exp (ex2.approx) and division
    (div.full) are 2-ulp approximations, up to ~4.5e-7 by the same count.

    Precise: below |x| = 1/4 its Taylor series to x^9 (the next term is under 1e-8 of tanh there),
    above it 1 - 2 / (exp(2|x|) + 1), whose subtraction loses at most two bits at 1/4: a few fp32
    ulps relative (4.5e-7 at most), absolute error under 1.3e-7 and ~x * 1e-7 near 0, so the
    scores' error scales with the scores, not with the cap. ~10 more FMAs and two selects.
    """
    if PRECISE:
        ax = tl.abs(x)
        x2 = x * x
        small = x + x * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                     + x2 * 0.021869488536155203)))
        big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)  # exp overflows to inf past |x| ~ 44: 1 exactly
        return tl.where(ax < 0.25, small, tl.where(x < 0, -big, big))
    else:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def visible_mask(q_pos, k_pos, seqlen_k, diag_off, window_left, window_right,
                 MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] booleans: query position q_pos[:, None] may see key k_pos[None, :]."""
    i = q_pos[:, None] + diag_off  # [BLOCK_M, 1] the query's position on the key axis
    j = k_pos[None, :]  # [1, BLOCK_N]
    rel = j - i  # [BLOCK_M, BLOCK_N] key position relative to the query's diagonal
    seen = rel == rel  # all true, to be narrowed by the active bounds
    if MASK_N:
        seen = seen & (j < seqlen_k)
    if MASK_RIGHT:
        seen = seen & (rel <= window_right)
    if MASK_LEFT:
        seen = seen & (rel >= -window_left)
    return seen


@triton.jit
def visible_in_tile(q_pos, cols, k_start, seqlen_k, diag_off, window_left, window_right,
                    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """``visible_mask``'s booleans with the ``seqlen_k`` bound, for the keys ``k_start + cols`` of one
    tile (``cols`` [BLOCK_N], the tile's columns 0 .. BLOCK_N - 1). With a right bound (causal, a
    window) it is computed another way: the right bound and the sequence's end become one limit per
    row on the tile's columns (the left bound another), so a score costs one compare against its row's
    limit instead of a subtraction and a compare per bound. The same integers compared in another
    order: the same booleans. Without one, the sequence's end is a compare per column, as there."""
    i = q_pos + diag_off  # [BLOCK_M] the key position of each query's diagonal
    if MASK_RIGHT:
        hi = tl.minimum(i + window_right, seqlen_k - 1) - k_start  # [BLOCK_M] the last column seen
        seen = cols[None, :] <= hi[:, None]  # [BLOCK_M, BLOCK_N]
        if MASK_LEFT:
            seen = seen & (cols[None, :] >= (i - window_left - k_start)[:, None])
    else:
        j = k_start + cols  # [BLOCK_N] the tile's key positions
        seen = j[None, :] < seqlen_k  # [1, BLOCK_N]: broadcast by its use
        if MASK_LEFT:
            seen = seen & (j[None, :] >= (i - window_left)[:, None])
    return seen


@triton.jit
def scores_log2(qk, q_pos, k_pos, seqlen_k, diag_off, scale_log2, softcap, slope_log2,
                window_left, window_right,
                HAS_SOFTCAP: tl.constexpr, PRECISE_TANH: tl.constexpr, HAS_ALIBI: tl.constexpr,
                MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_N: tl.constexpr):
    """From the raw dot products ``qk`` [BLOCK_M, BLOCK_N] (fp32) to masked scores in log2 units.

    With softcap, ``softcap`` is the cap and ``scale_log2`` is still ``scale * log2(e)``; its tanh
    takes the form ``PRECISE_TANH`` names (``tanh``).
    ``slope_log2`` is the ALiBi slope times log2(e) for this head.
    """
    if HAS_SOFTCAP:
        s = tanh(qk * (scale_log2 / (LOG2E * softcap)), PRECISE_TANH) * (softcap * LOG2E)
    else:
        s = qk * scale_log2
    if HAS_ALIBI:
        dist = tl.abs((q_pos[:, None] + diag_off) - k_pos[None, :]).to(tl.float32)
        s = s - slope_log2 * dist
    if MASK_LEFT or MASK_RIGHT or MASK_N:
        seen = visible_mask(q_pos, k_pos, seqlen_k, diag_off, window_left, window_right,
                            MASK_LEFT, MASK_RIGHT, MASK_N)
        s = tl.where(seen, s, float("-inf"))
    return s


@triton.jit
def sequence_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(q_start, k_start, seqlen_q, seqlen_k) of sequence ``b``: its first packed row and its
    lengths from cu_seqlens when IS_VARLEN, else row 0 and the lengths given."""
    q_start = tl.full([], 0, tl.int32)
    k_start = tl.full([], 0, tl.int32)
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + b)
        seqlen_q = tl.load(cu_seqlens_q + b + 1) - q_start
        k_start = tl.load(cu_seqlens_k + b)
        seqlen_k = tl.load(cu_seqlens_k + b + 1) - k_start
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def fmix32(h):
    """MurmurHash3's finaliser on uint32 (wrapping arithmetic); twin of tileattn.dropout_mask."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def dropout_keep(seed, bh, q_pos, k_pos, threshold):
    """[BLOCK_M, BLOCK_N] keep-mask, bit-identical to ``tileattn.dropout_mask.keep_mask``.

    ``seed`` and ``bh`` are integers (bh = batch index * nheads + query head, in the batch the
    call's elements belong to: ``AttnParams.dropout_offsets``), ``threshold`` is ``round(p * 2**24)``.
    """
    base = fmix32((seed.to(tl.uint32) + bh.to(tl.uint32) * 0x9E3779B9).to(tl.uint32))
    row = fmix32(base ^ q_pos.to(tl.uint32))  # [BLOCK_M]
    col = k_pos.to(tl.uint32) * 0x27D4EB2F  # [BLOCK_N]
    bits = fmix32(row[:, None] ^ col[None, :])  # [BLOCK_M, BLOCK_N]
    return (bits >> 8) >= threshold.to(tl.uint32)
