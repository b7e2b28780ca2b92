"""The FlashAttention backward pass as Triton jit code (launched by ``tileattn.gpu.backward``).

With the scores recomputed from q, k and the saved LSE (natural log), per (sequence, head):

    P  = exp(S - lse) = exp2(S2 - lse2)          S2 = log2(e) S, lse2 = log2(e) lse
    Z  = keep / (1 - p)  (dropout)  or 1
    dV = (P Z)^T dO                             delta = rowsum(dO * O) - dlse
    dP = (dO V^T) Z                             dS = P (dP - delta)
    softcap: dS *= 1 - tanh^2(scale q.k / cap)
    dQ = scale dS K                             dK = scale dS^T Q

``dlse`` is the gradient reaching the returned LSE (d lse / d S = P, so dS gains P dlse). With
learnable sinks the saved lse includes the sink, so P above is already the sink-normalised
softmax and only d sink is new: dsink_h = -sum over rows of exp(sink_h - lse) delta, whose
per-row terms the preprocess writes (the launcher sums them).

Three programs, none of which writes where another writes (no atomics, so the gradients are
bitwise reproducible):

* ``_attn_bwd_preprocess``: delta and lse2 (+inf for a row that sees no key, so its P is 0),
  and with sinks each row's term of d sink;
* ``_attn_bwd_dkdv_kernel``: one key block of one key/value head; it walks the query blocks
  of every query head of its group (GQA sums stay in registers, in a fixed order);
* ``_attn_bwd_dq_kernel``: one query block of one query head; it walks the key blocks.

Each walk is cut in three ranges: blocks that straddle the lower mask bound, blocks that need
no mask at all, blocks that straddle the upper bound; blocks that nothing sees are skipped.
Rows past the end of a sequence load as zeros with lse2 = +inf (so P = 0 there) and keys past
the end only matter to dQ, whose last blocks mask them. ``DOT_DTYPE`` is the matmul operand
dtype (the inputs' own, except bf16 under Triton's interpreter: fp32 holding bf16-rounded values).
``HEAD_DIM_V`` is v's head dim (and dO's, O's, dv's), which may differ from q/k's ``HEAD_DIM`` (MLA).
"""

import triton
import triton.language as tl

from .common import LOG2E, dropout_keep, scores_log2, sequence_bounds, tanh



@triton.jit
def _attn_bwd_preprocess(o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, cu_seqlens_q_ptr,
                         dlse_ptr, sink_ptr, sink_term_ptr,
                         stride_ob, stride_om, stride_oh,
                         stride_dob, stride_dom, stride_doh,
                         stride_lb, stride_lh, stride_lm,
                         stride_dlb, stride_dlh, stride_dlm,
                         stride_wb, stride_wh,
                         seqlen_q,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                         IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr = False, HAS_SINK: tl.constexpr = False):
    """delta = rowsum(dO * O) - dlse in fp32, lse2 = log2(e) lse (+inf where lse = -inf) and,
    with sinks, the row's term exp(sink_h - lse) delta of -dsink_h."""
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start = tl.full([], 0, tl.int32)
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q_ptr + b)
        seqlen_q = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if start_m >= seqlen_q:
        return
    rows = q_start.to(tl.int64) + start_m
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    mask_m = start_m + offs_m < seqlen_q
    mask = mask_m[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, HEAD_DIM_PAD]
    o_base = o_ptr + b * stride_ob + h * stride_oh + rows * stride_om
    do_base = do_ptr + b * stride_dob + h * stride_doh + rows * stride_dom
    b_o = tl.load(o_base + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0)
    b_do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=mask, other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), axis=1)  # [BLOCK_M]
    b_lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + (rows + offs_m) * stride_lm, mask=mask_m)
    b_lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)  # [BLOCK_M]
    if HAS_DLSE:  # a row that sees nothing has P = 0: its dlse reaches nothing
        b_dlse = tl.load(dlse_ptr + b * stride_dlb + h * stride_dlh + (rows + offs_m) * stride_dlm, mask=mask_m,
                         other=0.0)
        b_delta -= tl.where(b_lse == float("-inf"), 0.0, b_dlse)
    w_off = b * stride_wb + h * stride_wh + rows + offs_m
    if HAS_SINK:
        b_term = tl.math.exp2(tl.load(sink_ptr + h) * LOG2E - b_lse2) * b_delta  # [BLOCK_M]
        tl.store(sink_term_ptr + w_off, b_term, mask=mask_m)
    tl.store(delta_ptr + w_off, b_delta, mask=mask_m)
    tl.store(lse2_ptr + w_off, b_lse2, mask=mask_m)


@triton.jit
def _probs(qk, q_pos, k_pos, seqlen_k, diag_off, sm_scale, softcap, slope_log2, window_left, window_right,
           lse2, HAS_SOFTCAP: tl.constexpr, PRECISE_TANH: tl.constexpr, HAS_ALIBI: tl.constexpr,
           MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_N: tl.constexpr):
    """P = exp2(S2 - lse2) from raw dot products, and t: with softcap tanh(scale q.k / cap),
    whose square the softcap's derivative needs; without, ``qk`` itself (the callers then ignore it).

    ``lse2`` must broadcast against ``qk``. The softcap is applied here, so ``scores_log2`` then
    only converts ``cap * t`` (natural units) to log2 units and adds ALiBi and the mask.
    """
    if HAS_SOFTCAP:
        t = tanh(qk * (sm_scale / softcap), PRECISE_TANH)
        s2 = scores_log2(t * softcap, q_pos, k_pos, seqlen_k, diag_off, LOG2E, softcap, slope_log2,
                         window_left, window_right, False, False, HAS_ALIBI, MASK_LEFT, MASK_RIGHT, MASK_N)
    else:
        t = qk
        s2 = scores_log2(qk, q_pos, k_pos, seqlen_k, diag_off, sm_scale * LOG2E, softcap, slope_log2,
                         window_left, window_right, False, False, HAS_ALIBI, MASK_LEFT, MASK_RIGHT, MASK_N)
    return tl.math.exp2(s2 - lse2), t


@triton.jit
def _dkdv_walk(dk, dv, b_k, b_v, q_base, do_base, lse2_base, delta_base, stride_qm, stride_dom,
               start_m, end_m, offs_n, seqlen_q, seqlen_k, diag_off, sm_scale, softcap, slope_log2,
               window_left, window_right, seed, bh, threshold, keep_scale, drop_r0, drop_c0,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
               BLOCK_M: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISE_TANH: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_DROPOUT: tl.constexpr,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the query blocks [start_m, end_m) of one query head to the key block's dk, dv.

    Works on the transposed tile (keys on axis 0) so no register transposes feed the dots.
    The masks of ``common`` are written for (query, key) tiles; calling them with the
    positions negated, (-key, -query), gives exactly the transposed mask and ALiBi distance:
    key - query - diag_off = (-query) - (-key + diag_off).
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # [HEAD_DIM_V_PAD]
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    start = start_m.to(tl.int64)
    qT_ptrs = q_base + start * stride_qm + (offs_m - start_m)[None, :] * stride_qm + offs_d[:, None]
    do_ptrs = do_base + start * stride_dom + (offs_m - start_m)[:, None] * stride_dom + offs_dv[None, :]
    for _ in range(start_m, end_m, BLOCK_M):
        mask_m = offs_m < seqlen_q
        b_qT = tl.load(qT_ptrs, mask=mask_d[:, None] & mask_m[None, :], other=0.0)  # [HEAD_DIM_PAD, BLOCK_M]
        b_do = tl.load(do_ptrs, mask=mask_m[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_V_PAD]
        in_dtype = b_qT.dtype
        b_qT = b_qT.to(DOT_DTYPE)
        b_do = b_do.to(DOT_DTYPE)
        b_lse2 = tl.load(lse2_base + offs_m, mask=mask_m, other=float("inf"))  # [BLOCK_M]
        b_delta = tl.load(delta_base + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        qkT = tl.dot(b_k, b_qT, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        pT, tT = _probs(qkT, -offs_n, -offs_m, seqlen_k, diag_off, sm_scale, softcap, slope_log2,
                        window_left, window_right, b_lse2[None, :],
                        HAS_SOFTCAP, PRECISE_TANH, HAS_ALIBI, MASK_LEFT, MASK_RIGHT, False)  # [BLOCK_N, BLOCK_M]
        dpT = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        if HAS_DROPOUT:
            keep = tl.trans(dropout_keep(seed, bh, offs_m + drop_r0, offs_n + drop_c0,
                                         threshold))  # [BLOCK_N, BLOCK_M]
            zT = tl.where(keep, keep_scale, 0.0)
            dv += tl.dot((pT * zT).to(in_dtype).to(DOT_DTYPE), b_do, input_precision=DOT_PRECISION)
            dpT = dpT * zT
        else:
            dv += tl.dot(pT.to(in_dtype).to(DOT_DTYPE), b_do, input_precision=DOT_PRECISION)  # [BLOCK_N, HEAD_DIM_V_PAD]
        dsT = pT * (dpT - b_delta[None, :])  # [BLOCK_N, BLOCK_M]
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        dk += tl.dot(dsT.to(in_dtype).to(DOT_DTYPE), tl.trans(b_qT), input_precision=DOT_PRECISION)  # [BLOCK_N, HEAD_DIM_PAD]
        offs_m += BLOCK_M
        qT_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit(do_not_specialize=["seed", "threshold", "diag_shift", "drop_bh0", "drop_bh_stride", "drop_r0", "drop_c0"])
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse2_ptr, delta_ptr,
                          cu_seqlens_q_ptr, cu_seqlens_k_ptr, alibi_ptr,
                          stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                          stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                          stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                          stride_wb, stride_wh, stride_ab, stride_ah,
                          seqlen_q, seqlen_k, sm_scale, softcap, window_left, window_right, diag_shift,
                          drop_bh0, drop_bh_stride, drop_r0, drop_c0,
                          seed, threshold, keep_scale,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                          HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          IS_VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISE_TANH: tl.constexpr,
                          HAS_ALIBI: tl.constexpr,
                          HAS_DROPOUT: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                          DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK, dV of keys [start_n, start_n + BLOCK_N) of key/value head ``hk`` of sequence ``b``."""
    start_n = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(cu_seqlens_q_ptr, cu_seqlens_k_ptr, b, seqlen_q,
                                                           seqlen_k, IS_VARLEN)
    if start_n >= seqlen_k:
        return
    diag_off = seqlen_k - seqlen_q + diag_shift
    q_rows = q_start.to(tl.int64)
    k_rows = k_start.to(tl.int64) + start_n
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # [HEAD_DIM_V_PAD]
    mask_kv = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_N, HEAD_DIM_PAD]
    mask_v = (offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V)  # [BLOCK_N, HEAD_DIM_V_PAD]
    tile_n = tl.arange(0, BLOCK_N)[:, None]
    b_k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + k_rows * stride_kn + tile_n * stride_kn + offs_d[None, :],
                  mask=mask_kv, other=0.0).to(DOT_DTYPE)  # [BLOCK_N, HEAD_DIM_PAD]
    b_v = tl.load(v_ptr + b * stride_vb + hk * stride_vh + k_rows * stride_vn + tile_n * stride_vn + offs_dv[None, :],
                  mask=mask_v, other=0.0).to(DOT_DTYPE)  # [BLOCK_N, HEAD_DIM_V_PAD]

    # Query rows that see some key of this block: i >= start_n - diag_off - right and
    # i <= start_n + BLOCK_N - 1 - diag_off + left. Blocks [m_a, m_b) see every key unmasked.
    m_lo = tl.full([], 0, tl.int32)
    m_hi = seqlen_q
    m_a = 0
    m_b = seqlen_q + BLOCK_M
    if MASK_RIGHT:
        m_lo = tl.maximum(start_n - diag_off - window_right, 0) // BLOCK_M * BLOCK_M
        m_a = tl.maximum(start_n + BLOCK_N - 1 - diag_off - window_right, 0)
    if MASK_LEFT:
        m_hi = tl.minimum(start_n + BLOCK_N - diag_off + window_left, seqlen_q)
        m_b = tl.maximum(start_n - diag_off + window_left + 1, 0) // BLOCK_M * BLOCK_M
    m_end = tl.maximum(tl.cdiv(m_hi, BLOCK_M) * BLOCK_M, m_lo)
    m_a = tl.minimum(tl.maximum(tl.cdiv(m_a, BLOCK_M) * BLOCK_M, m_lo), m_end)
    m_b = tl.minimum(tl.maximum(m_b, m_a), m_end)

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], dtype=tl.float32)
    for g in range(GROUP):  # the query heads sharing this key/value head, in order
        h = hk * GROUP + g
        q_base = q_ptr + b * stride_qb + h * stride_qh + q_rows * stride_qm
        do_base = do_ptr + b * stride_dob + h * stride_doh + q_rows * stride_dom
        lse2_base = lse2_ptr + b * stride_wb + h * stride_wh + q_rows
        delta_base = delta_ptr + b * stride_wb + h * stride_wh + q_rows
        slope_log2 = 0.0
        if HAS_ALIBI:
            slope_log2 = tl.load(alibi_ptr + b * stride_ab + h * stride_ah) * LOG2E
        bh = b * drop_bh_stride + drop_bh0 + h  # dropout's (batch, head) counter
        dk, dv = _dkdv_walk(dk, dv, b_k, b_v, q_base, do_base, lse2_base, delta_base, stride_qm, stride_dom,
                            m_lo, m_a, offs_n, seqlen_q, seqlen_k, diag_off, sm_scale, softcap, slope_log2,
                            window_left, window_right, seed, bh, threshold, keep_scale, drop_r0, drop_c0,
                            HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_M, HAS_SOFTCAP, PRECISE_TANH,
                            HAS_ALIBI, HAS_DROPOUT,
                            MASK_LEFT, MASK_RIGHT, DOT_DTYPE, DOT_PRECISION)
        dk, dv = _dkdv_walk(dk, dv, b_k, b_v, q_base, do_base, lse2_base, delta_base, stride_qm, stride_dom,
                            m_a, m_b, offs_n, seqlen_q, seqlen_k, diag_off, sm_scale, softcap, slope_log2,
                            window_left, window_right, seed, bh, threshold, keep_scale, drop_r0, drop_c0,
                            HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_M, HAS_SOFTCAP, PRECISE_TANH,
                            HAS_ALIBI, HAS_DROPOUT,
                            False, False, DOT_DTYPE, DOT_PRECISION)
        dk, dv = _dkdv_walk(dk, dv, b_k, b_v, q_base, do_base, lse2_base, delta_base, stride_qm, stride_dom,
                            m_b, m_end, offs_n, seqlen_q, seqlen_k, diag_off, sm_scale, softcap, slope_log2,
                            window_left, window_right, seed, bh, threshold, keep_scale, drop_r0, drop_c0,
                            HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_M, HAS_SOFTCAP, PRECISE_TANH,
                            HAS_ALIBI, HAS_DROPOUT,
                            MASK_LEFT, MASK_RIGHT, DOT_DTYPE, DOT_PRECISION)
    dk = dk * sm_scale
    tl.store(dk_ptr + b * stride_dkb + hk * stride_dkh + k_rows * stride_dkn + tile_n * stride_dkn + offs_d[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=mask_kv)
    tl.store(dv_ptr + b * stride_dvb + hk * stride_dvh + k_rows * stride_dvn + tile_n * stride_dvn + offs_dv[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _dq_walk(dq, b_q, b_do, b_lse2, b_delta, k_base, v_base, stride_kn, stride_vn,
             start_n, end_n, offs_m, seqlen_k, diag_off, sm_scale, softcap, slope_log2,
             window_left, window_right, seed, bh, threshold, keep_scale, drop_r0, drop_c0,
             HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
             BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISE_TANH: tl.constexpr, HAS_ALIBI: tl.constexpr,
             HAS_DROPOUT: tl.constexpr,
             MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_N: tl.constexpr,
             DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the key blocks [start_n, end_n) to the query block's dq (before the final scale)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # [HEAD_DIM_V_PAD]
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    start = start_n.to(tl.int64)
    tile_n = (offs_n - start_n)[None, :]
    kT_ptrs = k_base + start * stride_kn + tile_n * stride_kn + offs_d[:, None]  # [HEAD_DIM_PAD, BLOCK_N]
    vT_ptrs = v_base + start * stride_vn + tile_n * stride_vn + offs_dv[:, None]  # [HEAD_DIM_V_PAD, BLOCK_N]
    for _ in range(start_n, end_n, BLOCK_N):
        if MASK_N:
            mask = mask_d[:, None] & (offs_n[None, :] < seqlen_k)  # [HEAD_DIM_PAD, BLOCK_N]
            mask_v = mask_dv[:, None] & (offs_n[None, :] < seqlen_k)  # [HEAD_DIM_V_PAD, BLOCK_N]
        else:
            mask = mask_d[:, None]  # [HEAD_DIM_PAD, 1], broadcast by the loads
            mask_v = mask_dv[:, None]  # [HEAD_DIM_V_PAD, 1]
        b_kT = tl.load(kT_ptrs, mask=mask, other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        b_vT = tl.load(vT_ptrs, mask=mask_v, other=0.0).to(DOT_DTYPE)  # [HEAD_DIM_V_PAD, BLOCK_N]
        in_dtype = b_kT.dtype
        b_kT = b_kT.to(DOT_DTYPE)
        qk = tl.dot(b_q, b_kT, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        p, t = _probs(qk, offs_m, offs_n, seqlen_k, diag_off, sm_scale, softcap, slope_log2,
                      window_left, window_right, b_lse2[:, None],
                      HAS_SOFTCAP, PRECISE_TANH, HAS_ALIBI, MASK_LEFT, MASK_RIGHT, MASK_N)  # [BLOCK_M, BLOCK_N]
        dp = tl.dot(b_do, b_vT, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            keep = dropout_keep(seed, bh, offs_m + drop_r0, offs_n + drop_c0, threshold)  # [BLOCK_M, BLOCK_N]
            dp = dp * tl.where(keep, keep_scale, 0.0)
        ds = p * (dp - b_delta[:, None])  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(in_dtype).to(DOT_DTYPE), tl.trans(b_kT), input_precision=DOT_PRECISION)  # [BLOCK_M, HEAD_DIM_PAD]
        offs_n += BLOCK_N
        kT_ptrs += BLOCK_N * stride_kn
        vT_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=["seed", "threshold", "diag_shift", "drop_bh0", "drop_bh_stride", "drop_r0", "drop_c0"])
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse2_ptr, delta_ptr,
                        cu_seqlens_q_ptr, cu_seqlens_k_ptr, alibi_ptr,
                        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                        stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
                        stride_dqb, stride_dqm, stride_dqh, stride_wb, stride_wh, stride_ab, stride_ah,
                        seqlen_q, seqlen_k, sm_scale, softcap, window_left, window_right, diag_shift,
                        drop_bh0, drop_bh_stride, drop_r0, drop_c0,
                        seed, threshold, keep_scale,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                        HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        IS_VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISE_TANH: tl.constexpr,
                        HAS_ALIBI: tl.constexpr,
                        HAS_DROPOUT: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ of query rows [start_m, start_m + BLOCK_M) of query head ``h`` of sequence ``b``."""
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(cu_seqlens_q_ptr, cu_seqlens_k_ptr, b, seqlen_q,
                                                           seqlen_k, IS_VARLEN)
    if start_m >= seqlen_q:
        return
    diag_off = seqlen_k - seqlen_q + diag_shift
    hk = h // GROUP
    q_rows = q_start.to(tl.int64) + start_m
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    tile_m = tl.arange(0, BLOCK_M)[:, None]
    mask_m = offs_m < seqlen_q
    mask_q = mask_m[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, HEAD_DIM_PAD]
    b_q = tl.load(q_ptr + b * stride_qb + h * stride_qh + q_rows * stride_qm + tile_m * stride_qm + offs_d[None, :],
                  mask=mask_q, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM_PAD]
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # [HEAD_DIM_V_PAD]
    b_do = tl.load(do_ptr + b * stride_dob + h * stride_doh + q_rows * stride_dom + tile_m * stride_dom
                   + offs_dv[None, :], mask=mask_m[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
                   other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM_V_PAD]
    w_off = b * stride_wb + h * stride_wh + q_rows + tl.arange(0, BLOCK_M)
    b_lse2 = tl.load(lse2_ptr + w_off, mask=mask_m, other=float("inf"))  # [BLOCK_M]
    b_delta = tl.load(delta_ptr + w_off, mask=mask_m, other=0.0)  # [BLOCK_M]
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(alibi_ptr + b * stride_ab + h * stride_ah) * LOG2E
    bh = b * drop_bh_stride + drop_bh0 + h  # dropout's (batch, head) counter

    # Keys seen by some row of this block: j >= start_m + diag_off - left and
    # j <= start_m + BLOCK_M - 1 + diag_off + right. Blocks [n_a, n_b) need no mask.
    n_lo = tl.full([], 0, tl.int32)
    n_hi = seqlen_k
    n_a = 0
    n_b = seqlen_k
    if MASK_LEFT:
        n_lo = tl.maximum(start_m + diag_off - window_left, 0) // BLOCK_N * BLOCK_N
        n_a = tl.maximum(start_m + BLOCK_M - 1 + diag_off - window_left, 0)
    if MASK_RIGHT:
        n_hi = tl.minimum(start_m + BLOCK_M + diag_off + window_right, seqlen_k)
        n_b = tl.minimum(tl.maximum(start_m + diag_off + window_right + 1, 0), seqlen_k)
    n_end = tl.maximum(tl.cdiv(n_hi, BLOCK_N) * BLOCK_N, n_lo)
    n_a = tl.minimum(tl.maximum(tl.cdiv(n_a, BLOCK_N) * BLOCK_N, n_lo), n_end)
    n_b = tl.minimum(tl.maximum(n_b // BLOCK_N * BLOCK_N, n_a), n_end)

    k_base = k_ptr + b * stride_kb + hk * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = v_ptr + b * stride_vb + hk * stride_vh + k_start.to(tl.int64) * stride_vn
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    dq = _dq_walk(dq, b_q, b_do, b_lse2, b_delta, k_base, v_base, stride_kn, stride_vn, n_lo, n_a, offs_m,
                  seqlen_k, diag_off, sm_scale, softcap, slope_log2, window_left, window_right,
                  seed, bh, threshold, keep_scale, drop_r0, drop_c0, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_N,
                  HAS_SOFTCAP, PRECISE_TANH, HAS_ALIBI, HAS_DROPOUT, MASK_LEFT, MASK_RIGHT, True, DOT_DTYPE,
                  DOT_PRECISION)
    dq = _dq_walk(dq, b_q, b_do, b_lse2, b_delta, k_base, v_base, stride_kn, stride_vn, n_a, n_b, offs_m,
                  seqlen_k, diag_off, sm_scale, softcap, slope_log2, window_left, window_right,
                  seed, bh, threshold, keep_scale, drop_r0, drop_c0, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_N,
                  HAS_SOFTCAP, PRECISE_TANH, HAS_ALIBI, HAS_DROPOUT, False, False, False, DOT_DTYPE, DOT_PRECISION)
    dq = _dq_walk(dq, b_q, b_do, b_lse2, b_delta, k_base, v_base, stride_kn, stride_vn, n_b, n_end, offs_m,
                  seqlen_k, diag_off, sm_scale, softcap, slope_log2, window_left, window_right,
                  seed, bh, threshold, keep_scale, drop_r0, drop_c0, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_N,
                  HAS_SOFTCAP, PRECISE_TANH, HAS_ALIBI, HAS_DROPOUT, MASK_LEFT, MASK_RIGHT, True, DOT_DTYPE,
                  DOT_PRECISION)
    dq = dq * sm_scale
    tl.store(dq_ptr + b * stride_dqb + h * stride_dqh + q_rows * stride_dqm + tile_m * stride_dqm + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=mask_q)
