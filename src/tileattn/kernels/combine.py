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
(``MERGE_SPLITS`` in ``attn_fwd.py``), row after row with the same ``BLOCK_S`` and warps. The two
forms agree to rounding, not bit for bit: ``tl.sum`` adds the splits in the order of its operand's
layout and ``a * b + c`` may be contracted to an fma, both chosen by the compiler for the whole
kernel, and on the H200 1-2 elements of 4096 differed by an fp32 ulp before the outputs' rounding.
A merge that fixed the order (the splits one after another, explicit fmas) gave equal bits but cost
2-8 µs per graph-replayed batch-1 step (ptxas kept 32 registers for 64 splits a block: the
unrolled loads were not in flight together; docs/perf-notes.md).
"""

import triton
import triton.language as tl

from .common import LOG2E, finish_rows, online_rescale

UNSPLIT_MARK = tl.constexpr(0x7FC0DEAD)  # a NaN's bits that no split writes (they write finite or -inf)


@triton.jit
def merge_row(o_row, lse_row, out_row, lse_out, sinks, head, row_ok, stride_o_split, stride_l_split, num_splits,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr):
    """Merge one row's split partials into its output and lse, nothing read or written unless ``row_ok``.

    ``o_row`` / ``lse_row`` point at the row's split-0 partial output [HEAD_DIM] and lse (fp32),
    split s at ``+ s * stride_*_split``; ``out_row`` / ``lse_out`` at its output (any dtype) and lse;
    with ``HAS_SINK`` the merge starts from ``sinks[head]``'s state. Splits are read ``BLOCK_S`` at a
    time, their lse and outputs together (one round trip to memory per block), and merged online:
    the running maximum, weight sum and weighted sum are rescaled when a block raises the maximum.
    """
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    one = tl.arange(0, 1)  # [1]
    m = tl.full([1], float("-inf"), dtype=tl.float32)  # [1] largest lse so far, log2 units
    l_sum = tl.zeros([1], dtype=tl.float32)  # [1] sum of the splits' weights exp2(lse_s - m)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)  # [HEAD_DIM_PAD] weighted sum of the o_s
    if HAS_SINK:  # the sink's state, weight 1 at m = its lse, output 0
        m = tl.load(sinks + head + one, mask=row_ok, other=0.0) * LOG2E
        l_sum += 1.0
    for s0 in range(0, num_splits, BLOCK_S):
        split = s0 + offs_s
        ok = (split < num_splits) & row_ok  # [BLOCK_S]
        lse_s = tl.load(lse_row + split.to(tl.int64) * stride_l_split, mask=ok, other=float("-inf")) * LOG2E
        o_mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        o_s = tl.load(o_row + split.to(tl.int64)[:, None] * stride_o_split + offs_d[None, :], mask=o_mask,
                      other=0.0)  # [BLOCK_S, HEAD_DIM_PAD]
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        m_use, alpha = online_rescale(m, m_new, True)  # [1]; every split so far empty: weigh 0, not NaN
        w = tl.math.exp2(lse_s - m_use)  # [BLOCK_S] weight of each split; 0 when empty
        l_sum = l_sum * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o_s, 0)
        m = m_new

    l_safe, lse = finish_rows(m, l_sum)  # [1]: every split empty gives out 0, lse -inf
    out = acc / l_safe  # [HEAD_DIM_PAD]
    tl.store(out_row + offs_d, out.to(out_row.dtype.element_ty), mask=(offs_d < HEAD_DIM) & row_ok)
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
              HEAD_DIM_PAD, BLOCK_S, HAS_SINK)
