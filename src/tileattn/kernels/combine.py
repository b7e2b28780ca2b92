"""Merge the split-KV partial states ``(o_s, lse_s)`` of the forward kernel into ``(out, lse)``.

The splits cover disjoint key ranges, so (as ``tileattn.ops.merge``) per query row and head

    lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) o_s

computed online over blocks of splits with the largest lse_s so far subtracted (log2 units
inside), so each partial output is read once. Empty splits (lse_s = -inf) weigh 0; a row
whose every split is empty gives out 0 and lse -inf. With ``HAS_SINK`` the merge starts from
the sink's state (out 0, lse sink[head]): the sink enters each row once, not once per split.
With ``SKIP_MARKED`` a row whose split-0 lse holds the bits ``UNSPLIT_MARK`` is left alone: a
launch that did not split wrote its output directly (a mixed batch's long sequences).

``merge_row`` is that merge for one row; two kernels call it: ``_combine_kernel``, a launch of
its own (one program per row), and the forward kernel's last split program of each row block
(``MERGE_SPLITS`` in ``attn_fwd.py``), row after row. Both compute the same bits: ``merge_row``
fixes the order of every addition and every fused multiply-add (its docstring).
"""

import triton
import triton.language as tl

from .common import LOG2E, finish_rows, online_rescale

UNSPLIT_MARK = tl.constexpr(0x7FC0DEAD)  # a NaN's bits that no split writes (they write finite or -inf)


@triton.jit
def _add_split(m, l_sum, acc, o_row, lse_row, offs_d, d_ok, row_ok, split, stride_o_split, stride_l_split,
               num_splits):
    """The running state (m, l_sum, acc) with split ``split`` (none past ``num_splits``) merged in:
    the maximum raised if its lse does, the sum and output rescaled to it, then its weight and
    weighted output added, each product in an explicit fused multiply-add."""
    split = tl.full([1], 0, dtype=tl.int64) + split  # [1]
    ok = (split < num_splits) & row_ok
    lse_s = tl.load(lse_row + split * stride_l_split + tl.arange(0, 1), mask=ok, other=float("-inf"))  # [1]
    o_s = tl.load(o_row + split * stride_o_split + offs_d, mask=d_ok & ok, other=0.0)  # [HEAD_DIM_PAD]
    m_new = tl.maximum(m, lse_s * LOG2E)
    m_use, alpha = online_rescale(m, m_new, True)  # [1]; every split so far empty: weigh 0, not NaN
    w = tl.math.exp2(tl.fma(lse_s, LOG2E, -m_use))  # [1] the split's weight; 0 when empty
    return m_new, tl.fma(l_sum, alpha, w), tl.fma(o_s, w, acc * alpha)


@triton.jit
def merge_row(o_row, lse_row, out_row, lse_out, sinks, head, row_ok, stride_o_split, stride_l_split, num_splits,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr,
              UNROLL: tl.constexpr):
    """Merge one row's split partials into its output and lse, nothing read or written unless ``row_ok``.

    ``o_row`` / ``lse_row`` point at the row's split-0 partial output [HEAD_DIM] and lse (fp32),
    split s at ``+ s * stride_*_split``; ``out_row`` / ``lse_out`` at its output (any dtype) and lse;
    with ``HAS_SINK`` the merge starts from ``sinks[head]``'s state. The splits are merged online, one
    after the other: the running maximum, weight sum and weighted sum rescaled when a split raises
    the maximum. With ``UNROLL`` the loop runs ``BLOCK_S`` splits unrolled at a time (their loads in
    flight together: the combine kernel, a program per row); without, one split a turn (the
    forward's merge, whose registers the attention sized: unrolled there, ptxas spilled).

    The same bits whichever kernel calls it, unrolled or not: the additions run in split order,
    element by element, and every product that meets an addition does so in an explicit
    ``tl.fma``. A ``tl.sum`` over the splits adds in the order of the tensor's layout, which the
    compiler picks for the whole kernel, and leaves ``a * b + c`` to be contracted or not: with it the
    forward's merge and the combine kernel differed in 1-2 elements of 4096 (H200, by an fp32 ulp).
    """
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    one = tl.arange(0, 1)  # [1]
    d_ok = (offs_d < HEAD_DIM) & row_ok
    m = tl.full([1], float("-inf"), dtype=tl.float32)  # [1] largest lse so far, log2 units
    l_sum = tl.zeros([1], dtype=tl.float32)  # [1] sum of the splits' weights exp2(lse_s - m)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)  # [HEAD_DIM_PAD] weighted sum of the o_s
    if HAS_SINK:  # the sink's state, weight 1 at m = its lse, output 0
        m = tl.load(sinks + head + one, mask=row_ok, other=0.0) * LOG2E
        l_sum += 1.0
    if UNROLL:
        for s0 in range(0, num_splits, BLOCK_S):
            for s in tl.static_range(BLOCK_S):
                m, l_sum, acc = _add_split(m, l_sum, acc, o_row, lse_row, offs_d, d_ok, row_ok, s0 + s,
                                           stride_o_split, stride_l_split, num_splits)
    else:
        for s in tl.range(0, num_splits, num_stages=1):
            m, l_sum, acc = _add_split(m, l_sum, acc, o_row, lse_row, offs_d, d_ok, row_ok, s, stride_o_split,
                                       stride_l_split, num_splits)

    l_safe, lse = finish_rows(m, l_sum)  # [1]: every split empty gives out 0, lse -inf
    out = acc / l_safe  # [HEAD_DIM_PAD]
    tl.store(out_row + offs_d, out.to(out_row.dtype.element_ty), mask=d_ok)
    tl.store(lse_out + one, lse, mask=row_ok)


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
    lse_ptr = LsePart + b * stride_pl_b + head * stride_pl_h + pos * stride_pl_s
    if SKIP_MARKED:
        if tl.load(lse_ptr).to(tl.int32, bitcast=True) == UNSPLIT_MARK:
            return
    merge_row(OPart + b * stride_po_b + pos * stride_po_s + head * stride_po_h, lse_ptr,
              Out + b * stride_ob + pos * stride_os + head * stride_oh, Lse + b * stride_lb + head * stride_lh
              + pos * stride_ls, Sinks, head, True, stride_po_split, stride_pl_split, num_splits, HEAD_DIM,
              HEAD_DIM_PAD, BLOCK_S, HAS_SINK, True)
