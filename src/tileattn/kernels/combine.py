"""Merge the split-KV partial states ``(o_s, lse_s)`` of the forward kernel into ``(out, lse)``.

The splits cover disjoint key ranges, so (as ``tileattn.ops.merge``) per query row and head

    lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) o_s

computed online over blocks of splits with the largest lse_s so far subtracted (log2 units
inside), so each partial output is read once. Empty splits (lse_s = -inf) weigh 0; a row
whose every split is empty gives out 0 and lse -inf. With a sink the merge starts from the
sink's state (out 0, lse sink[head]): the sink enters each row once, not once per split.

``merge_splits`` is that merge for a block of rows; two kernels call it: ``_combine_kernel``, a
launch of its own (one program per row), and the forward kernel's last split program of each
row block (``MERGE_SPLITS`` in ``attn_fwd.py``). With ``SKIP_MARKED`` the combine leaves alone a
row whose split-0 lse holds the bits ``UNSPLIT_MARK``: a launch that did not split wrote its
output directly (a mixed batch's long sequences).
"""

import triton
import triton.language as tl

from .common import LN2, LOG2E, online_rescale

UNSPLIT_MARK = tl.constexpr(0x7FC0DEAD)  # a NaN's bits that no split writes (they write finite or -inf)


@triton.jit
def merge_splits(o_rows, lse_rows, row_ok, stride_o_split, stride_l_split, num_splits, m, l_sum,
                 ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_S: tl.constexpr):
    """The merged ``(out, lse)`` of ``ROWS`` rows: out [ROWS, HEAD_DIM_PAD] fp32, lse [ROWS] (natural log).

    ``o_rows`` / ``lse_rows`` [ROWS] point at each row's split-0 partial output and lse (fp32),
    split s at ``+ s * stride_*_split``; rows where ``row_ok`` is false are not read. ``m`` and
    ``l_sum`` [ROWS] are the state to start from, in log2 units: -inf and 0, or a sink's
    log2(e) sink and 1. Splits are read ``BLOCK_S`` at a time, their lse and outputs together
    (one round trip to memory per block), and merged online: the running maximum, weight sum
    and weighted sum are rescaled when a block raises the maximum.
    """
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)  # [ROWS, HEAD_DIM_PAD] weighted sum of the o_s
    for s0 in range(0, num_splits, BLOCK_S):
        split = (s0 + offs_s).to(tl.int64)  # [BLOCK_S]
        ok = row_ok[:, None] & (split[None, :] < num_splits)  # [ROWS, BLOCK_S]
        lse_s = tl.load(lse_rows[:, None] + split[None, :] * stride_l_split, mask=ok,
                        other=float("-inf")) * LOG2E  # [ROWS, BLOCK_S]
        o_ptrs = o_rows[:, None, None] + split[None, :, None] * stride_o_split + offs_d[None, None, :]
        o_mask = ok[:, :, None] & (offs_d[None, None, :] < HEAD_DIM)  # [ROWS, BLOCK_S, HEAD_DIM_PAD]
        o_s = tl.load(o_ptrs, mask=o_mask, other=0.0)  # [ROWS, BLOCK_S, HEAD_DIM_PAD]
        m_new = tl.maximum(m, tl.max(lse_s, 1))  # [ROWS]
        m_use, alpha = online_rescale(m, m_new, True)  # [ROWS]; every split so far empty: weigh 0, not NaN
        w = tl.math.exp2(lse_s - m_use[:, None])  # [ROWS, BLOCK_S] weight of each split; 0 when empty
        l_sum = l_sum * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 1)
        m = m_new

    empty = l_sum == 0.0  # [ROWS]
    l_safe = tl.where(empty, 1.0, l_sum)
    out = acc / l_safe[:, None]  # [ROWS, HEAD_DIM_PAD]
    lse = tl.where(empty, float("-inf"), (m + tl.math.log2(l_safe)) * LN2)  # [ROWS]
    return out, lse


@triton.jit(do_not_specialize=["seqlen_q", "num_splits"])
def _combine_kernel(
    OPart, LsePart, Out, Lse, Sinks,
    stride_po_split, stride_po_b, stride_po_s, stride_po_h,
    stride_pl_split, stride_pl_b, stride_pl_h, stride_pl_s,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    nheads, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr = False,
    SKIP_MARKED: tl.constexpr = False,
):
    """Grid: one program per row of the flattened (batch, query, head) axis.

    Partials are ``OPart`` (splits, B, Sq, H, D) and ``LsePart`` (splits, B, H, Sq), fp32;
    ``Out`` (B, Sq, H, D) and ``Lse`` (B, H, Sq) take any strides (varlen passes B = 1).
    """
    row = tl.program_id(0)
    head = (row % nheads).to(tl.int64)
    pos = ((row // nheads) % seqlen_q).to(tl.int64)
    b = (row // (nheads * seqlen_q)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    one = tl.arange(0, 1)  # [1]: the block of rows merge_splits reads is this one row
    lse_ptr = LsePart + b * stride_pl_b + head * stride_pl_h + pos * stride_pl_s
    if SKIP_MARKED:
        if tl.load(lse_ptr).to(tl.int32, bitcast=True) == UNSPLIT_MARK:
            return
    o_ptr = OPart + b * stride_po_b + pos * stride_po_s + head * stride_po_h

    m = tl.full([1], float("-inf"), dtype=tl.float32)  # [1] the state merged from: none
    l_sum = tl.zeros([1], dtype=tl.float32)
    if HAS_SINK:  # the sink's state, weight 1 at m = its lse, output 0
        m = tl.load(Sinks + head + one) * LOG2E
        l_sum += 1.0
    out, lse = merge_splits(o_ptr + one, lse_ptr + one, one == 0, stride_po_split, stride_pl_split, num_splits, m,
                            l_sum, 1, HEAD_DIM, HEAD_DIM_PAD, BLOCK_S)  # [1, HEAD_DIM_PAD], [1]
    o_dst = Out + b * stride_ob + pos * stride_os + head * stride_oh + offs_d[None, :]  # [1, HEAD_DIM_PAD]
    tl.store(o_dst, out.to(Out.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)
    tl.store(Lse + b * stride_lb + head * stride_lh + pos * stride_ls + one, lse)
