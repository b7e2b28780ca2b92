"""The FlashAttention forward kernel: one program = one block of query rows x one key range.

For a block of ``BLOCK_M`` query rows the keys stream through in tiles of ``BLOCK_N``, and
per row the running maximum ``m``, running sum ``l`` and unnormalised output ``acc`` follow
the online-softmax recurrence in log2 units (``s2 = log2(e) * s``, see ``common.py``):

    m' = max(m, rowmax(s2));  alpha = 2^(m - m');  p = 2^(s2 - m')
    l' = alpha l + rowsum(p);  acc' = alpha acc + (p * keep / (1 - p_drop)) V

and at the end ``out = acc / l``, ``lse = (m + log2 l) * ln 2`` (natural log). A row that saw
no key keeps ``l = 0``: out 0, lse -inf (the guard ``m' = -inf -> 0`` keeps 2^(-inf - -inf)
from becoming NaN).

The key tiles a query block needs fall into three ranges, walked in order:

    [n_lo, full_lo)     left edge of a sliding window: masked
    [full_lo, full_hi)  every (row, key) pair visible and every key < seqlen_k: no mask work
    [full_hi, n_hi)     causal diagonal / right window edge / last partial tile: masked

Tiles outside ``[n_lo, n_hi)`` are fully masked and never touched. With ``SINGLE_LOOP`` one
masked loop walks all of ``[n_lo, n_hi)`` instead (the wide tile, below: a 512-wide fp32
accumulator leaves no registers for the pipelines of a second loop, and the masks cost a few
operations per score beside a 576-deep product). With ``SPLIT_KV`` the grid's axis 1 cuts
``[n_lo, n_hi)`` into ``num_splits`` contiguous pieces; each writes its partial, already
normalised ``(o, lse)`` to fp32 workspaces that ``combine.py``'s ``merge_row`` merges: by the
combine launch after this one, or with ``MERGE_SPLITS`` by the last of a row block's split
programs to finish (below).

``HEAD_DIM_V`` is v's head dim (and the output's), which may differ from q/k's ``HEAD_DIM``
(MLA). With ``HEAD_DIM_TAIL > 0`` q/k's head dim is ``HEAD_DIM + HEAD_DIM_TAIL``: a power-of-two
main part (``HEAD_DIM = HEAD_DIM_PAD``) and a tail padded to ``HEAD_DIM_TAIL_PAD``; the scores are
``q_main . k_main + q_tail . k_tail``, so MLA's absorbed 576 = 512 + 64 is not padded to 1024
(``HEAD_DIM_TAIL = 0``, every head dim up to 256, compiles to the kernel without it).
``V_IS_K``: v is k's first ``HEAD_DIM_V`` (= ``HEAD_DIM``) columns in memory (MLA's latent cache,
``v_cache = k_cache[..., :512]``): the key tile loaded for the scores is the value tile, so the
latent is read once.

Feature flags (all ``tl.constexpr``): ``IS_VARLEN`` (packed queries and keys via cu_seqlens),
``IS_PAGED`` (keys in a block pool addressed through a block table; with ``PREFETCH_PAGES`` each
tile's page ids are loaded one tile ahead, so the gathered K/V loads depend on nothing loaded in
their own iteration and Triton's pipeliner stages them in shared memory), ``HAS_SEQUSED_K``,
``PACK_GQA`` (row r of a head group's tile is query ``r // GROUP`` of head ``hk * GROUP + r %
GROUP``, so one program reads each K/V tile once for the whole group), ``SPLIT_KV``,
``MASK_LEFT`` / ``MASK_RIGHT`` (window bounds; causal is MASK_RIGHT with window_right 0),
``HAS_SOFTCAP`` (``PRECISE_TANH``: which of ``common.tanh``'s two forms the softcap takes),
``HAS_ALIBI``, ``HAS_DROPOUT``, ``IS_FP8`` (K/V stored in float8_e4m3fn with
descales ``KDescale``/``VDescale``, contiguous (batch, nheads_k) fp32, real = stored x descale:
the tiles convert exactly to ``DOT_DTYPE``, k's descale joins the score scale and v's the
output), ``HAS_SINK`` (a learnable sink logit per query head: without ``SPLIT_KV`` the recurrence
starts from the sink's state m = log2(e) sink, l = 1, acc = 0, a key of value 0 every row sees;
with it the merge of the splits counts the sink once), ``HEAD_DIM_TAIL`` / ``HEAD_DIM_TAIL_PAD``,
``V_IS_K`` and ``SINGLE_LOOP`` (above), ``CHECK_CACHE`` and ``MERGE_SPLITS`` (below). ``DOT_DTYPE``
is the operand dtype of the two matmuls: the inputs' dtype, except fp16 over an FP8 cache (q scaled
into fp16's range, below) and bf16 under Triton 3.6's interpreter, whose tl.dot multiplies bf16 bit
patterns as integers; the launcher then asks for fp32.

``CHECK_CACHE`` (with ``HAS_SEQUSED_K``; compiled with Triton's ``debug`` option and
``sanitize_overflow`` off, so its assertion is the only one) folds the KV cache's value check
(``checks.py``) into the launch that reads the cache: before it reads a key, each program checks
the values it depends on, its sequence's length within 0..``cache_top`` and, paged, the
block-table entries of the pages its key tiles cover within 0..``num_blocks - 1``, and asserts
it with the check kernel's message (``tl.device_assert``). A program that finds a bad value reads
no key even if the assertion returned (its tile ranges emptied). Without a left window every page
in use is read by some program (the last query block's splits cover all key tiles), so the
programs together check what the check kernel does; the launcher folds nothing else.

``MERGE_SPLITS`` (with ``SPLIT_KV``; ``MERGE_ROWS`` rows, ``MERGE_BLOCK_S`` splits read at once, the
loop over the rows unrolled ``MERGE_UNROLL`` times):
after its partial's stores each split program counts itself in on ``Counters[pid]`` (int32, one
per program along axis 0, zero before the launch); the one that finds ``num_splits - 1`` there
arrived last, merges the row block's partials row by row with ``merge_row`` (the combine
kernel's code: the same result to rounding, ``combine.py``), writes ``MergeOut``/``MergeLse`` (laid out as one
split of the workspace: the same offsets without the split's) and sets the counter back to 0
for the next launch on the buffer (stream order: that launch starts after this one ended).
Memory order: every thread's partial stores must be visible to every thread of the last
program. Each program: its stores, then a block barrier (``tl.debug_barrier``, bar.sync: the
CTA's stores ordered before what follows it), then the counter's atomic, acq_rel at GPU scope,
which Triton makes from one thread, a fenced atomic whose release is cumulative over the stores
the barrier ordered before it. The last program: the same atomic's acquire (its result reaches
the other threads through shared memory behind a barrier, and every merge load depends on it),
then the loads, which therefore observe every split's stores (causality order: each split's
stores -> its barrier -> its release -> the last program's acquire -> its barrier -> its loads;
cooperative groups' grid sync is the same pattern: bar.sync, one thread's fenced atomic,
bar.sync). The merge's loads are plain ``ld.global`` of a pointer the kernel also stores through
(never the read-only path), and the acquire invalidates the SM's L1 (sm_90 SASS: BAR.SYNC,
MEMBAR.ALL.GPU, ATOMG.E.ADD.STRONG.GPU, CCTL.IVALL, BAR.SYNC; docs/perf-notes.md). The programs
of a row block all return early or none does (the test depends on ``pid`` alone), so a counter
is either untouched or counted to ``num_splits`` and zeroed.
"""

import triton
import triton.language as tl

from .checks import ASSERT_MESSAGE, sequence_reads_ok
from .combine import merge_row
from .common import LOG2E, dropout_keep, finish_rows, online_rescale, scores_log2


@triton.jit
def _row_coords(offs_m, h_grid, GROUP: tl.constexpr, PACK_GQA: tl.constexpr):
    """(query position, query head) of rows ``offs_m`` of the program of head (or KV head group) ``h_grid``."""
    if PACK_GQA:  # row r: query r // GROUP of head h_grid * GROUP + r % GROUP
        return offs_m // GROUP, h_grid * GROUP + offs_m % GROUP
    else:
        return offs_m, tl.zeros_like(offs_m) + h_grid


@triton.jit
def _tile_pages(tbl, start_n, offs_n, seqlen_k, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block-table entries of the key tile starting at ``start_n``: one id when the tile lies in one
    page, else one per key ([BLOCK_N]); 0 past ``seqlen_k`` (a tile after the last, prefetched)."""
    if PAGE_SIZE % BLOCK_N == 0:
        return tl.load(tbl + start_n // PAGE_SIZE, mask=start_n < seqlen_k, other=0)
    else:
        k_pos = start_n + offs_n  # [BLOCK_N]
        return tl.load(tbl + k_pos // PAGE_SIZE, mask=k_pos < seqlen_k, other=0)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, b_q, b_qt, k_base, v_base, tbl, stride_kpage, stride_vpage, stride_kn,
                    stride_vn, tile_lo, tile_hi, q_pos, bh, seqlen_k, diag_off, scale_log2, softcap, slope_log2,
                    window_left, window_right, dropout_seed, dropout_threshold, dropout_scale, drop_r0, drop_c0,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                    HEAD_DIM_TAIL: tl.constexpr, HEAD_DIM_TAIL_PAD: tl.constexpr, V_IS_K: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, IS_PAGED: tl.constexpr, PREFETCH_PAGES: tl.constexpr,
                    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, PRECISE_TANH: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """Run the recurrence over key tiles ``tile_lo .. tile_hi - 1`` (tile indices).

    ``MASKED`` tiles apply the window and ``seqlen_k`` bounds; unmasked tiles are known to be
    fully visible and fully inside the sequence, so they carry no masks but the head dim's.
    With ``HEAD_DIM_TAIL`` the scores add the tail's product ``b_qt . k_tail`` (``b_qt`` is
    unread otherwise); with ``V_IS_K`` the key tile is the value tile.
    """
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # [HEAD_DIM_V_PAD]
    if IS_PAGED and PREFETCH_PAGES:  # the first tile's page ids; each tile loads the next one's while it computes
        pages_next = _tile_pages(tbl, tile_lo * BLOCK_N, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N)
    for start_n in range(tile_lo * BLOCK_N, tile_hi * BLOCK_N, BLOCK_N):
        k_pos = start_n + offs_n  # [BLOCK_N] key positions inside the sequence
        if MASKED:
            kv_mask = (k_pos[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_N, HEAD_DIM_PAD]
            v_mask = (k_pos[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V)  # [BLOCK_N, HEAD_DIM_V_PAD]
        else:
            kv_mask = offs_d[None, :] < HEAD_DIM  # [1, HEAD_DIM_PAD], only used if HEAD_DIM is padded
            v_mask = offs_dv[None, :] < HEAD_DIM_V  # [1, HEAD_DIM_V_PAD]
        if IS_PAGED:
            if PREFETCH_PAGES:  # the K/V loads then depend on no load of this iteration: Triton stages them
                pages = pages_next.to(tl.int64)  # [] or [BLOCK_N]
                pages_next = _tile_pages(tbl, start_n + BLOCK_N, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N)
            else:
                pages = _tile_pages(tbl, start_n, offs_n, seqlen_k, PAGE_SIZE, BLOCK_N).to(tl.int64)
            if PAGE_SIZE % BLOCK_N == 0:  # the whole tile lies in one page
                rows = (start_n % PAGE_SIZE + offs_n).to(tl.int64)  # [BLOCK_N]
            else:  # pages smaller than (or not aligned to) the tile: a page id per key
                rows = (k_pos % PAGE_SIZE).to(tl.int64)  # [BLOCK_N]
            k_rows = pages * stride_kpage + rows * stride_kn  # [BLOCK_N]
            v_rows = pages * stride_vpage + rows * stride_vn
        else:
            k_rows = k_pos.to(tl.int64) * stride_kn  # [BLOCK_N]
            v_rows = k_pos.to(tl.int64) * stride_vn
        k_ptrs = k_base + k_rows[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        v_ptrs = v_base + v_rows[:, None] + offs_dv[None, :]  # [BLOCK_N, HEAD_DIM_V_PAD]
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            b_k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        else:
            b_k = tl.load(k_ptrs)
        qk = tl.dot(b_q, tl.trans(b_k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if HEAD_DIM_TAIL > 0:  # q/k's columns past the power-of-two main part
            offs_t = tl.arange(0, HEAD_DIM_TAIL_PAD)  # [HEAD_DIM_TAIL_PAD]
            kt_ptrs = k_base + k_rows[:, None] + HEAD_DIM + offs_t[None, :]  # [BLOCK_N, HEAD_DIM_TAIL_PAD]
            if MASKED:
                kt_mask = (k_pos[:, None] < seqlen_k) & (offs_t[None, :] < HEAD_DIM_TAIL)  # [BLOCK_N, TAIL_PAD]
                b_kt = tl.load(kt_ptrs, mask=kt_mask, other=0.0)
            elif HEAD_DIM_TAIL != HEAD_DIM_TAIL_PAD:
                b_kt = tl.load(kt_ptrs, mask=offs_t[None, :] < HEAD_DIM_TAIL, other=0.0)
            else:
                b_kt = tl.load(kt_ptrs)  # [BLOCK_N, HEAD_DIM_TAIL_PAD]
            qk = tl.dot(b_qt, tl.trans(b_kt.to(DOT_DTYPE)), qk, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s = scores_log2(qk, q_pos, k_pos, seqlen_k, diag_off, scale_log2, softcap, slope_log2,
                        window_left, window_right, HAS_SOFTCAP, PRECISE_TANH, HAS_ALIBI,
                        MASKED and MASK_LEFT, MASKED and MASK_RIGHT, MASKED)  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        m_use, alpha = online_rescale(m_i, m_new, MASKED)  # [BLOCK_M]; masked rows seeing nothing yet: 0
        p = tl.math.exp2(s - m_use[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = dropout_keep(dropout_seed, bh, q_pos + drop_r0, k_pos + drop_c0,
                                dropout_threshold)  # [BLOCK_M, BLOCK_N]
            p = tl.where(keep, p * dropout_scale, 0.0)
        if V_IS_K:  # v is k's first HEAD_DIM_V (= HEAD_DIM) columns: the key tile, read once
            b_v = b_k  # [BLOCK_N, HEAD_DIM_V_PAD]
        elif MASKED or HEAD_DIM_V != HEAD_DIM_V_PAD:
            b_v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_V_PAD]
        else:
            b_v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DOT_DTYPE), b_v.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)  # [BLOCK_M, HEAD_DIM_V_PAD]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q_arg", "seqlen_k_arg", "max_rows", "min_seqlen_q", "num_splits",
                               "cache_top", "num_blocks", "window_left", "window_right", "diag_shift", "drop_bh0", "drop_bh_stride",
                               "drop_r0", "drop_c0", "dropout_seed", "dropout_threshold"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, MergeOut, MergeLse, Counters, Slopes, Sinks, CuSeqlensQ, CuSeqlensK, SequsedK, BlockTable,
    KDescale, VDescale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_o_split, stride_ob, stride_os, stride_oh,
    stride_l_split, stride_lb, stride_lh, stride_ls,
    stride_sb, stride_sh, stride_tb,
    nheads, seqlen_q_arg, seqlen_k_arg, max_rows, min_seqlen_q, num_splits, cache_top, num_blocks,
    scale_log2, softcap, window_left, window_right, diag_shift, drop_bh0, drop_bh_stride, drop_r0, drop_c0,
    dropout_seed, dropout_threshold, dropout_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_PAGED: tl.constexpr, PREFETCH_PAGES: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    PACK_GQA: tl.constexpr, SPLIT_KV: tl.constexpr, IS_FP8: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISE_TANH: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SINK: tl.constexpr = False, HEAD_DIM_TAIL: tl.constexpr = 0, HEAD_DIM_TAIL_PAD: tl.constexpr = 0,
    V_IS_K: tl.constexpr = False, SINGLE_LOOP: tl.constexpr = False, CHECK_CACHE: tl.constexpr = False,
    CHECK_BLOCK_P: tl.constexpr = 128, MERGE_SPLITS: tl.constexpr = False, MERGE_ROWS: tl.constexpr = 1,
    MERGE_BLOCK_S: tl.constexpr = 1, MERGE_UNROLL: tl.constexpr = 1,
):
    """Grid: axis 0 = (batch, head or KV head if PACK_GQA, query block), axis 1 = KV split.

    A launch serves the sequences of at least ``min_seqlen_q`` queries and at most ``max_rows``
    rows; the others are another launch's (a mixed batch of short and long sequences takes two,
    ``gpu.attention.FwdPlan``).

    ``Out``/``Lse`` are either the outputs (``stride_o_split = 0``) or, with ``SPLIT_KV``, fp32
    workspaces with one slice per split. Dense tensors index tokens as ``b * stride_b + i * stride_s``;
    varlen tensors pass ``stride_b = 0`` and the sequence's start offset is added to ``i``. With
    ``MERGE_SPLITS``, ``MergeOut``/``MergeLse`` are the outputs (module docstring), else None as
    ``Counters``.
    """
    num_m_blocks = tl.cdiv(max_rows, BLOCK_M)
    pid = tl.program_id(0)
    m_block = num_m_blocks - 1 - pid % num_m_blocks  # heaviest (causal) query blocks first
    bh_grid = pid // num_m_blocks
    nheads_grid = nheads // GROUP if PACK_GQA else nheads
    b = bh_grid // nheads_grid
    h_grid = bh_grid % nheads_grid

    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + b)
        seqlen_q = tl.load(CuSeqlensQ + b + 1) - q_start
    else:
        q_start = 0
        seqlen_q = seqlen_q_arg
    if HAS_SEQUSED_K:
        seqlen_k = tl.load(SequsedK + b)
    elif IS_VARLEN and not IS_PAGED:
        seqlen_k = tl.load(CuSeqlensK + b + 1) - tl.load(CuSeqlensK + b)
    else:
        seqlen_k = seqlen_k_arg

    num_rows = seqlen_q * GROUP if PACK_GQA else seqlen_q
    m_start = m_block * BLOCK_M
    if m_start >= num_rows or num_rows > max_rows or seqlen_q < min_seqlen_q:  # not this launch's rows
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] row of this (sequence, head group)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    q_pos, head = _row_coords(offs_m, h_grid, GROUP, PACK_GQA)  # [BLOCK_M] query position and head of each row
    if PACK_GQA:
        head_k = h_grid
        q_first = m_start // GROUP
        q_last = tl.minimum((m_start + BLOCK_M - 1) // GROUP, seqlen_q - 1)
    else:
        head_k = h_grid // GROUP
        q_first = m_start
        q_last = tl.minimum(m_start + BLOCK_M - 1, seqlen_q - 1)
    row_ok = q_pos < seqlen_q  # [BLOCK_M]
    b64 = b.to(tl.int64)
    tok = (q_start + q_pos).to(tl.int64)  # [BLOCK_M] token index along the (packed) sequence axis

    q_rows = b64 * stride_qb + tok * stride_qs + head.to(tl.int64) * stride_qh  # [BLOCK_M]
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, HEAD_DIM_PAD]
    b_q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if HEAD_DIM_TAIL > 0:  # q's columns HEAD_DIM .. HEAD_DIM + HEAD_DIM_TAIL - 1
        offs_t = tl.arange(0, HEAD_DIM_TAIL_PAD)  # [HEAD_DIM_TAIL_PAD]
        qt_mask = row_ok[:, None] & (offs_t[None, :] < HEAD_DIM_TAIL)  # [BLOCK_M, HEAD_DIM_TAIL_PAD]
        b_qt = tl.load(Q + q_rows[:, None] + HEAD_DIM + offs_t[None, :], mask=qt_mask, other=0.0)
    else:
        b_qt = b_q  # a stand-in: without a tail the inner loop never reads it
    if IS_FP8:
        # fp16 operands (DOT_DTYPE): float8_e4m3fn turns into fp16 with one instruction per two
        # values (into bf16 through fp16 and fp32: three). q, bf16 or fp16, is scaled by a power of
        # two that puts its largest entry in (2^13, 2^14]: inside fp16's range, every entry down to
        # 2^-27 of the largest at fp16's full precision (bf16 keeps 8 bits, fp16 11); the factor
        # joins the scores' scale, so the scores are unchanged up to rounding
        q_abs = tl.max(tl.max(tl.abs(b_q.to(tl.float32)), 1), 0)
        if HEAD_DIM_TAIL > 0:
            q_abs = tl.maximum(q_abs, tl.max(tl.max(tl.abs(b_qt.to(tl.float32)), 1), 0))
        q_exp = tl.math.ceil(tl.math.log2(tl.maximum(q_abs, 1e-30))) - 14.0
        b_q = b_q.to(tl.float32) * tl.math.exp2(-q_exp)
        if HEAD_DIM_TAIL > 0:
            b_qt = b_qt.to(tl.float32) * tl.math.exp2(-q_exp)
        scale_log2 = scale_log2 * tl.math.exp2(q_exp)
    b_q = b_q.to(DOT_DTYPE)
    if HEAD_DIM_TAIL > 0:
        b_qt = b_qt.to(DOT_DTYPE)

    if IS_PAGED:
        k_base = K + head_k.to(tl.int64) * stride_kh
        v_base = V + head_k.to(tl.int64) * stride_vh
        tbl = BlockTable + b64 * stride_tb
    else:
        k_base = K + b64 * stride_kb + head_k.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vb + head_k.to(tl.int64) * stride_vh
        if IS_VARLEN:  # keys packed too: start at the sequence's first key
            k_start = tl.load(CuSeqlensK + b).to(tl.int64)
            k_base += k_start * stride_ks
            v_base += k_start * stride_vs
        tbl = BlockTable
    if HAS_ALIBI:
        slope_log2 = tl.load(Slopes + b64 * stride_sb + head * stride_sh)[:, None] * LOG2E  # [BLOCK_M, 1]
    else:
        slope_log2 = 0.0
    bh = b * drop_bh_stride + drop_bh0 + head  # [BLOCK_M] dropout's (batch, head) counter
    if IS_FP8:  # one KV head per program: k's descale scales every score, v's the output
        kv_idx = b64 * (nheads // GROUP) + head_k
        scale_log2 = scale_log2 * tl.load(KDescale + kv_idx)
        v_scale = tl.load(VDescale + kv_idx)

    # Key tiles this query block can see (window bounds relative to the diagonal i + diag_off).
    diag_off = seqlen_k - seqlen_q + diag_shift  # the diagonal (bottom-right aligned, moved by diag_shift)
    key_lo = 0
    key_hi = seqlen_k
    full_lo_key = 0
    full_hi_key = seqlen_k
    if MASK_LEFT:
        key_lo = tl.maximum(q_first + diag_off - window_left, 0)
        full_lo_key = tl.maximum(q_last + diag_off - window_left, 0)
    if MASK_RIGHT:
        key_hi = tl.maximum(tl.minimum(q_last + diag_off + window_right + 1, seqlen_k), 0)
        full_hi_key = tl.maximum(tl.minimum(q_first + diag_off + window_right + 1, seqlen_k), 0)
    n_lo = key_lo // BLOCK_N
    n_hi = tl.maximum(tl.cdiv(key_hi, BLOCK_N), n_lo)
    full_lo = tl.minimum(tl.cdiv(full_lo_key, BLOCK_N), n_hi)
    full_lo = tl.maximum(full_lo, n_lo)
    full_hi = tl.minimum(tl.maximum(full_hi_key // BLOCK_N, full_lo), n_hi)
    if SPLIT_KV:
        per_split = tl.cdiv(n_hi - n_lo, num_splits)
        split_lo = n_lo + tl.program_id(1) * per_split
        split_hi = tl.minimum(split_lo + per_split, n_hi)
        n_lo = tl.minimum(tl.maximum(n_lo, split_lo), split_hi)
        full_lo = tl.minimum(tl.maximum(full_lo, split_lo), split_hi)
        full_hi = tl.minimum(tl.maximum(full_hi, split_lo), split_hi)
        n_hi = tl.minimum(tl.maximum(n_hi, split_lo), split_hi)
    if CHECK_CACHE:  # the cache's values this program reads by, before its first key (module docstring)
        if IS_PAGED:  # the pages of keys n_lo * BLOCK_N .. its last, kept within the row's cache_top keys
            # (in 64 bits: a huge bad length's tile bounds times BLOCK_N must not wrap to a negative page)
            k_end = tl.minimum(n_hi.to(tl.int64) * BLOCK_N, tl.minimum(tl.maximum(seqlen_k, 0), cache_top))
            p_lo = tl.minimum(n_lo.to(tl.int64) * BLOCK_N, k_end) // PAGE_SIZE
            ok = sequence_reads_ok(seqlen_k, cache_top, tbl, p_lo, tl.cdiv(k_end, PAGE_SIZE), num_blocks, True,
                                   CHECK_BLOCK_P)
        else:
            ok = sequence_reads_ok(seqlen_k, cache_top, tbl, 0, 0, num_blocks, False, CHECK_BLOCK_P)
        tl.device_assert(ok, ASSERT_MESSAGE)
        n_lo = tl.where(ok, n_lo, 0)  # a bad value: no key tile (and no page id past the row's first)
        full_lo = tl.where(ok, full_lo, 0)
        full_hi = tl.where(ok, full_hi, 0)
        n_hi = tl.where(ok, n_hi, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M] running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum
    if HAS_SINK and not SPLIT_KV:  # the sink: a key of score sink[head] and value 0 that every row sees
        m_i = tl.load(Sinks + head) * LOG2E  # [BLOCK_M]
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)  # [BLOCK_M, HEAD_DIM_V_PAD]
    if SINGLE_LOOP:  # every tile in one masked loop: [n_lo, full_lo) is all of [n_lo, n_hi)
        full_lo = n_hi
    if MASK_LEFT or SINGLE_LOOP:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, b_q, b_qt, k_base, v_base, tbl, stride_kb, stride_vb, stride_ks, stride_vs,
            n_lo, full_lo, q_pos, bh, seqlen_k, diag_off, scale_log2, softcap, slope_log2,
            window_left, window_right, dropout_seed, dropout_threshold, dropout_scale, drop_r0, drop_c0,
            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, HEAD_DIM_TAIL, HEAD_DIM_TAIL_PAD,
            V_IS_K, PAGE_SIZE, IS_PAGED, PREFETCH_PAGES, True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, PRECISE_TANH,
            HAS_ALIBI, HAS_DROPOUT, DOT_DTYPE, DOT_PRECISION)
    if not SINGLE_LOOP:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, b_q, b_qt, k_base, v_base, tbl, stride_kb, stride_vb, stride_ks, stride_vs,
            full_lo, full_hi, q_pos, bh, seqlen_k, diag_off, scale_log2, softcap, slope_log2,
            window_left, window_right, dropout_seed, dropout_threshold, dropout_scale, drop_r0, drop_c0,
            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, HEAD_DIM_TAIL, HEAD_DIM_TAIL_PAD,
            V_IS_K, PAGE_SIZE, IS_PAGED, PREFETCH_PAGES, False, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, PRECISE_TANH,
            HAS_ALIBI, HAS_DROPOUT, DOT_DTYPE, DOT_PRECISION)
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, b_q, b_qt, k_base, v_base, tbl, stride_kb, stride_vb, stride_ks, stride_vs,
            full_hi, n_hi, q_pos, bh, seqlen_k, diag_off, scale_log2, softcap, slope_log2,
            window_left, window_right, dropout_seed, dropout_threshold, dropout_scale, drop_r0, drop_c0,
            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, HEAD_DIM_TAIL, HEAD_DIM_TAIL_PAD,
            V_IS_K, PAGE_SIZE, IS_PAGED, PREFETCH_PAGES, True, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, PRECISE_TANH,
            HAS_ALIBI, HAS_DROPOUT, DOT_DTYPE, DOT_PRECISION)

    l_safe, lse = finish_rows(m_i, l_i)  # [BLOCK_M]: rows that saw no key get out 0, lse -inf
    if IS_FP8:
        b_o = acc * (v_scale / l_safe)[:, None]  # [BLOCK_M, HEAD_DIM_V_PAD]
    else:
        b_o = acc / l_safe[:, None]  # [BLOCK_M, HEAD_DIM_V_PAD]

    split = tl.program_id(1).to(tl.int64)
    o_rows = split * stride_o_split + b64 * stride_ob + tok * stride_os + head.to(tl.int64) * stride_oh
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # [HEAD_DIM_V_PAD]
    o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)  # [BLOCK_M, HEAD_DIM_V_PAD]
    tl.store(Out + o_rows[:, None] + offs_dv[None, :], b_o.to(Out.dtype.element_ty), mask=o_mask)
    l_rows = split * stride_l_split + b64 * stride_lb + head.to(tl.int64) * stride_lh + tok * stride_ls
    tl.store(Lse + l_rows, lse, mask=row_ok)

    if MERGE_SPLITS:  # the last split program of the row block merges its rows (module docstring)
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            for r in tl.range(0, MERGE_ROWS, num_stages=1, loop_unroll_factor=MERGE_UNROLL):
                r_pos, r_head = _row_coords(m_start + r, h_grid, GROUP, PACK_GQA)  # [] the row's query and head
                r_tok = (q_start + r_pos).to(tl.int64)
                r_head = r_head.to(tl.int64)
                o_row = b64 * stride_ob + r_tok * stride_os + r_head * stride_oh
                l_row = b64 * stride_lb + r_head * stride_lh + r_tok * stride_ls
                merge_row(Out + o_row, Lse + l_row, MergeOut + o_row, MergeLse + l_row, Sinks, r_head,
                          r_pos < seqlen_q, stride_o_split, stride_l_split, num_splits, HEAD_DIM_V, HEAD_DIM_V_PAD,
                          MERGE_BLOCK_S, HAS_SINK)
            tl.store(Counters + pid, 0)
