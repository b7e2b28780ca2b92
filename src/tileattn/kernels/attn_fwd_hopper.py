"""The forward kernel for Hopper (sm_90), written in Gluon: TMA loads, asynchronous wgmma.

The recurrence is the one of ``attn_fwd.py`` (log2 units, guarded rescale, ``out = acc / l``,
``lse = (m + log2 l) ln 2``); what changes is how the hardware is driven:

* Warp specialisation: one producer warp issues the TMA copies (the bulk tensor copy engine)
  of Q, and of K and V tile by tile, into rings of ``STAGES`` shared-memory buffers; two
  consumer warpgroups of 64 query rows each compute. Each slot has a ``full`` mbarrier (the
  copy landed) and an ``empty`` one (both consumers are done with it); with ``KV_BAR`` (the
  launcher's rule, per head dim) a slot's K and V share them, so a tile costs each consumer one
  wait and one arrival, not two and two (the kernel's docstring). The descriptors are 4-D
  over the (batch, seqlen, heads, head_dim) tensors, so a tile past a sequence's end reads
  zeros, never the next sequence's rows.
* Both matmuls are warpgroup MMAs (wgmma) issued asynchronously; P goes to the second one from
  registers. Each iteration overlaps the softmax of tile j with the P V product of tile j - 1
  (flash-attn 3's intra-warpgroup pipelining):

      issue S_j = Q K_j^T;  issue O += P_{j-1} V_{j-1};  wait for S_j (P V still running)
      softmax of S_j -> P_j, alpha_j;  wait for O;  O *= alpha_j

  With ``S_AHEAD`` (the launcher's rule, per head dim) the tiles go in pairs and the S product runs
  one tile ahead, so that a softmax also overlaps the warpgroup's own next S product
  (``_tiles_s_ahead``).
* Work items (128 query rows of one sequence and head) are walked by each program with a
  stride of the grid size, in the order of ``_work`` (heaviest causal blocks first across a group
  of heads): one program per SM (persistent, the next item's copies overlap the last one's
  epilogue) when items cost the same or the launcher finds the order balanced enough, one
  program per item otherwise. With ``DYNAMIC`` (dense causal calls on a persistent grid) a program
  takes its next item from a per-call atomic counter instead: the next free program gets the next
  item of the order (the kernel's docstring).

Q buffers: with ``Q_BUFS`` = 2 (the launcher's rule, where shared memory has room) each warpgroup has
two Q buffers that successive work items take in turn, so the producer copies the next item's Q, and
queues that item's K/V tiles behind it, while the current item still reads its own; with one, the
producer waits at each item boundary until the last item's Q is released (after its last P V
product, or with ``Q_EARLY`` its last S product) before it issues any copy of the next item.

The output: with ``TMA_STORE`` (dense calls, ``QPACK`` 1, one split: the launcher's rule) each
consumer warpgroup writes its normalised tile to a shared-memory staging tile of its own and hands it
to the copy engine (one bulk copy, clipped at ``seqlen_q`` by the descriptor's bounds), waiting for
that copy only before its next item's epilogue writes the tile again; otherwise each thread stores its
accumulator fragments to global memory. The lse is stored from registers either way.

Masks: the key tiles of a query block fall into the three ranges of ``attn_fwd.py`` (left window
edge, fully visible, diagonal / right edge / past ``seqlen_k``); one loop walks them and applies
the mask only on tiles outside the fully visible range (a uniform branch per tile).

Features: dense and packed (varlen) batches, causal and sliding windows (bottom-right
aligned), GQA/MQA, head dims 64, 128 and 256, fp16/bf16, learnable sinks. Everything else runs on the portable
kernel; the launcher (``tileattn.gpu.hopper``) decides per call.

Three flags serve a call with few query rows per head over many keys (a cascade's shared prefix:
every request's query row over one prompt):

* ``QPACK`` (a divisor of ``GROUP``): the ``QPACK`` query heads that share a KV head are packed
  as the rows of one work item, row i being query row i // QPACK of head h QPACK + i % QPACK
  (a 5-D Q descriptor, box [ROWS_WG / QPACK, 1, QPACK, D]), so each K/V tile serves them all.
* ``NUM_SPLITS`` > 1 (runtime): each work item takes ``tiles_per_split`` key tiles of its
  sequence and writes its partial state (out normalised by its own sum, fp32, and its lse) to
  split ``s`` of the outputs; the caller merges them (``combine.py``'s kernel).
* ``PAGE`` > 0: K and V live in a paged pool (num_blocks, PAGE, heads_k, D); the producer reads
  each tile's block ids from ``BlockTable`` and copies one page (or one tile of a larger page)
  per TMA copy into the ring slot; ``SequsedK`` gives each sequence's key count. Ids past the
  table are sent out of the pool's bounds, which TMA fills with zeros; the rows of a sequence's
  last page past its keys may hold anything (NaN), so that tile's V rows there are zeroed before
  its P V product.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import LOG2E, finish_rows, online_rescale, visible_in_tile, visible_mask

# The shared jit helpers of common.py, compiled for Gluon (the same source serves both).
_online_rescale = gluon.jit(online_rescale.fn)
_finish_rows = gluon.jit(finish_rows.fn)
_visible_mask = gluon.jit(visible_mask.fn)
_visible_in_tile = gluon.jit(visible_in_tile.fn)


ROWS_WG: gl.constexpr = gl.constexpr(64)  # query rows per consumer warpgroup (a block is two)
OUT_OF_POOL: gl.constexpr = gl.constexpr(2**30)  # a page id past any pool: TMA reads zeros


@gluon.jit
def _tile_range(m_start, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, seqlen_q, seqlen_k, window_left,
                window_right, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """(n_lo, full_lo, full_hi, n_hi): the key tiles query rows m_start.. may see, and the fully
    visible, complete ones among them (the same bounds as attn_fwd.py)."""
    diag_off = seqlen_k - seqlen_q
    q_first = m_start
    q_last = gl.minimum(m_start + BLOCK_M - 1, seqlen_q - 1)
    key_lo = 0
    key_hi = seqlen_k
    full_lo_key = 0
    full_hi_key = seqlen_k
    if MASK_LEFT:
        key_lo = gl.maximum(q_first + diag_off - window_left, 0)
        full_lo_key = gl.maximum(q_last + diag_off - window_left, 0)
    if MASK_RIGHT:
        key_hi = gl.maximum(gl.minimum(q_last + diag_off + window_right + 1, seqlen_k), 0)
        full_hi_key = gl.maximum(gl.minimum(q_first + diag_off + window_right + 1, seqlen_k), 0)
    n_lo = key_lo // BLOCK_N
    n_hi = gl.maximum(gl.cdiv(key_hi, BLOCK_N), n_lo)
    full_lo = gl.maximum(gl.minimum(gl.cdiv(full_lo_key, BLOCK_N), n_hi), n_lo)
    full_hi = gl.minimum(gl.maximum(full_hi_key // BLOCK_N, full_lo), n_hi)
    return n_lo, full_lo, full_hi, n_hi


@gluon.jit
def _wait_tile(bars, ring, c, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               WAIT: gl.constexpr = True):
    """Wait for the ring's ``c``-th copy (counted over the program's whole run); its buffer as
    a [BLOCK_N, HEAD_DIM] matrix. ``WAIT`` False: the buffer alone (with ``KV_BAR`` a V tile, which
    landed in the ``k_full`` phase waited for before its K tile's S product)."""
    if WAIT:
        mbarrier.wait(bars.index(c % STAGES), (c // STAGES) & 1)
    return ring.index(c % STAGES).reshape([BLOCK_N, HEAD_DIM])


@gluon.jit
def _sequence(CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, IS_VARLEN: gl.constexpr):
    """(q_start, k_start, seqlen_q, seqlen_k, b_desc) of sequence ``b``: with ``IS_VARLEN`` its
    first packed rows and lengths from the cu_seqlens, and batch 0 for the descriptors (which
    see the packed tensors as batch 1); else row 0, the lengths given and batch ``b``."""
    if IS_VARLEN:
        q_start = gl.load(CuSeqlensQ + b)
        seqlen_q = gl.load(CuSeqlensQ + b + 1) - q_start
        k_start = gl.load(CuSeqlensK + b)
        seqlen_k = gl.load(CuSeqlensK + b + 1) - k_start
        b_desc = 0
    else:
        q_start = 0
        k_start = 0
        b_desc = b
    return q_start, k_start, seqlen_q, seqlen_k, b_desc


@gluon.jit
def _work(w, geom, GROUP: gl.constexpr, QPACK: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr,
          HAS_SEQUSED: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """Work item ``w`` of the grid: a query block (in packed rows, ``QPACK`` per query) of one key
    split of one work head ``h`` (a query head, or with ``QPACK`` a group of them). The (sequence,
    head, split) triples are taken ``group`` at a time; within a group the items run heaviest
    causal blocks first across its triples (block ``num_m_blocks - 1`` of each, then the next),
    so the grid's last items are light ones, and ``group`` is small enough for the group's keys
    and values to stay in L2. Every partition calls this and walks the same items. Returns (b, h,
    hk, split, m_start, q_start, k_start, seqlen_q, seqlen_k, b_desc, n_lo, n_hi, valid); a packed
    sequence shorter than the block's start is not valid, a split past its sequence's keys has
    no tiles."""
    CuSeqlensQ, CuSeqlensK, SequsedK, batch, nheads, seqlen_q, seqlen_k, window_left, window_right, num_splits, \
        tiles_per_split, group = geom
    heads = nheads // QPACK
    num_m_blocks = gl.cdiv(seqlen_q * QPACK, 2 * ROWS_WG)
    first = w // (group * num_m_blocks) * group  # the group's first triple
    size = gl.minimum(group, batch * heads * num_splits - first)  # the last group may be smaller
    r = w - first * num_m_blocks
    m_start = (num_m_blocks - 1 - r // size) * (2 * ROWS_WG)
    rest = first + r % size
    split = rest % num_splits
    bh = rest // num_splits
    b = bh // heads
    h = bh % heads
    q_start, k_start, seqlen_q, seqlen_k, b_desc = _sequence(CuSeqlensQ, CuSeqlensK, b, seqlen_q, seqlen_k, IS_VARLEN)
    if HAS_SEQUSED:
        seqlen_k = gl.load(SequsedK + b)
    n_lo, _, _, n_hi = _tile_range(m_start // QPACK, 2 * ROWS_WG // QPACK, BLOCK_N, seqlen_q, seqlen_k, window_left,
                                   window_right, MASK_LEFT, MASK_RIGHT)
    n_lo = gl.maximum(n_lo, split * tiles_per_split)
    n_hi = gl.maximum(gl.minimum(n_hi, (split + 1) * tiles_per_split), n_lo)
    return (b, h, h // (GROUP // QPACK), split, m_start, q_start, k_start, seqlen_q, seqlen_k, b_desc, n_lo, n_hi,
            m_start < seqlen_q * QPACK)


@gluon.jit
def _copy_kv(desc, ring, bar, slot, b, b_desc, hk, k_start, t, BlockTable, stride_tb, table_len,
             BLOCK_N: gl.constexpr, PAGE: gl.constexpr, EXPECT: gl.constexpr = True):
    """Issue the TMA copies of key tile ``t`` (K or V, by ``desc``) into ring slot ``slot``,
    completing on ``bar``: one copy of the dense tile, or one per page (``PAGE`` keys each,
    or one tile of a larger page) with the page ids read from the block table. ``EXPECT``: after
    the ``expect`` of their bytes (else the caller's: with ``KV_BAR`` one for K's and V's copies;
    a page past the table counts its bytes all the same, TMA fills them with zeros)."""
    if EXPECT:
        mbarrier.expect(bar, desc.block_type.nbytes * (BLOCK_N // desc.block_type.shape[1]))
    if PAGE > 0:
        PAGE_ROWS: gl.constexpr = desc.block_type.shape[1]
        for i in gl.static_range(BLOCK_N // PAGE_ROWS):
            key = t * BLOCK_N + i * PAGE_ROWS
            idx = key // PAGE
            block = gl.load(BlockTable + b.to(gl.int64) * stride_tb + idx, mask=idx < table_len, other=OUT_OF_POOL)
            tma.async_copy_global_to_shared(desc, [block, key % PAGE, hk, 0], bar,
                                            ring.index(slot).slice(i * PAGE_ROWS, PAGE_ROWS, dim=1))
    else:
        tma.async_copy_global_to_shared(desc, [b_desc, k_start + t * BLOCK_N, hk, 0], bar, ring.index(slot))


@gluon.jit
def _zero_rows_from(tile, first, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Zero rows ``first``.. of the [BLOCK_N, HEAD_DIM] shared tile (16 rows at a time, only the
    chunks that hold such rows), then fence them for the tensor cores' reads. Both consumer
    warpgroups may do it on the same tile: they write the same values."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    for i in gl.static_range(BLOCK_N // 16):
        if (i + 1) * 16 > first:
            chunk = tile.slice(i * 16, 16, dim=0)
            rows = i * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
            vals = chunk.load(layout)
            chunk.store(gl.where((rows < first)[:, None], vals, gl.zeros_like(vals)))
    fence_async_shared()


@gluon.jit
def _softmax_tile(s, m_i, l_i, t, q_pos, masked, seqlen_k, diag_off, scale_log2, window_left, window_right,
                  BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                  s_layout: gl.constexpr):
    """One online-softmax step on the raw scores ``s`` [BLOCK_M, BLOCK_N] of key tile ``t``.

    Returns (p, m_new, l_new, alpha); ``m`` is in log2 units (scaled), ``s`` stays raw until the
    exponent, where the scale and the subtraction are one FMA (the scale is positive, so the
    row maximum of the raw scores is the maximum of the scaled ones). ``masked`` (a per-tile
    scalar) applies the window and ``seqlen_k`` bounds."""
    if masked:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N] the tile's columns
        seen = _visible_in_tile(q_pos, cols, t * BLOCK_N, seqlen_k, diag_off, window_left, window_right,
                                MASK_LEFT, MASK_RIGHT)  # [BLOCK_M, BLOCK_N]
        s = gl.where(seen, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)  # [BLOCK_M]
    m_use, alpha = _online_rescale(m_i, m_new, True)
    x = s * scale_log2 - m_use[:, None]  # [BLOCK_M, BLOCK_N] log2 of p, <= 0
    p = gl.exp2(x)  # [BLOCK_M, BLOCK_N]
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _post_index(slots, at, w, work):
    """Write work item index ``w`` and its place ``work`` = (b, h, split, m_start, seqlen_k, n_lo, n_hi)
    into slot ``at`` (``slots``' rows 8 at .. 8 at + 7, int32 [1] each: a slot per Q buffer and warpgroup),
    from the producer's one warp, which has worked them out for its copies: the consumers then skip
    ``_work``'s divisions, which sit between an item's last P V product and its next S product. Every lane
    writes them, and the warp's barrier orders all lanes' writes before the mbarrier arrive (a release)
    that follows. ``work`` None: the end index alone."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slots.index(8 * at).store(gl.full([1], w, gl.int32, layout=layout))
    if work is not None:
        for k in gl.static_range(7):
            slots.index(8 * at + k + 1).store(gl.full([1], work[k], gl.int32, layout=layout))
    gl.thread_barrier()


@gluon.jit
def _read_scalar(slot):
    """The int32 in the [1] shared ``slot``, read by every thread of a consumer warpgroup."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(slot.load(layout), axis=0)


@gluon.jit
def _read_index(slots, at):
    """The work item index and its place in slot ``at`` (``_post_index``), read by a consumer warpgroup
    after the wait on the barrier phase that the producer's post released: (w, (b, h, split, m_start,
    seqlen_k, n_lo, n_hi)); at the end index the place is whatever the slot held."""
    return _read_scalar(slots.index(8 * at)), (
        _read_scalar(slots.index(8 * at + 1)), _read_scalar(slots.index(8 * at + 2)),
        _read_scalar(slots.index(8 * at + 3)), _read_scalar(slots.index(8 * at + 4)),
        _read_scalar(slots.index(8 * at + 5)), _read_scalar(slots.index(8 * at + 6)),
        _read_scalar(slots.index(8 * at + 7)))


@gluon.jit
def _load_item(w, c, j, q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, bars, geom, BlockTable, stride_tb, table_len,
               slots, GROUP: gl.constexpr, QPACK: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr,
               MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
               DYNAMIC: gl.constexpr, Q_BUFS: gl.constexpr, KV_BAR: gl.constexpr):
    """The producer's copies of work item ``w``: the two warpgroups' Q tiles into the item's pair of
    Q buffers (with ``DYNAMIC`` the index ``w`` and the item's place posted to each warpgroup's slot
    first), then K and V tile by tile. ``c``: K/V copies issued so far, ``j``: items loaded so far;
    returns them updated. ``KV_BAR``: a tile's K and V wait for the slot's one ``k_empty`` phase and
    complete one ``k_full`` phase, whose ``expect`` counts both copies' bytes (the kernel's docstring)."""
    q_full, q_empty, k_full, v_full, k_empty, v_empty = bars
    BLOCK_N: gl.constexpr = k_ring.type.shape[2]
    b, h, hk, split, m_start, q_start, k_start, seqlen_q, seqlen_k, b_desc, n_lo, n_hi, valid = _work(
        w, geom, GROUP, QPACK, BLOCK_N, IS_VARLEN, HAS_SEQUSED, MASK_LEFT, MASK_RIGHT)
    if valid:
        qb, q_phase = _q_buffers(j, Q_BUFS)
        for wg in gl.static_range(2):
            mbarrier.wait(q_empty.index(qb + wg), q_phase ^ 1)
            if DYNAMIC:  # the item's index and place, read by the warpgroup once this phase completes
                _post_index(slots, qb + wg, w, (b, h, split, m_start, seqlen_k, n_lo, n_hi))
            mbarrier.expect(q_full.index(qb + wg), q_desc.block_type.nbytes)
            if QPACK > 1:  # rows (query, head of the group) of the 5-D view (B, S, H_k, QPACK, D)
                tma.async_copy_global_to_shared(q_desc, [b_desc, q_start + (m_start + wg * ROWS_WG) // QPACK, h,
                                                         0, 0], q_full.index(qb + wg), q_smem.index(qb + wg))
            else:
                tma.async_copy_global_to_shared(q_desc, [b_desc, q_start + m_start + wg * ROWS_WG, h, 0],
                                                q_full.index(qb + wg), q_smem.index(qb + wg))
        for t in range(n_lo, n_hi):
            slot = c % STAGES
            phase = (c // STAGES) & 1
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            if KV_BAR:  # the slot's K and V are free: both copies complete one phase of k_full
                mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes * (BLOCK_N // k_desc.block_type.shape[1])
                                + v_desc.block_type.nbytes * (BLOCK_N // v_desc.block_type.shape[1]))
                _copy_kv(k_desc, k_ring, k_full.index(slot), slot, b, b_desc, hk, k_start, t, BlockTable, stride_tb,
                         table_len, BLOCK_N, PAGE, False)
                _copy_kv(v_desc, v_ring, k_full.index(slot), slot, b, b_desc, hk, k_start, t, BlockTable, stride_tb,
                         table_len, BLOCK_N, PAGE, False)
            else:
                _copy_kv(k_desc, k_ring, k_full.index(slot), slot, b, b_desc, hk, k_start, t, BlockTable, stride_tb,
                         table_len, BLOCK_N, PAGE)
                mbarrier.wait(v_empty.index(slot), phase ^ 1)
                _copy_kv(v_desc, v_ring, v_full.index(slot), slot, b, b_desc, hk, k_start, t, BlockTable, stride_tb,
                         table_len, BLOCK_N, PAGE)
            c += 1
        j += 1
    return c, j


@gluon.jit
def _q_buffers(j, Q_BUFS: gl.constexpr):
    """(first Q buffer, barrier phase) of a program's ``j``-th work item: with ``Q_BUFS`` pairs of Q
    buffers (one buffer per consumer warpgroup in a pair) item j takes pair j % Q_BUFS, at the
    (j // Q_BUFS)-th phase of that pair's barriers."""
    return (j % Q_BUFS) * 2, (j // Q_BUFS) & 1


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, bars, geom, BlockTable, stride_tb, table_len, slots,
              Counter, GROUP: gl.constexpr, QPACK: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
              DYNAMIC: gl.constexpr, Q_BUFS: gl.constexpr, KV_BAR: gl.constexpr):
    """The load warp: for each work item, the two warpgroups' Q tiles, then K and V tile by tile.

    A buffer is refilled once its consumers have arrived on its ``empty`` barrier (a fresh
    barrier counts as having completed the phase before its first, so round 0 starts at once);
    the copies for the next item start while the consumers finish the current one. With ``KV_BAR``
    a slot's K and V copies wait for its one ``k_empty`` phase and complete one ``k_full`` phase
    together (``_load_item``).

    ``DYNAMIC``: the first item is the program's id; the next one is fetched (``P + atomic_add(Counter,
    1)``) once the current item's last K/V copy is issued, STAGES tiles before the consumers finish
    it, so the atomic's latency hides behind those tiles, and its index and place go to each warpgroup's
    slot before the phase of its ``q_full`` that starts the item. An index past the items ends the loop:
    after the last item's Q is released, the end index is posted (alone) and ``q_full`` arrived on
    without a copy (the kernel's docstring)."""
    q_full, q_empty = bars[0], bars[1]
    batch, nheads, seqlen_q, num_splits = geom[3], geom[4], geom[5], geom[9]
    items = gl.cdiv(seqlen_q * QPACK, 2 * ROWS_WG) * batch * (nheads // QPACK) * num_splits
    c = 0  # K/V copies issued so far
    j = 0  # work items loaded so far
    if DYNAMIC:
        w = gl.program_id(0)
        while w < items:
            c, j = _load_item(w, c, j, q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, bars, geom, BlockTable,
                              stride_tb, table_len, slots, GROUP, QPACK, IS_VARLEN, HAS_SEQUSED, MASK_LEFT,
                              MASK_RIGHT, PAGE, STAGES, DYNAMIC, Q_BUFS, KV_BAR)
            w = gl.num_programs(0) + gl.atomic_add(Counter, 1, sem="relaxed")  # the next free item
        qb, q_phase = _q_buffers(j, Q_BUFS)
        for wg in gl.static_range(2):  # the end: an index past the items, its phase completed without a copy
            mbarrier.wait(q_empty.index(qb + wg), q_phase ^ 1)
            _post_index(slots, qb + wg, w, None)
            mbarrier.arrive(q_full.index(qb + wg), count=1)
    else:
        for w in range(gl.program_id(0), items, gl.num_programs(0)):
            c, j = _load_item(w, c, j, q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, bars, geom, BlockTable,
                              stride_tb, table_len, slots, GROUP, QPACK, IS_VARLEN, HAS_SEQUSED, MASK_LEFT,
                              MASK_RIGHT, PAGE, STAGES, DYNAMIC, Q_BUFS, KV_BAR)


@gluon.jit
def _ahead_step(q_tile, s_zero, k_ring, bars, s, m_i, l_i, t, off, full_lo, full_hi, q_pos, seqlen_k,
                diag_off, scale_log2, window_left, window_right, STAGES: gl.constexpr, MASK_LEFT: gl.constexpr,
                MASK_RIGHT: gl.constexpr):
    """``_tiles_s_ahead``'s step t: issue S_t (waited for by the caller), then the softmax of ``s``
    (S_{t-1}) while it runs. Returns (S_t in flight, P_{t-1}, m_i, l_i, alpha)."""
    k_full = bars[2]
    HEAD_DIM: gl.constexpr = k_ring.type.shape[4]
    BLOCK_N: gl.constexpr = k_ring.type.shape[2]
    s_layout: gl.constexpr = s_zero.type.layout
    k_tile = _wait_tile(k_full, k_ring, t + off, STAGES, BLOCK_N, HEAD_DIM)
    s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # S_t
    masked = (t - 1 < full_lo) | (t - 1 >= full_hi)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, t - 1, q_pos, masked, seqlen_k, diag_off, scale_log2,
                                       window_left, window_right, BLOCK_N, MASK_LEFT, MASK_RIGHT, s_layout)
    return s_tok, p, m_i, l_i, alpha


@gluon.jit
def _tiles_s_ahead(q_tile, s_zero, k_ring, v_ring, bars, q_buf, o, m_i, l_i, n_lo, n_hi, off, full_lo, full_hi, q_pos,
                   seqlen_k, diag_off, scale_log2, window_left, window_right, STAGES: gl.constexpr,
                   MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, PAGE: gl.constexpr, IS_VARLEN: gl.constexpr,
                   Q_EARLY: gl.constexpr, KV_BAR: gl.constexpr):
    """Key tiles n_lo .. n_hi - 1 (n_hi > n_lo; tile t is the rings' copy t + off), after the first in
    pairs (t, t + 1), the S product one tile ahead of the softmax. Step t issues S_t and computes the
    softmax of S_{t-1} while S_t runs; in a pair's second step P_{t-1} V_{t-1} runs too, waited for
    only after that softmax. Every wgmma is waited for within its pair (ptxas serialises all of them
    when an accumulator stays in flight across the loop's back edge: docs/perf-notes.md, 2026-12-02
    04:07). The same operations on every value as ``_consume_item``'s loop (and one more: O, still
    zero, times tile n_lo's alpha, which is finite: +0), so bitwise the same outputs.

    With an odd number of tiles after the first, the last pair is tile t alone: its second step is
    skipped (a uniform branch), P_{t-1} V_{t-1} is waited for there, and S_t goes to the item's last
    softmax below. One loop body serves both cases, so the item's code holds three softmax bodies, not
    four (hdim 64 causal, compiled for sm_90: 6,272 -> 5,160 instructions; perf-notes 2026-12-02 10:00).

    ``KV_BAR``: a pair's mbarrier operations are 2 waits (k_full of t and t + 1) and 2 arrivals
    (k_empty of t - 1 and t, each after its P V product) instead of 4 and 4. Triton's shared-memory
    barrier analysis puts a warpgroup barrier (``bar.sync``) between two consecutive mbarrier
    operations of a partition unless both are waits, and also between a wgmma (a shared-memory
    read) and a later wait, and between an arrival and a later wgmma: compiled for sm_90 the loop
    has 7 per pair without the flag, 5 with it (before the wait for K_t, the wait for K_{t+1}, the
    arrival for t - 1, the P_t V_t product and the arrival for t). A tile's K is then held until
    its P V product, one tile longer: at the wait for K_{t+1} the slots of t - 1 (P_{t-1} V_{t-1}
    still running) and t are held, so the producer can have issued copy t + 1 only with STAGES >= 3
    (with 2 it would wait for slot t - 1, which this warpgroup releases only after that wait: a
    deadlock).
    Returns (o, m_i, l_i)."""
    # waiting for K_{t+1} while V_{t-1} is still held needs the producer two V copies ahead
    gl.static_assert(STAGES >= 2, "S_AHEAD holds two V copies while it waits for the next K copy")
    gl.static_assert(STAGES >= 3 or not KV_BAR, "S_AHEAD with KV_BAR holds two slots while it waits for the next")
    q_empty, k_full, v_full, k_empty, v_empty = bars[1], bars[2], bars[3], bars[4], bars[5]
    HEAD_DIM: gl.constexpr = k_ring.type.shape[4]
    BLOCK_N: gl.constexpr = k_ring.type.shape[2]
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = s_zero.type.layout
    o_layout: gl.constexpr = o.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    k_tile = _wait_tile(k_full, k_ring, n_lo + off, STAGES, BLOCK_N, HEAD_DIM)
    s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False)
    if not KV_BAR:  # (with it, the slot is released after P V)
        mbarrier.arrive(k_empty.index((n_lo + off) % STAGES), count=1)
    for t in range(n_lo + 1, n_hi, 2):  # tiles t and t + 1 (in the last pair t alone when t + 1 is n_hi)
        s_tok, p, m_i, l_i, alpha = _ahead_step(q_tile, s_zero, k_ring, bars, s, m_i, l_i, t, off, full_lo,
                                                full_hi, q_pos, seqlen_k, diag_off, scale_log2, window_left,
                                                window_right, STAGES, MASK_LEFT, MASK_RIGHT)
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        v_tile = _wait_tile(v_full, v_ring, t - 1 + off, STAGES, BLOCK_N, HEAD_DIM, not KV_BAR)
        o_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, o, is_async=True)  # P_{t-1} V_{t-1}
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # S_t done, P_{t-1} V_{t-1} may run on
        if not KV_BAR:
            mbarrier.arrive(k_empty.index((t + off) % STAGES), count=1)
        if t + 1 < n_hi:
            s_tok, p, m_i, l_i, alpha = _ahead_step(q_tile, s_zero, k_ring, bars, s, m_i, l_i, t + 1, off,
                                                    full_lo, full_hi, q_pos, seqlen_k, diag_off, scale_log2,
                                                    window_left, window_right, STAGES, MASK_LEFT, MASK_RIGHT)
            o = warpgroup_mma_wait(num_outstanding=1, deps=(o_tok,))  # P_{t-1} V_{t-1} done, S_{t+1} may run on
            mbarrier.arrive(v_empty.index((t - 1 + off) % STAGES), count=1)
            o = o * gl.convert_layout(alpha, row_o)[:, None]
            v_tile = _wait_tile(v_full, v_ring, t + off, STAGES, BLOCK_N, HEAD_DIM, not KV_BAR)
            o_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, o, is_async=True)  # P_t V_t
            s, o = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, o_tok))
            if not KV_BAR:
                mbarrier.arrive(k_empty.index((t + 1 + off) % STAGES), count=1)
            mbarrier.arrive(v_empty.index((t + off) % STAGES), count=1)
        else:  # t is the item's last tile (below); S_t is done
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            mbarrier.arrive(v_empty.index((t - 1 + off) % STAGES), count=1)
    if Q_EARLY:  # the item's last S product has completed
        mbarrier.arrive(q_empty.index(q_buf), count=1)
    masked = (n_hi - 1 < full_lo) | (n_hi - 1 >= full_hi)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, n_hi - 1, q_pos, masked, seqlen_k, diag_off, scale_log2,
                                       window_left, window_right, BLOCK_N, MASK_LEFT, MASK_RIGHT, s_layout)
    o = o * gl.convert_layout(alpha, row_o)[:, None]
    v_tile = _wait_tile(v_full, v_ring, n_hi - 1 + off, STAGES, BLOCK_N, HEAD_DIM, not KV_BAR)
    if PAGE > 0 or IS_VARLEN:  # as in _consume_item: the sequence's last tile's rows past its keys
        if n_hi * BLOCK_N > seqlen_k:
            _zero_rows_from(v_tile, seqlen_k - (n_hi - 1) * BLOCK_N, BLOCK_N, HEAD_DIM)
    o = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, o)
    mbarrier.arrive(v_empty.index((n_hi - 1 + off) % STAGES), count=1)
    return o, m_i, l_i


@gluon.jit
def _consume_item(w, work, c, j, WG: gl.constexpr, q_smem, s_zero, k_ring, v_ring, bars, geom, o_desc, o_stage, Out,
                  Lse, Sink, stride_ob, stride_os, stride_oh, stride_osplit, stride_lb, stride_lh, stride_ls,
                  stride_lsplit, scale_log2, GROUP: gl.constexpr, QPACK: gl.constexpr, IS_VARLEN: gl.constexpr,
                  HAS_SEQUSED: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
                  PAGE: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr, Q_EARLY: gl.constexpr,
                  Q_BUFS: gl.constexpr, S_AHEAD: gl.constexpr, KV_BAR: gl.constexpr, WAIT_Q: gl.constexpr):
    """Work item ``w`` for warpgroup ``WG`` (``_consumer``): ``c`` K/V copies and ``j`` items consumed
    before it; returns them updated. ``WAIT_Q``: wait here for the item's Q (else the caller has).
    ``work``: the item's place as the producer posted it (``_post_index``; ``DYNAMIC``, whose calls are
    dense), or None: worked out here (``_work``).

    ``S_AHEAD`` (the launcher's rule, per head dim): the key tiles in pairs, the S product one tile
    ahead of the softmax (``_tiles_s_ahead``).

    ``KV_BAR`` (the launcher's rule, per head dim): a slot's K and V share its ``k_full`` and ``k_empty``
    barriers. The warpgroup waits on ``k_full`` before a tile's S product, as without the flag, but not
    again before its P V product (the same phase brought V: ``_wait_tile`` without the wait), and
    arrives on ``k_empty`` once per tile, after its P V product has completed (where V's arrival is
    without the flag: the kernel's ``bars`` bind ``v_empty`` to ``k_empty``), instead of once on K's
    after the S product and once on V's after P V. In this loop a tile's mbarrier operations are then one wait and one
    arrival (two and two without; compiled for sm_90, 2 warpgroup barriers a tile instead of 3). At
    the wait for K_t the slot of t - 1 is still held (its P V product is issued after that wait), as
    V's is without the flag: STAGES >= 2. The flag's branches are constexpr and leave the calls as
    they were, so without it the kernel compiles to the same machine code as before the flag."""
    q_full, q_empty, k_full, v_full, k_empty, v_empty = bars
    window_left, window_right = geom[7], geom[8]
    HEAD_DIM: gl.constexpr = k_ring.type.shape[4]
    BLOCK_N: gl.constexpr = k_ring.type.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    qb, q_phase = _q_buffers(j, Q_BUFS)
    q_tile = q_smem.index(qb + WG).reshape([ROWS_WG, HEAD_DIM])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if work is None:
        b, h, hk, split, m_start, q_start, k_start, seqlen_q, seqlen_k, b_desc, n_lo, n_hi, valid = _work(
            w, geom, GROUP, QPACK, BLOCK_N, IS_VARLEN, HAS_SEQUSED, MASK_LEFT, MASK_RIGHT)
    else:  # dense: sequence b from row 0 (_sequence), every posted item valid
        gl.static_assert(not IS_VARLEN, "posted places are for dense calls")
        b, h, split, m_start, seqlen_k, n_lo, n_hi = work
        q_start, seqlen_q, b_desc, valid = 0, geom[5], b, True
    if valid:
        m_start = m_start + WG * ROWS_WG  # in packed rows
        _, full_lo, full_hi, _ = _tile_range(m_start // QPACK, ROWS_WG // QPACK, BLOCK_N, seqlen_q, seqlen_k,
                                             window_left, window_right, MASK_LEFT, MASK_RIGHT)
        diag_off = seqlen_k - seqlen_q
        rows_s = m_start + gl.arange(0, ROWS_WG, layout=row_s)  # [ROWS_WG] packed rows
        q_pos = rows_s // QPACK  # [ROWS_WG] query positions
        if HAS_SINK:
            m_i = gl.load(Sink + h * QPACK + rows_s % QPACK) * LOG2E  # [ROWS_WG] each row's head's sink
            l_i = gl.full([ROWS_WG], 1.0, gl.float32, layout=row_s)
        else:
            m_i = gl.full([ROWS_WG], float("-inf"), gl.float32, layout=row_s)  # running max, log2 units
            l_i = gl.zeros([ROWS_WG], gl.float32, layout=row_s)  # running sum
        o = gl.zeros([ROWS_WG, HEAD_DIM], gl.float32, layout=o_layout)  # [ROWS_WG, HEAD_DIM]
        off = c - n_lo  # tile t of this item is the ring's copy t + off
        if WAIT_Q:  # (DYNAMIC: the caller waited, to read the item's index)
            mbarrier.wait(q_full.index(qb + WG), q_phase)
        if S_AHEAD and n_hi > n_lo:
            o, m_i, l_i = _tiles_s_ahead(q_tile, s_zero, k_ring, v_ring, bars, qb + WG, o, m_i, l_i, n_lo, n_hi, off,
                                         full_lo, full_hi, q_pos, seqlen_k, diag_off, scale_log2, window_left,
                                         window_right, STAGES, MASK_LEFT, MASK_RIGHT, PAGE, IS_VARLEN, Q_EARLY,
                                         KV_BAR)
        elif n_hi > n_lo:
            # Tile n_lo alone: its scores and softmax; its P V product is issued in the loop.
            k_tile = _wait_tile(k_full, k_ring, n_lo + off, STAGES, BLOCK_N, HEAD_DIM)
            s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False)
            if not KV_BAR:  # (with it, the slot is released after P V)
                mbarrier.arrive(k_empty.index((n_lo + off) % STAGES), count=1)
            masked = (n_lo < full_lo) | (n_lo >= full_hi)
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, n_lo, q_pos, masked, seqlen_k, diag_off, scale_log2,
                                               window_left, window_right, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                                               s_layout)
            for t in range(n_lo + 1, n_hi):
                k_tile = _wait_tile(k_full, k_ring, t + off, STAGES, BLOCK_N, HEAD_DIM)
                s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                v_tile = _wait_tile(v_full, v_ring, t - 1 + off, STAGES, BLOCK_N, HEAD_DIM, not KV_BAR)
                p_op = gl.convert_layout(p.to(dtype), p_layout)  # [ROWS_WG, BLOCK_N] A operand in registers
                o_tok = warpgroup_mma(p_op, v_tile, o, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # S_t ready, P V still running
                if not KV_BAR:
                    mbarrier.arrive(k_empty.index((t + off) % STAGES), count=1)
                masked = (t < full_lo) | (t >= full_hi)
                p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, t, q_pos, masked, seqlen_k, diag_off, scale_log2,
                                                   window_left, window_right, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                                                   s_layout)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
                mbarrier.arrive(v_empty.index((t - 1 + off) % STAGES), count=1)
                o = o * gl.convert_layout(alpha, row_o)[:, None]
            if Q_EARLY:  # Q's last reader, the last S product, has completed: the producer may load
                # the next item's Q, and the K/V tiles it queues behind it, during this item's last
                # P V product and epilogue
                mbarrier.arrive(q_empty.index(qb + WG), count=1)
            v_tile = _wait_tile(v_full, v_ring, n_hi - 1 + off, STAGES, BLOCK_N, HEAD_DIM, not KV_BAR)
            if PAGE > 0 or IS_VARLEN:
                # the sequence's last tile: its rows past the keys are a page's other slots or the next
                # packed sequence's keys, whose P is 0 but whose V may hold inf or NaN (0 x inf = NaN)
                if n_hi * BLOCK_N > seqlen_k:
                    _zero_rows_from(v_tile, seqlen_k - (n_hi - 1) * BLOCK_N, BLOCK_N, HEAD_DIM)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o = warpgroup_mma(p_op, v_tile, o)
            mbarrier.arrive(v_empty.index((n_hi - 1 + off) % STAGES), count=1)
        elif Q_EARLY:  # no key tile read Q
            mbarrier.arrive(q_empty.index(qb + WG), count=1)
        if not Q_EARLY:
            mbarrier.arrive(q_empty.index(qb + WG), count=1)  # the producer may load the next item's Q
        c += n_hi - n_lo
        j += 1

        l_safe, lse = _finish_rows(m_i, l_i)  # [ROWS_WG]: rows that saw no key (and no sink) get out 0, lse -inf
        o = o / gl.convert_layout(l_safe, row_o)[:, None]
        if TMA_STORE:  # dense rows: q_start is 0, b_desc is b; rows past seqlen_q are clipped by the copy
            tma.store_wait(0)  # the previous item's copy has read the staging tile
            gl.thread_barrier()
            o_stage.reshape([ROWS_WG, HEAD_DIM]).store(o.to(o_desc.dtype))  # [ROWS_WG, HEAD_DIM]
            fence_async_shared()
            gl.thread_barrier()  # the whole tile stored before the (single-thread) bulk copy
            tma.async_copy_shared_to_global(o_desc, [b_desc, m_start, h, 0], o_stage)
        else:
            rows_o = m_start + gl.arange(0, ROWS_WG, layout=row_o)  # [ROWS_WG] packed rows
            cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))  # [HEAD_DIM]
            o_base = Out + split.to(gl.int64) * stride_osplit + b.to(gl.int64) * stride_ob
            o_row = (q_start + rows_o // QPACK).to(gl.int64) * stride_os + (h * QPACK + rows_o % QPACK) * stride_oh
            gl.store(o_base + o_row[:, None] + cols_o[None, :], o.to(Out.dtype.element_ty),
                     mask=(rows_o // QPACK < seqlen_q)[:, None])  # [ROWS_WG, HEAD_DIM]
        l_base = Lse + split.to(gl.int64) * stride_lsplit + b.to(gl.int64) * stride_lb
        l_row = (q_start + q_pos).to(gl.int64) * stride_ls + (h * QPACK + rows_s % QPACK) * stride_lh
        gl.store(l_base + l_row, lse, mask=q_pos < seqlen_q)
    return c, j



@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, k_ring, v_ring, bars, geom, o_desc, o_stages, Out, Lse, Sink, stride_ob,
              stride_os, stride_oh, stride_osplit, stride_lb, stride_lh, stride_ls, stride_lsplit, scale_log2, slots,
              GROUP: gl.constexpr, QPACK: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, PAGE: gl.constexpr,
              STAGES: gl.constexpr, TMA_STORE: gl.constexpr, Q_EARLY: gl.constexpr, DYNAMIC: gl.constexpr,
              Q_BUFS: gl.constexpr, S_AHEAD: gl.constexpr, KV_BAR: gl.constexpr):
    """One warpgroup: for each work item, the recurrence for its 64 query rows (rows
    [64 WG, 64 WG + 64) of the block) over every key tile of the block (of its split).

    ``HAS_SINK``: the head's learnable sink (a logit without a value) starts each row's state
    as one term already seen, m = sink (log2 units) and l = 1; a row that sees no key then
    gets out 0 and lse = sink, as in ``attn_fwd.py``.

    ``TMA_STORE`` (dense, ``QPACK`` 1, one split): the output tile goes to this warpgroup's
    staging tile (``o_stages[WG]``, [1, 64, 1, HEAD_DIM]) in shared memory and from there to ``o_desc``
    with one asynchronous bulk copy, which the descriptor's bounds clip at ``seqlen_q``; the
    copy is waited for only when the staging tile is next written (the next item's epilogue)
    and once before the program ends. Else each thread stores its accumulator fragments.

    ``Q_EARLY``: the warpgroup releases its Q buffer as soon as the item's last S product has
    completed, not after the item's last P V product (the launcher's rule: the head dims where
    this was measured to gain).

    ``DYNAMIC``: the warpgroup learns each item's index and place from its slot once the item's
    ``q_full`` phase has completed, and leaves at an index past the items (``_producer``).

    ``Q_BUFS``: item j reads Q buffer, barriers and slot ``2 (j % Q_BUFS) + WG`` at phase
    ``(j // Q_BUFS) & 1`` (``_q_buffers``)."""
    q_full = bars[0]
    HEAD_DIM: gl.constexpr = k_ring.type.shape[4]
    BLOCK_N: gl.constexpr = k_ring.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s_zero = gl.zeros([ROWS_WG, BLOCK_N], gl.float32, layout=s_layout)
    if TMA_STORE:
        o_stage = o_stages.index(WG)  # [1, ROWS_WG, 1, HEAD_DIM]
    else:
        o_stage: gl.constexpr = None
    batch, nheads, seqlen_q, num_splits = geom[3], geom[4], geom[5], geom[9]
    items = gl.cdiv(seqlen_q * QPACK, 2 * ROWS_WG) * batch * (nheads // QPACK) * num_splits
    c = 0  # K/V copies consumed so far: the ring position of the item's first tile
    j = 0  # work items done: the Q buffer's phase
    if DYNAMIC:
        mbarrier.wait(q_full.index(WG), 0)  # the first item's Q (or the end): pair 0, phase 0
        w, work = _read_index(slots, WG)
        while w < items:
            c, j = _consume_item(w, work, c, j, WG, q_smem, s_zero, k_ring, v_ring, bars, geom, o_desc, o_stage, Out,
                                 Lse, Sink, stride_ob, stride_os, stride_oh, stride_osplit, stride_lb, stride_lh,
                                 stride_ls, stride_lsplit, scale_log2, GROUP, QPACK, IS_VARLEN, HAS_SEQUSED, MASK_LEFT,
                                 MASK_RIGHT, HAS_SINK, PAGE, STAGES, TMA_STORE, Q_EARLY, Q_BUFS, S_AHEAD, KV_BAR,
                                 False)
            qb, q_phase = _q_buffers(j, Q_BUFS)
            mbarrier.wait(q_full.index(qb + WG), q_phase)  # the next item's Q (or the end), after this item's epilogue
            w, work = _read_index(slots, qb + WG)
    else:
        for w in range(gl.program_id(0), items, gl.num_programs(0)):
            c, j = _consume_item(w, None, c, j, WG, q_smem, s_zero, k_ring, v_ring, bars, geom, o_desc, o_stage, Out,
                                 Lse, Sink, stride_ob, stride_os, stride_oh, stride_osplit, stride_lb, stride_lh,
                                 stride_ls, stride_lsplit, scale_log2, GROUP, QPACK, IS_VARLEN, HAS_SEQUSED, MASK_LEFT,
                                 MASK_RIGHT, HAS_SINK, PAGE, STAGES, TMA_STORE, Q_EARLY, Q_BUFS, S_AHEAD, KV_BAR,
                                 True)
    if TMA_STORE:
        tma.store_wait(0)  # the last copy has read the staging tile before the program ends


@gluon.jit
def _attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, Out, Lse, Sink, CuSeqlensQ, CuSeqlensK, SequsedK, BlockTable, Counter,
    stride_ob, stride_os, stride_oh, stride_osplit, stride_lb, stride_lh, stride_ls, stride_lsplit, stride_tb, table_len,
    batch, nheads, seqlen_q, seqlen_k, num_splits, tiles_per_split, group, scale_log2, window_left, window_right,
    GROUP: gl.constexpr, QPACK: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr, Q_EARLY: gl.constexpr,
    DYNAMIC: gl.constexpr, Q_BUFS: gl.constexpr, S_AHEAD: gl.constexpr, KV_BAR: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Program ``pid`` of ``P`` walks work items pid, pid + P, ... (one query block of 128 rows
    of one (sequence, head, key split) each, ordered by ``_work``): with P = the number of SMs
    the grid is persistent; the launcher makes P the number of items when their costs differ.

    Three partitions: the default one (``num_warps`` = 4) and a worker warpgroup consume rows
    [0, 64) and [64, 128) of each block; one worker warp produces (TMA). The consumers share
    the Q buffers and the K/V rings and meet only at their barriers, so one can run its softmax
    while the other's matmuls use the tensor cores, and the producer copies the next item's
    tiles while the consumers write the last one's outputs.

    ``IS_VARLEN``: the descriptors view packed (tokens, heads, dim) tensors as batch 1,
    sequence ``b`` owns rows cu_seqlens[b]:cu_seqlens[b + 1], and ``seqlen_q`` is the longest
    sequence (it sizes the work list); blocks past a sequence's end are skipped. A key tile that
    runs past its sequence reads the next sequence's rows, whose scores are masked to -inf.
    ``HAS_SEQUSED``: sequence b has ``SequsedK[b]`` keys (``seqlen_k`` is then the most, which
    sizes the splits); ``PAGE``, ``QPACK``, ``num_splits``: the module's docstring.

    ``TMA_STORE``: ``o_desc`` (None without it) is a descriptor of ``Out`` (B, S, H, D) read in
    [1, 64, 1, D] tiles, and each consumer warpgroup stores its output tile through a staging
    tile of its own (``_consumer``); the launcher sets it for dense calls only.

    ``DYNAMIC`` (dense rows; ``Counter`` an int32 that is 0 when the launch starts, None without
    it): program pid's first item is pid; each later one is ``P + atomic_add(Counter, 1)``, fetched
    by the producer once it has issued the current item's last K/V copy (the consumers are then
    ``STAGES`` tiles from its end: the atomic's latency hides behind them, and the claim comes
    late enough for the order to be served nearly greedily: docs/perf-notes.md's model). The
    producer hands the index to the consumer warpgroups through ``slots`` (a slot of 8 int32 in shared
    memory per Q buffer of each warpgroup): after its wait on ``q_empty[wg]`` it writes the index and
    the item's place from its own ``_work`` (``_post_index``) to ``wg``'s slot, then starts
    ``q_full[wg]``'s phase (``expect``, an arrive with release semantics, then the Q copy); the
    warpgroup waits on that phase (acquire) and reads the slot (``_read_index``), so the divisions of
    ``_work`` are not between its last item's end and its next S product. An index >= the item count
    ends the program: the producer, after ``q_empty[wg]``, writes it to both slots and arrives on
    ``q_full[wg]`` without a copy; each consumer reads it after its last epilogue and leaves its loop,
    and the producer has left its own.

    Why this cannot deadlock, nor hand out an item twice or never:
    * The atomic returns each value once, so items P, P + 1, ... go to one program each, and
      every program fetches until it gets an index >= items: every item runs, once.
    * Within a program the three partitions walk the same items: the producer writes the same
      index to both slots, and a consumer takes its j-th item from the j-th phase of its
      ``q_full``. So each consumer consumes exactly the K/V copies the producer issues, in the
      same ring order, as in the static schedule (whose barrier protocol is unchanged).
    * With ``Q_BUFS`` pairs of Q buffers, item j uses buffer pair j % Q_BUFS (``_q_buffers``): Q
      barriers, Q buffer and slot are per (pair, warpgroup), and each is used by every Q_BUFS-th
      item, so what is said below of ``q_full[wg]``, ``q_empty[wg]`` and ``slots[wg]`` holds for
      each pair's; the producer runs at most Q_BUFS items ahead on Q, the K/V ring keeps its order.
    * A slot is written again only after ``q_empty[wg]`` of the item it holds has completed, and
      a consumer arrives there only after reading the slot (all its fields, at the item's start), so
      no index or place is overwritten unread. The producer's lanes all write the slot, then the warp's
      barrier, then one lane's release-arrive: the consumers' acquire-wait sees the value.
    * The end: each consumer arrives on ``q_empty`` once per item (before its epilogue, with or
      without ``Q_EARLY``), so the producer's last wait on it completes; its arrive on ``q_full``
      then completes the phase (count 1, no bytes expected); each consumer waits for it after its
      last epilogue, reads the end index and leaves. No copy is left in flight (every K/V tile
      issued was consumed; the output copies are waited for by ``tma.store_wait``), and no
      partition waits on another after the end signal.
    * A program whose id is >= items (the launcher makes none) posts the end at once.

    The counter is a fresh zeroed tensor per launch (``gpu/hopper.py``'s ``_item_counter``), not
    one kept by the launcher and reset by the kernel's last program: two launches in flight on two
    streams would share such a counter.

    ``KV_BAR`` (the launcher's rule, per head dim): a ring slot's K and V share one ``full`` and one
    ``empty`` barrier, ``k_full[slot]`` and ``k_empty[slot]`` (``v_full`` and ``v_empty`` are still
    allocated and initialised, but unused). Each mbarrier operation costs a warpgroup barrier in the
    consumers (Triton's shared-memory barrier analysis puts a ``bar.sync`` between any two consecutive
    mbarrier operations of a partition but a wait followed by a wait, and between one and a wgmma
    next to it, but a wait followed by the wgmma), and flash-attn 3 releases its buffers without any;
    the flag halves a tile's operations (``_tiles_s_ahead``: 5 barriers a pair of tiles instead of 7):
    * The producer waits for the slot's ``k_empty`` phase, then issues one ``expect`` of both tiles'
      bytes (an arrival: ``k_full``'s count stays 1) and K's and V's copies (one each, or one per
      page each with ``PAGE``: pages past the table still count their bytes, TMA fills them) on
      ``k_full[slot]``; the phase completes once both have landed.
    * A consumer waits on ``k_full[slot]`` before the tile's S product, not again before its P V
      product (V landed in the same phase; ``_zero_rows_from`` then writes V's rows past the keys,
      as without the flag after V's own wait), and arrives on ``k_empty[slot]`` once, after the
      tile's P V product has completed (``_consume_item``, ``_tiles_s_ahead``).
    * Counts: ``k_full`` 1 (the producer's expect), ``k_empty`` 2 (one arrival per consumer
      warpgroup per tile), as without the flag; each slot's phases alternate as before, one per
      ring pass.
    Why this cannot deadlock: in the K/V loop the producer waits only on ``k_empty`` phases, which
    each warpgroup completes by its one arrival after the tile's P V product; that product needs
    nothing of the producer past the tile's own ``k_full`` phase, already waited for before its S
    product. A warpgroup waiting for copy x holds at most the slots of x - 1 (the plain loop: P V of
    x - 1 is issued after that wait) or of x - 2 and x - 1 (``S_AHEAD``: P_{t-1} V_{t-1} runs while
    it waits for K_{t+1}), and has released every copy before them. Take the warpgroup furthest
    behind, waiting for copy x (the other one waits for a later copy, or for a Q phase, having
    released every copy of its earlier items, or computes): both have released copy x - STAGES
    when STAGES >= 2 in the plain loop and STAGES >= 3 with ``S_AHEAD`` (``_tiles_s_ahead``'s
    static assertion), so the producer, issuing in ring order, gets past copy x. The Q barriers
    are unchanged (an item's ``q_empty`` arrival needs no K/V copy of a later item). The price: a
    slot's K is held one tile longer, until its P V product, so the producer runs about one tile
    less ahead with the same ``STAGES``."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = q_desc.dtype
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_full = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if TMA_STORE:  # one output staging tile per consumer warpgroup
        gl.static_assert(QPACK == 1 and not IS_VARLEN and PAGE == 0, "the output copy serves dense rows")
        o_stage = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_stage: gl.constexpr = None
    if DYNAMIC:  # each consumer warpgroup's slots (one per Q buffer) for its next work item's index and place
        gl.static_assert(not IS_VARLEN, "every dynamic item is valid (dense rows)")
        slots = gl.allocate_shared_memory(gl.int32, [2 * Q_BUFS * 8, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    else:
        slots: gl.constexpr = None
    for i in gl.static_range(2 * Q_BUFS):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)  # (with KV_BAR: the slot's K and V)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot (with KV_BAR: its K and V)
        mbarrier.init(v_empty.index(i), count=2)
    # with KV_BAR a V tile's release is its slot's (K and V together): v_empty stands for k_empty in the
    # consumers' arrivals; the producer's KV_BAR branch waits on k_empty alone
    bars = (q_full, q_empty, k_full, v_full, k_empty, k_empty if KV_BAR else v_empty)
    geom = (CuSeqlensQ, CuSeqlensK, SequsedK, batch, nheads, seqlen_q, seqlen_k, window_left, window_right, num_splits,
            tiles_per_split, group)
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_ring, v_ring, bars, geom, o_desc, o_stage, Out, Lse, Sink, stride_ob, stride_os,
                     stride_oh, stride_osplit, stride_lb, stride_lh, stride_ls, stride_lsplit, scale_log2, slots, GROUP,
                     QPACK, IS_VARLEN, HAS_SEQUSED, MASK_LEFT, MASK_RIGHT, HAS_SINK, PAGE, STAGES, TMA_STORE, Q_EARLY,
                     DYNAMIC, Q_BUFS, S_AHEAD, KV_BAR)),
        (_consumer, (1, q_smem, k_ring, v_ring, bars, geom, o_desc, o_stage, Out, Lse, Sink, stride_ob, stride_os,
                     stride_oh, stride_osplit, stride_lb, stride_lh, stride_ls, stride_lsplit, scale_log2, slots, GROUP,
                     QPACK, IS_VARLEN, HAS_SEQUSED, MASK_LEFT, MASK_RIGHT, HAS_SINK, PAGE, STAGES, TMA_STORE, Q_EARLY,
                     DYNAMIC, Q_BUFS, S_AHEAD, KV_BAR)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, bars, geom, BlockTable, stride_tb, table_len,
                     slots, Counter, GROUP, QPACK, IS_VARLEN, HAS_SEQUSED, MASK_LEFT, MASK_RIGHT, PAGE, STAGES,
                     DYNAMIC, Q_BUFS, KV_BAR)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
