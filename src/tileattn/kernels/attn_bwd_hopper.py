"""The backward kernels for Hopper (sm_90), written in Gluon: TMA loads, asynchronous wgmma.

The math is the one of ``attn_bwd.py`` (the preprocess there computes delta and lse2 and runs
unchanged); this file replaces its dK/dV and dQ kernels. Both are one kernel, seen in a frame
of *rows* and *columns*:

* a program keeps ``2 x 64`` rows resident (two consumer warpgroups of 64 rows each), tiles
  A and B of the rows in shared memory, and streams column tiles C and D through a ring;
* per column tile: X = A C^T, Y = B D^T, P = exp2(scale log2(e) X - lse2), dS = P (Y - delta),
  acc1 += dS C, and for dK/dV also acc2 += P D.

    dQ   (DKDV=False): rows = queries, columns = keys.   A, B = Q, dO;  C, D = K, V;
                       X = S, Y = dP, acc1 = dQ (scaled at the end); lse2, delta per row.
    dKdV (DKDV=True):  rows = keys, columns = queries.   A, B = K, V;   C, D = Q, dO;
                       X = S^T, Y = dP^T, acc1 = dK (scaled), acc2 = dV; lse2, delta per
                       column; a key/value head walks the query heads of its GROUP in order.

The launcher hands the dK/dV problem over transposed: lengths swapped and the window's
(left, right) bounds and MASK flags swapped. Key j sees query i iff -left <= j - (i + sk - sq)
<= right, i.e. iff -right <= i - (j + sq - sk) <= left: the transposed problem is an attention
problem of its own, so the forward's ``_tile_range`` and ``visible_mask`` serve both kernels
unchanged (bottom-right aligned causal included).

Partitions (``gl.warp_specialize``): one producer warp issues the TMA copies (the rows' A, B
once, then C and D tile by tile into a ring of ``STAGES`` slots, each with ``c_full``/``d_full``
barriers and one ``empty`` barrier that both consumers arrive on); two consumer warpgroups each
own 64 rows and meet only at those barriers, so one's exponentials overlap the other's
matmuls. Inside a consumer, X and Y are issued together, P is computed while Y runs, and for
dK/dV the P D product runs while dS is computed.

dQ, two ways. ``DQ_REDUCE`` (dK/dV, the default past 1024 query rows): the dK/dV program also forms
each query tile's dQ share, dS K, and adds it to an fp32 workspace with bulk asynchronous
reductions from shared memory (``_reduce_add``), 5 matrix products per tile pair as in
FlashAttention 2/3; the order of the additions varies from run to run. Otherwise (short
sequences, or ``deterministic``) a launch of its own computes dQ per query block, recomputing S and dP (7
products in all): every gradient element is written once, by one program summing in a fixed
order, so the gradients are bitwise reproducible (docs/perf-notes.md has both measured).

Out-of-range rows and columns: descriptors are 4-D over (batch, seqlen, heads, dim), so a tile
past a dense sequence's end reads zeros; a packed sequence's last column tile reads the next
sequence's rows. In dQ (k and v) the consumers zero them in shared memory before their products
(the forward's ``_zero_rows_from``: masked columns have P = 0, but an inf in v would make
0 x inf = NaN in dP and dS K), so inf or NaN values of the next sequence stay out, as in the
forward. dK/dV's last tile (q, dO) and the dQ reductions' rows past the end (k) are read as they
are: NaN q or k in the next sequence (uninitialised padding) reach this one's dK or dQ through
0 x NaN. Zeroing those too (branch varlenzero2) cost 2-4 % of the packed backward on the H200
(docs/perf-notes.md), so it is left out. Columns past the end get
lse2 = +inf (P = 0, dK/dV) or are masked (dQ's last key tile, always in the masked range);
rows past the end are computed and not stored.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attn_fwd_hopper import _sequence, _tile_range, _visible_mask, _zero_rows_from


@builtin
def _reduce_add(desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` to the tile of ``desc`` at ``coord`` with one bulk
    asynchronous reduction (``cp.reduce.async.bulk.tensor ... .add``), in the bulk group that
    ``tma.store_wait`` counts, as ``tma.async_copy_shared_to_global`` does for a copy. Gluon's
    ``hopper.tma`` of Triton 3.6 has no such call; its builder has the op."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _block(CuSeqlensR, CuSeqlensC, seqlen_r, seqlen_c, window_left, window_right, BLOCK_R: gl.constexpr,
           BLOCK_C: gl.constexpr, IS_VARLEN: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """The program's rows: (b, b_desc, m_start, r_start, c_start, seqlen_r, seqlen_c, n_lo, n_hi,
    valid). Rows [m_start, m_start + BLOCK_R) of sequence ``b`` (whose packed rows and columns
    start at r_start, c_start), column tiles [n_lo, n_hi); a packed sequence shorter than
    m_start is not valid. Heaviest blocks first (the hardware hands the next program to the
    first free SM): causal dK/dV's first key blocks, causal dQ's last query blocks. Every
    partition calls this."""
    blk = gl.program_id(0)
    if MASK_RIGHT and not MASK_LEFT:  # causal dQ: the last rows see the most columns, launch them first
        blk = gl.num_programs(0) - 1 - blk
    m_start = blk * BLOCK_R
    b = gl.program_id(2)
    r_start, c_start, seqlen_r, seqlen_c, b_desc = _sequence(CuSeqlensR, CuSeqlensC, b, seqlen_r, seqlen_c, IS_VARLEN)
    n_lo, _, _, n_hi = _tile_range(m_start, BLOCK_R, BLOCK_C, seqlen_r, seqlen_c, window_left, window_right,
                                   MASK_LEFT, MASK_RIGHT)
    return b, b_desc, m_start, r_start, c_start, seqlen_r, seqlen_c, n_lo, n_hi, m_start < seqlen_r


@gluon.jit
def _col_head(h_row, g, GROUP: gl.constexpr, DKDV: gl.constexpr):
    """The head of the ``g``-th column pass of row head ``h_row``: dK/dV walks the query heads
    h_row * GROUP + g of its key/value head; dQ's query head reads key/value head h_row // GROUP."""
    if DKDV:
        return h_row * GROUP + g
    else:
        return h_row // GROUP


@gluon.jit
def _producer(a_desc, b_desc, c_desc, d_desc, a_smem, b_smem, c_ring, d_ring, bars, CuSeqlensR, CuSeqlensC,
              seqlen_r, seqlen_c, window_left, window_right, GROUP: gl.constexpr, COL_PASSES: gl.constexpr,
              DKDV: gl.constexpr, IS_VARLEN: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
              STAGES: gl.constexpr):
    """The load warp: each warpgroup's A and B rows, then C and D tile by tile, for each of the
    ``COL_PASSES`` column heads. A slot is refilled once both consumers arrived on its ``empty``
    barrier (a fresh barrier counts as having completed the phase before its first)."""
    r_full, c_full, d_full, empty = bars
    ROWS_WG: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_C: gl.constexpr = c_desc.block_type.shape[1]
    b, bd, m_start, r_start, c_start, seqlen_r, seqlen_c, n_lo, n_hi, valid = _block(
        CuSeqlensR, CuSeqlensC, seqlen_r, seqlen_c, window_left, window_right, 2 * ROWS_WG, BLOCK_C, IS_VARLEN,
        MASK_LEFT, MASK_RIGHT)
    if valid:
        h_row = gl.program_id(1)
        for wg in gl.static_range(2):
            row = r_start + m_start + wg * ROWS_WG
            mbarrier.expect(r_full.index(wg), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [bd, row, h_row, 0], r_full.index(wg), a_smem.index(wg))
            tma.async_copy_global_to_shared(b_desc, [bd, row, h_row, 0], r_full.index(wg), b_smem.index(wg))
        c = 0  # column tiles issued so far
        for g in range(COL_PASSES):
            h_col = _col_head(h_row, g, GROUP, DKDV)
            for t in range(n_lo, n_hi):
                slot = c % STAGES
                mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
                col = c_start + t * BLOCK_C
                mbarrier.expect(c_full.index(slot), c_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(c_desc, [bd, col, h_col, 0], c_full.index(slot), c_ring.index(slot))
                mbarrier.expect(d_full.index(slot), d_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(d_desc, [bd, col, h_col, 0], d_full.index(slot), d_ring.index(slot))
                c += 1


@gluon.jit
def _store_rows(ptr, acc, smem, b, h, row0, rows_left, stride_b, stride_s, stride_h):
    """Write the fp32 ``acc`` [ROWS, HEAD_DIM] to rows row0.. of (batch b, head h), the first
    ``rows_left`` of them, in the output's dtype. An output in the inputs' dtype goes through
    ``smem`` (a rows tile only this warpgroup reads, free after its last wgmma), so each thread
    then writes 16-byte vectors with a few addresses live instead of one per element. An fp32
    output (the ring's gradient accumulators) is stored from the accumulator's own layout, never
    rounded to the inputs' dtype."""
    ROWS: gl.constexpr = acc.type.shape[0]
    HEAD_DIM: gl.constexpr = acc.type.shape[1]
    base = ptr + b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h + row0.to(gl.int64) * stride_s
    if ptr.dtype.element_ty == gl.float32:
        acc_layout: gl.constexpr = acc.type.layout
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))  # [ROWS]
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))  # [HEAD_DIM]
        ptrs = base + rows.to(gl.int64)[:, None] * stride_s + cols[None, :]  # [ROWS, HEAD_DIM]
        gl.store(ptrs, acc, mask=(rows < rows_left)[:, None])
    else:
        smem.store(acc.to(smem.dtype))
        VEC: gl.constexpr = 8  # 16 bytes
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // HEAD_DIM, HEAD_DIM // VEC], [4, 1], [1, 0])
        tile = smem.load(layout)  # [ROWS, HEAD_DIM]
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))  # [ROWS]
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))  # [HEAD_DIM]
        ptrs = base + rows.to(gl.int64)[:, None] * stride_s + cols[None, :]  # [ROWS, HEAD_DIM]
        gl.store(ptrs, tile.to(ptr.dtype.element_ty), mask=(rows < rows_left)[:, None])


@gluon.jit
def _consumer(WG: gl.constexpr, a_smem, b_smem, c_ring, d_ring, bars, dq_bufs, dq_desc, Out1, Out2, Lse2, Delta,
              CuSeqlensR, CuSeqlensC, stride_1b, stride_1s, stride_1h, stride_2b, stride_2s, stride_2h, stride_wb,
              stride_wh, seqlen_r, seqlen_c, scale, scale_log2, window_left, window_right, GROUP: gl.constexpr,
              COL_PASSES: gl.constexpr, DKDV: gl.constexpr, DQ_REDUCE: gl.constexpr, IS_VARLEN: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: rows [64 WG, 64 WG + 64) of the program's block, over every column tile
    the block sees (tiles outside this warpgroup's own range are masked whole, P = 0).

    ``DQ_REDUCE`` (dK/dV): per column tile, both warpgroups put their dS^T rows
    into one shared [128 keys, BLOCK_C] tile (two such tiles, used in turn, each with an mbarrier
    both arrive on); each then forms half of the tile's dQ over all 128 keys (at head dim 128 half
    of its columns, dS K[:, half]; at 64 half of its query rows, dS[half] K),
    puts it in its own fp32 staging tile and hands it to the copy engine as a bulk reduction into
    ``dq_desc``'s workspace, waited for only when the staging tile is next written. A warpgroup
    overwrites a dS^T tile two column tiles later, after the other arrived for the tile between,
    so after the other's products read it."""
    r_full, c_full, d_full, empty = bars
    ROWS: gl.constexpr = a_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = a_smem.type.shape[4]
    BLOCK_C: gl.constexpr = c_ring.type.shape[2]
    dtype: gl.constexpr = a_smem.dtype
    x_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_C, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_x: gl.constexpr = gl.SliceLayout(1, x_layout)
    col_x: gl.constexpr = gl.SliceLayout(0, x_layout)
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    x_zero = gl.zeros([ROWS, BLOCK_C], gl.float32, layout=x_layout)
    b, bd, m_start, r_start, c_start, seqlen_r, seqlen_c, n_lo, n_hi, valid = _block(
        CuSeqlensR, CuSeqlensC, seqlen_r, seqlen_c, window_left, window_right, 2 * ROWS, BLOCK_C, IS_VARLEN,
        MASK_LEFT, MASK_RIGHT)
    if valid:
        h_row = gl.program_id(1)
        row0 = m_start + WG * ROWS
        _, full_lo, full_hi, _ = _tile_range(row0, ROWS, BLOCK_C, seqlen_r, seqlen_c, window_left, window_right,
                                             MASK_LEFT, MASK_RIGHT)
        diag_off = seqlen_c - seqlen_r
        r_pos = row0 + gl.arange(0, ROWS, layout=row_x)  # [ROWS]
        a_tile = a_smem.index(WG).reshape([ROWS, HEAD_DIM])
        b_tile = b_smem.index(WG).reshape([ROWS, HEAD_DIM])
        acc1 = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)  # dQ or dK
        if DKDV:
            acc2 = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)  # dV
        else:  # the query rows' lse2 and delta, once (rows past the end: P = 0)
            w_rows = b.to(gl.int64) * stride_wb + h_row.to(gl.int64) * stride_wh + r_start + r_pos
            lse2 = gl.load(Lse2 + w_rows, mask=r_pos < seqlen_r, other=float("inf"))  # [ROWS]
            delta = gl.load(Delta + w_rows, mask=r_pos < seqlen_r, other=0.0)  # [ROWS]
        if DQ_REDUCE:
            ds_smem, ds_ready, dq_stage = dq_bufs
            # the part of the tile's dQ [BLOCK_C, HEAD_DIM] this warpgroup reduces: half of the columns
            # (head dim 128), or half of the query rows (64: a 32-column half of k would cut its
            # 128-byte swizzle atom)
            DQ_M: gl.constexpr = dq_desc.block_type.shape[0]
            DQ_N: gl.constexpr = dq_desc.block_type.shape[1]
            SPLIT_ROWS: gl.constexpr = DQ_M < BLOCK_C
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, DQ_N, 16])
            dq_zero = gl.zeros([DQ_M, DQ_N], gl.float32, layout=dq_layout)
            dq_row0 = bd * seqlen_c + c_start  # the first query's row of the (tokens, heads x dim) workspace
            stage = dq_stage.index(WG)  # [DQ_M, DQ_N] fp32
            mbarrier.wait(r_full.index(1 - WG), 0)  # the other warpgroup's k rows are read too
        mbarrier.wait(r_full.index(WG), 0)
        c = 0  # column tiles consumed so far
        for g in range(COL_PASSES):
            h_col = _col_head(h_row, g, GROUP, DKDV)
            w_cols = b.to(gl.int64) * stride_wb + h_col.to(gl.int64) * stride_wh + c_start
            for t in range(n_lo, n_hi):
                slot = c % STAGES
                phase = (c // STAGES) & 1
                if DKDV:  # the query columns' lse2 and delta, one per thread, loaded while S^T is computed
                    c_vec = t * BLOCK_C + gl.arange(0, BLOCK_C, layout=vec_layout)  # [BLOCK_C]
                    lse2_c = gl.load(Lse2 + w_cols + c_vec, mask=c_vec < seqlen_c, other=float("inf"))
                    delta_c = gl.load(Delta + w_cols + c_vec, mask=c_vec < seqlen_c, other=0.0)
                # dQ: a packed sequence's last key tile holds the next sequence's k and v rows (masked, P = 0,
                # but 0 x inf = NaN in dP and dS K): zeroed (module docstring)
                mbarrier.wait(c_full.index(slot), phase)
                c_tile = c_ring.index(slot).reshape([BLOCK_C, HEAD_DIM])
                if IS_VARLEN and not DKDV:
                    if (t + 1) * BLOCK_C > seqlen_c:
                        _zero_rows_from(c_tile, seqlen_c - t * BLOCK_C, BLOCK_C, HEAD_DIM)
                x_tok = warpgroup_mma(a_tile, c_tile.permute((1, 0)), x_zero, use_acc=False, is_async=True)
                mbarrier.wait(d_full.index(slot), phase)
                d_tile = d_ring.index(slot).reshape([BLOCK_C, HEAD_DIM])
                if IS_VARLEN and not DKDV:
                    if (t + 1) * BLOCK_C > seqlen_c:
                        _zero_rows_from(d_tile, seqlen_c - t * BLOCK_C, BLOCK_C, HEAD_DIM)
                y_tok = warpgroup_mma(b_tile, d_tile.permute((1, 0)), x_zero, use_acc=False, is_async=True)
                x = warpgroup_mma_wait(num_outstanding=1, deps=(x_tok,))  # [ROWS, BLOCK_C] Y still running
                if (t < full_lo) | (t >= full_hi):  # a boundary tile (uniform branch)
                    c_pos = t * BLOCK_C + gl.arange(0, BLOCK_C, layout=col_x)  # [BLOCK_C]
                    seen = _visible_mask(r_pos, c_pos, seqlen_c, diag_off, window_left, window_right,
                                         MASK_LEFT, MASK_RIGHT, True)  # [ROWS, BLOCK_C]
                    x = gl.where(seen, x, float("-inf"))
                if DKDV:
                    # spread over the tile's columns only now: 2 x 16 registers a thread would
                    # otherwise hold (and spill) across the matmuls
                    lse2 = gl.convert_layout(lse2_c, col_x)  # [BLOCK_C]
                    p = gl.exp2(x * scale_log2 - lse2[None, :])  # [ROWS, BLOCK_C] P^T
                    p_op = gl.convert_layout(p.to(dtype), op_layout)
                    y = warpgroup_mma_wait(num_outstanding=0, deps=(y_tok,))
                    ds = p * (y - gl.convert_layout(delta_c, col_x)[None, :])  # [ROWS, BLOCK_C] dS^T
                    # dV's product issued only now, with dK's: P and dP^T in fp32 are then dead, which
                    # keeps the peak below dK + dV + 4 score tiles
                    acc2 = warpgroup_mma(p_op, d_tile, acc2, is_async=True)  # dV += P^T dO
                else:
                    p = gl.exp2(x * scale_log2 - lse2[:, None])  # [ROWS, BLOCK_C] P
                    y = warpgroup_mma_wait(num_outstanding=0, deps=(y_tok,))
                    ds = p * (y - delta[:, None])  # [ROWS, BLOCK_C] dS
                if DQ_REDUCE and IS_VARLEN:
                    if row0 + ROWS > seqlen_r:  # keys past the sequence's end are the next one's: not in its dQ
                        ds = gl.where((r_pos < seqlen_r)[:, None], ds, 0.0)
                ds16 = ds.to(dtype)
                ds_op = gl.convert_layout(ds16, op_layout)
                acc1 = warpgroup_mma(ds_op, c_tile, acc1, is_async=True)  # dK += dS^T Q or dQ += dS K
                # the register operands stay live until their products are done
                if DQ_REDUCE:
                    u = c % 2
                    ds_buf = ds_smem.index(u)  # [2 * ROWS, BLOCK_C]
                    ds_buf.slice(WG * ROWS, ROWS, dim=0).store(ds16)
                    fence_async_shared()
                    gl.thread_barrier()  # every thread's rows stored before the (single) arrival
                    mbarrier.arrive(ds_ready.index(u), count=1)
                    mbarrier.wait(ds_ready.index(u), (c // 2) & 1)
                    dq = dq_zero  # sum over w of dS[this warpgroup's rows, keys of w] K[keys of w, its columns]
                    for w in gl.static_range(2):  # a 64-column part: one 128-byte swizzle atom of k's rows
                        k_part = a_smem.index(w).reshape([ROWS, HEAD_DIM])
                        ds_part = ds_buf.slice(w * ROWS, ROWS, dim=0)  # [ROWS keys, BLOCK_C queries]
                        if SPLIT_ROWS:
                            ds_part = ds_part.slice(WG * DQ_M, DQ_M, dim=1)
                        else:
                            k_part = k_part.slice(WG * DQ_N, DQ_N, dim=1)
                        dq = warpgroup_mma(ds_part.permute((1, 0)), k_part, dq, use_acc=w > 0, is_async=True)
                    dq, acc1, acc2, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0,
                                                                     deps=(dq, acc1, acc2, p_op, ds_op))
                elif DKDV:
                    acc1, acc2, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, acc2, p_op, ds_op))
                else:
                    acc1, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ds_op))
                mbarrier.arrive(empty.index(slot), count=1)
                if DQ_REDUCE:  # the dQ share to the copy engine (the dQ products read no ring slot)
                    tma.store_wait(0)  # the previous tile's reduction has read the staging tile
                    gl.thread_barrier()
                    stage.store(dq * scale)  # dQ's scale here: the workspace then only needs rounding
                    fence_async_shared()
                    gl.thread_barrier()  # the whole tile stored before the (single-thread) bulk reduction
                    _reduce_add(dq_desc, [dq_row0 + t * BLOCK_C + SPLIT_ROWS * WG * DQ_M,
                                          h_col * HEAD_DIM + (1 - SPLIT_ROWS) * WG * DQ_N], stage)
                c += 1
        if DQ_REDUCE:
            tma.store_wait(0)  # the staging tile is read before the program ends
        # both through this warpgroup's B tile, free after its last product (with DQ_REDUCE the other
        # warpgroup may still read this one's A tile, k, not its B tile)
        rows_left = seqlen_r - row0
        _store_rows(Out1, acc1 * scale, b_tile, b, h_row, r_start + row0, rows_left, stride_1b, stride_1s, stride_1h)
        if DKDV:
            _store_rows(Out2, acc2, b_tile, b, h_row, r_start + row0, rows_left, stride_2b, stride_2s, stride_2h)


@gluon.jit
def _attn_bwd_hopper_kernel(
    a_desc, b_desc, c_desc, d_desc, dq_desc, Out1, Out2, Lse2, Delta, CuSeqlensR, CuSeqlensC,
    stride_1b, stride_1s, stride_1h, stride_2b, stride_2s, stride_2h, stride_wb, stride_wh,
    seqlen_r, seqlen_c, scale, scale_log2, window_left, window_right,
    GROUP: gl.constexpr, COL_PASSES: gl.constexpr, DKDV: gl.constexpr, DQ_REDUCE: gl.constexpr,
    IS_VARLEN: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Program (row block, row head, batch): dQ of 128 query rows of one query head
    (``DKDV=False``, Out1 = dq) or dK, dV of 128 keys of one key/value head (``DKDV=True``, Out1 =
    dk, Out2 = dv, ``COL_PASSES`` = GROUP query heads walked in order), in the frame of the module
    docstring: ``seqlen_r/c``, the window and the MASK flags are the rows' and columns' (swapped
    by the launcher for dK/dV). Lse2, Delta: the preprocess's (batch, heads, seqlen_q) or packed
    (heads, tokens) workspaces, ``stride_wb`` = 0 when packed. ``IS_VARLEN``: the descriptors
    view packed (tokens, heads, dim) tensors as batch 1; sequence b owns rows
    CuSeqlensR[b]:CuSeqlensR[b + 1] and columns likewise, and ``seqlen_r/c`` are the longest.

    ``DQ_REDUCE`` (with DKDV): the program also adds its keys' share of dQ (scaled) to the fp32
    workspace behind ``dq_desc``, a (batch x seqlen_q or tokens, heads x head_dim) matrix, so no
    dQ launch is needed; columns past a sequence's end add exact zeros (their P is 0)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [2] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [2] + b_desc.block_type.shape, b_desc.layout)
    c_ring = gl.allocate_shared_memory(dtype, [STAGES] + c_desc.block_type.shape, c_desc.layout)
    d_ring = gl.allocate_shared_memory(dtype, [STAGES] + d_desc.block_type.shape, d_desc.layout)
    if DQ_REDUCE:  # two [128 keys, BLOCK_C] dS^T tiles with their barriers, one fp32 dQ staging tile per warpgroup
        ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * a_desc.block_type.shape[1], c_desc.block_type.shape[1]],
                                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16))
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)  # both warpgroups' rows are in
        dq_stage = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        dq_bufs = (ds_smem, ds_ready, dq_stage)
    else:
        dq_bufs: gl.constexpr = None
    r_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    d_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(r_full.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(c_full.index(i), count=1)
        mbarrier.init(d_full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    bars = (r_full, c_full, d_full, empty)
    gl.warp_specialize([
        (_consumer, (0, a_smem, b_smem, c_ring, d_ring, bars, dq_bufs, dq_desc, Out1, Out2, Lse2, Delta, CuSeqlensR,
                     CuSeqlensC, stride_1b, stride_1s, stride_1h, stride_2b, stride_2s, stride_2h, stride_wb,
                     stride_wh, seqlen_r, seqlen_c, scale, scale_log2, window_left, window_right, GROUP, COL_PASSES,
                     DKDV, DQ_REDUCE, IS_VARLEN, MASK_LEFT, MASK_RIGHT, STAGES)),
        (_consumer, (1, a_smem, b_smem, c_ring, d_ring, bars, dq_bufs, dq_desc, Out1, Out2, Lse2, Delta, CuSeqlensR,
                     CuSeqlensC, stride_1b, stride_1s, stride_1h, stride_2b, stride_2s, stride_2h, stride_wb,
                     stride_wh, seqlen_r, seqlen_c, scale, scale_log2, window_left, window_right, GROUP, COL_PASSES,
                     DKDV, DQ_REDUCE, IS_VARLEN, MASK_LEFT, MASK_RIGHT, STAGES)),
        (_producer, (a_desc, b_desc, c_desc, d_desc, a_smem, b_smem, c_ring, d_ring, bars, CuSeqlensR, CuSeqlensC,
                     seqlen_r, seqlen_c, window_left, window_right, GROUP, COL_PASSES, DKDV, IS_VARLEN, MASK_LEFT,
                     MASK_RIGHT, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
