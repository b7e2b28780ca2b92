"""Decoding over an FP8 (e4m3) KV cache on Hopper (sm_90), written in Gluon: swapped products.

A decoding call has a few query rows per KV head (rows per sequence x query heads per KV head,
here at most ``N_Q`` = 8) and many keys, so the keys are wgmma's M dimension and the queries its N:

    S^T = K Q^T          [keys, N_Q]   (K from registers, Q^T from shared memory)
    O^T = V^T P^T        [d, N_Q]      (V^T from registers, P^T from shared memory)

The K and V tiles land by TMA as fp8 bytes (``attn_fwd_hopper``'s producer copy ``_copy_kv``: one copy
per page of a paged pool, or one per tile of a contiguous cache) and are turned into fp16 wgmma A
operands in registers, with no shuffle and no shared-memory round trip (each first built alone for
issue #19: tests/hopper_fp8_operands.py, docs/perf-notes.md):

* K (``_k_operand``): read in the FP8 dot-operand layout (k_width 4), converted (F2FP), and relabelled
  along the reduction index (``_relabel_k``) so that ``convert_layout(..., assert_trivial=True)`` into
  the fp16 A layout moves nothing; Q^T's rows are staged at the same relabelled columns
  (``_logical_col``), so the product does not see it.
* V (``_v_operand``): read in ``V_LOAD`` (4 consecutive d of keys k and k + 1 per thread), byte-transposed
  and converted by inline asm (``prmt`` + ``cvt.rn.f16x2.e4m3x2``, ``_transpose_convert``), transposed
  and relabelled along d (``_relabel_d``); O^T's rows come out at relabelled d, the store writes row
  d' at ``_physical_d(d')``.

The softmax runs along the keys, wgmma's M: within a thread (rows g and g + 8), across the lanes of
a warp and across the 4 warps of the warpgroup (``gl.max`` over axis 0 of the accumulator layout, the
compiler's reduction through shared memory). The running sum is kept per key slot ([KEYS, N_Q],
elementwise, rescaled with the output) and reduced over the keys once per work item.

Partitions: one producer warp and two consumer warpgroups. A ring slot holds ``BLOCK_N`` = 128 keys;
warpgroup ``WG`` consumes keys [64 WG, 64 WG + 64) of every slot with a state of its own and writes
it as split ``2 split + WG`` of the partial outputs (out normalised by its own sum, fp32, and its
lse), so the two halves of a split are merged by ``combine.py``'s kernel with the splits: the
workspace has ``2 num_splits`` splits, and no state crosses warpgroups.

Scales, as the portable FP8 path (``attn_fwd.py``'s ``IS_FP8``): q is scaled by a power of two that
puts its largest entry of the work item in (2^13, 2^14] and rounded to fp16; the factor and k's
descale join the score scale; v's descale multiplies the output. Masks: keys past the sequence's
``seqlen_k`` (and with ``CAUSAL`` past each query's diagonal, bottom-right aligned) get score -inf;
the V rows of the sequence's last tile past ``seqlen_k`` are zeroed in shared memory before they are
read (``_zero_rows_from``, as the forward's paged path: a page's unused slots may hold NaN, and NaN x 0
is NaN; zeroed in registers instead, the byte selects cost ~170 instructions on every tile). A sequence with no keys gives out 0 and lse -inf.

``OVERLAP`` (the launcher's ``FP8_DECODE_OVERLAP``): within a warpgroup, O^T's product of tile t - 1 runs
on the tensor cores while S^T of tile t completes and its softmax runs. Per tile t: K_t's operand, then
S^T_t and O^T_{t-1} issued asynchronously in that order (wgmma groups complete in order, so a wait
with one group outstanding waits for S^T_t alone), V_t read into registers and both ring slots
released (as without the flag: both operands live in registers, no product reads the ring), the
wait for S^T_t, the softmax, P^T_t stored into the warpgroup's other P^T buffer, the wait for
O^T_{t-1}, the barrier that publishes P^T_t, O^T rescaled by alpha_t and V_t converted into the fp16
operand that the next tile's O^T product reads. The value carried across the loop is that fp16
operand (32 registers): carrying V's fp8 registers instead makes the compiler unpack and repack
their bytes at the loop edge (+132 PRMT, +60 LOP3 a tile). P^T's double buffer holds: buffer t % 2 is
written after every warp waited for O^T_{t-2} (the wait precedes the barrier of tile t - 1). Every
product sees the same operands and accumulator as without the flag (O^T rescaled by alpha_t before
tile t's product is added), so the result is bitwise the same.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attn_fwd_hopper import _copy_kv, _finish_rows, _online_rescale, _wait_tile, _zero_rows_from

KEYS: gl.constexpr = gl.constexpr(64)  # keys per consumer warpgroup per ring slot (wgmma's M)
HEAD_DIM: gl.constexpr = gl.constexpr(128)  # the one head dim the operand layouts below are written for
N_Q: gl.constexpr = gl.constexpr(8)  # query rows of a work item (wgmma's N): rows per sequence x group
BLOCK_N: gl.constexpr = gl.constexpr(128)  # keys per ring slot: two warpgroups' tiles


# --- K as an fp16 register A operand: relabel the reduction index ---------------------------------

def _permuted_a_layout():
    """A load layout for the fp8 [64, 128] K tile: the linear layout of the fp16 A operand (4 warps,
    k_width 2) with its column bases mapped through the relabelling kk -> c (kk = 16 blk + 8 jh +
    2 t + jl  ->  c = 16 blk + 4 t + 2 jh + jl), written out by hand (mechanism (b) of
    tests/hopper_fp8_operands.py; the kernel reads K in the FP8 dot-operand layout, which compiles
    to the same SASS)."""
    # fp16 A layout of wgmma m64 x k16 per warpgroup, 128 columns (8 k-steps), rows 64:
    #   register bits: kk bit 0 (jl), row bit 3 (+8), kk bit 3 (jh), then kk bits 4, 5, 6 (blk)
    #   lane bits: kk bits 1, 2 (t), row bits 0, 1, 2 (g); warp bits: row bits 4, 5
    def c_of(kk):  # physical column of logical column kk (linear over GF(2) on the bits used)
        blk, jh, t, jl = kk // 16, (kk // 8) % 2, (kk // 2) % 4, kk % 2
        return 16 * blk + 4 * t + 2 * jh + jl

    reg = [[0, c_of(1)], [8, 0], [0, c_of(8)], [0, c_of(16)], [0, c_of(32)], [0, c_of(64)]]
    lane = [[0, c_of(2)], [0, c_of(4)], [1, 0], [2, 0], [4, 0]]
    warp = [[16, 0], [32, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[64, 128])


PERMUTED_A = gl.constexpr(_permuted_a_layout())


@gluon.jit
def _relabel_k(x):
    """[64, 128] tensor at physical columns c -> the same registers read at logical columns kk."""
    x = x.reshape([KEYS, 8, 4, 2, 2])  # [rows, blk, t, jh, jl]
    x = x.permute((0, 1, 3, 2, 4))  # [rows, blk, jh, t, jl]
    return x.reshape([KEYS, HEAD_DIM])


@gluon.jit
def _logical_col(kk):
    """The physical column PI(kk) of logical reduction index kk."""
    return (kk // 16) * 16 + ((kk // 2) % 4) * 4 + ((kk // 8) % 2) * 2 + kk % 2


# --- V^T as an fp16 register A operand: a byte transpose in registers ------------------------------

# The relabelling of O^T's rows: logical row d' (the wgmma's M) sits at physical column PI_D(d') of V,
# bit i of d' being bit D_BITS[i] of d. Keys are not relabelled (P^T is read as it is).
D_BITS = (2, 3, 4, 0, 5, 6, 1)


def _v_load_layout():
    """The layout V's fp8 [64 keys, 128 d] tile is read from shared memory in: per thread and key
    pair, two 32-bit words (4 consecutive d of keys k and k + 1, registers 0-7 of each pack of 8),
    so that after the byte transpose the registers hold the fp16 A layout of V^T (relabelled)."""
    reg = [[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]]  # d bits 0, 1; key bits 0, 3, 4, 5
    lane = [[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]]  # key bits 1, 2 (t); d bits 2, 3, 4 (g)
    warp = [[0, 32], [0, 64]]  # d bits 5, 6
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[64, 128])


V_LOAD = gl.constexpr(_v_load_layout())

# Two prmt.b32 turn [d0..d3 of key k] [d0..d3 of key k+1] into the (k, k+1) byte pairs of d0, d1 and
# d2, d3; four cvt.rn.f16x2.e4m3x2 make the f16x2 registers. Output element e of the pack holds
# V[k + e % 2, d0 + e // 2] where input element e held V[k + e // 4, d0 + e % 4].
_TRANSPOSE_ASM = gl.constexpr("""{
.reg .b32 a, b;
.reg .b16 a0, a1, b0, b1;
prmt.b32 a, $4, $5, 0x5140;
prmt.b32 b, $4, $5, 0x7362;
mov.b32 {a0, a1}, a;
mov.b32 {b0, b1}, b;
cvt.rn.f16x2.e4m3x2 $0, a0;
cvt.rn.f16x2.e4m3x2 $1, a1;
cvt.rn.f16x2.e4m3x2 $2, b0;
cvt.rn.f16x2.e4m3x2 $3, b1;
}""")


@gluon.jit
def _transpose_convert(v):
    """[64, 128] fp8 in V_LOAD -> [64, 128] fp16 whose registers hold the byte-transposed values;
    then the relabelling that makes it V (fp16) at its true coordinates, still in registers."""
    t = gl.inline_asm_elementwise(_TRANSPOSE_ASM, "=r,=r,=r,=r,r,r", [v], dtype=gl.float16, is_pure=True, pack=8)
    # t[kp, a, dq, bh, bl] (key = 2 kp + a, d = 4 dq + 2 bh + bl) holds V[2 kp + bl, 4 dq + 2 a + bh]
    t = t.reshape([KEYS // 2, 2, HEAD_DIM // 4, 2, 2])
    t = t.permute((0, 4, 2, 1, 3))
    return t.reshape([KEYS, HEAD_DIM])  # V[key, d] in fp16


@gluon.jit
def _relabel_d(vt):
    """[128 d, 64 keys] at physical d -> the same registers read at logical rows d' (D_BITS)."""
    x = vt.reshape([2, 2, 2, 2, 2, 2, 2, KEYS])  # dim j is bit 6 - j of d
    # logical bit i (dim 6 - i of the result) is physical bit D_BITS[i] (dim 6 - D_BITS[i]):
    # logical bits 6..0 <- physical bits 1, 6, 5, 0, 4, 3, 2 -> dims 5, 0, 1, 6, 2, 3, 4
    x = x.permute((5, 0, 1, 6, 2, 3, 4, 7))
    return x.reshape([HEAD_DIM, KEYS])


@gluon.jit
def _physical_d(dl):
    """The physical d of logical row d' (D_BITS)."""
    return (((dl >> 0) & 1) << 2) | (((dl >> 1) & 1) << 3) | (((dl >> 2) & 1) << 4) | (((dl >> 3) & 1) << 0) \
        | (((dl >> 4) & 1) << 5) | (((dl >> 5) & 1) << 6) | (((dl >> 6) & 1) << 1)


@gluon.jit
def _k_operand(k_tile, a_f16: gl.constexpr):
    """The fp8 [64, 128] K tile in shared memory -> the fp16 A operand of S^T = K Q^T (relabelled columns)."""
    a_f8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_f16.parent, k_width=4)
    return gl.convert_layout(_relabel_k(k_tile.load(a_f8).to(gl.float16)), a_f16, assert_trivial=True)


@gluon.jit
def _v_operand(v8, a_f16: gl.constexpr):
    """The fp8 [64 keys, 128] V tile in registers (``V_LOAD``) -> the fp16 A operand of O^T = V^T P^T
    (rows at relabelled d)."""
    vt = _relabel_d(_transpose_convert(v8).permute((1, 0)))  # [128 d', 64 keys]
    return gl.convert_layout(vt, a_f16, assert_trivial=True)


# --- the decoding kernel --------------------------------------------------------------------------

@gluon.jit
def _item(w, geom, HAS_SEQUSED: gl.constexpr):
    """Work item ``w``: split ``split`` of KV head ``hk`` of sequence ``b``. Returns (b, hk, split,
    seqlen_k, n_lo, n_hi): the sequence's keys and the split's key tiles [n_lo, n_hi) (none past the
    sequence's keys)."""
    SequsedK, batch, nheads_k, seqlen_q, seqlen_k, num_splits, tiles_per_split = geom
    split = w % num_splits
    bh = w // num_splits
    b = bh // nheads_k
    hk = bh % nheads_k
    if HAS_SEQUSED:
        seqlen_k = gl.load(SequsedK + b)
    n_lo = split * tiles_per_split
    n_hi = gl.maximum(gl.minimum(gl.cdiv(seqlen_k, BLOCK_N), n_lo + tiles_per_split), n_lo)
    return b, hk, split, seqlen_k, n_lo, n_hi


@gluon.jit
def _fp8_producer(k_desc, v_desc, k_ring, v_ring, bars, geom, BlockTable, stride_tb, table_len,
                  HAS_SEQUSED: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr):
    """The load warp: each work item's K and V tiles, slot by slot, as ``attn_fwd_hopper``'s producer."""
    k_full, v_full, k_empty, v_empty = bars
    batch, nheads_k, num_splits = geom[1], geom[2], geom[5]
    c = 0  # K/V copies issued so far
    for w in range(gl.program_id(0), batch * nheads_k * num_splits, gl.num_programs(0)):
        b, hk, split, seqlen_k, n_lo, n_hi = _item(w, geom, HAS_SEQUSED)
        for t in range(n_lo, n_hi):
            slot = c % STAGES
            phase = (c // STAGES) & 1
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            _copy_kv(k_desc, k_ring, k_full.index(slot), slot, b, b, hk, 0, t, BlockTable, stride_tb, table_len,
                     BLOCK_N, PAGE)
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            _copy_kv(v_desc, v_ring, v_full.index(slot), slot, b, b, hk, 0, t, BlockTable, stride_tb, table_len,
                     BLOCK_N, PAGE)
            c += 1


@gluon.jit
def _fp8_v_regs(v_full, v_ring, c, t, seqlen_k, WG: gl.constexpr, STAGES: gl.constexpr):
    """Wait for the ring's ``c``-th V copy (key tile ``t``), zero its rows past ``seqlen_k`` on the
    sequence's last tile, and read this warpgroup's 64 keys of it into registers (fp8, ``V_LOAD``)."""
    v_tile = _wait_tile(v_full, v_ring, c, STAGES, BLOCK_N, HEAD_DIM)
    if (t + 1) * BLOCK_N > seqlen_k:  # the sequence's last tile: its rows past the keys hold anything (NaN)
        _zero_rows_from(v_tile, seqlen_k - t * BLOCK_N, BLOCK_N, HEAD_DIM)  # both warpgroups: same values
        gl.thread_barrier()  # every warp's rows zeroed before any reads them
    return v_tile.slice(WG * KEYS, KEYS).load(V_LOAD)


@gluon.jit
def _fp8_softmax(s, m_i, l_acc, key0, seqlen_k, diag, n_s, s_scale, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                 key_s: gl.constexpr):
    """One tile's masks and online softmax on S^T [KEYS, N_Q] (log2 units after ``s_scale``): returns
    (P^T [KEYS, N_Q] fp32, m_i, l_acc rescaled and summed, alpha, the factor O^T is rescaled by)."""
    if CAUSAL:
        masked = key0 + KEYS > diag + 1
    else:
        masked = key0 + KEYS > seqlen_k
    if masked:
        k_pos = key0 + gl.arange(0, KEYS, layout=key_s)  # [KEYS]
        s = gl.where((k_pos < seqlen_k)[:, None], s, float("-inf"))
        if CAUSAL:  # query row n sees keys <= n // GROUP + diag
            s = gl.where(k_pos[:, None] <= (n_s // GROUP)[None, :] + diag, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0) * s_scale)  # [N_Q]: across the warpgroup's keys
    m_use, alpha = _online_rescale(m_i, m_new, True)
    p = gl.exp2(s * s_scale - m_use[None, :])  # [KEYS, N_Q]
    l_acc = l_acc * alpha[None, :] + p
    return p, m_new, l_acc, alpha


@gluon.jit
def _fp8_consumer(WG: gl.constexpr, k_ring, v_ring, q_stages, p_stages, bars, geom, Q, OPart, LsePart, KDescale,
                  VDescale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_osplit,
                  stride_lb, stride_lh, stride_ls, stride_lsplit, scale_log2, GROUP: gl.constexpr,
                  HAS_SEQUSED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """The consumer partition without ``OVERLAP`` (each product waited for at once)."""
    _fp8_consumer_body(WG, k_ring, v_ring, q_stages, p_stages, bars, geom, Q, OPart, LsePart, KDescale, VDescale,
                       stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_osplit, stride_lb,
                       stride_lh, stride_ls, stride_lsplit, scale_log2, GROUP, HAS_SEQUSED, CAUSAL, STAGES, False)


@gluon.jit
def _fp8_consumer_overlap(WG: gl.constexpr, k_ring, v_ring, q_stages, p_stages, bars, geom, Q, OPart, LsePart,
                          KDescale, VDescale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                          stride_osplit, stride_lb, stride_lh, stride_ls, stride_lsplit, scale_log2,
                          GROUP: gl.constexpr, HAS_SEQUSED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """The consumer partition with ``OVERLAP``. (The flag is a literal here, not one of the partition's
    arguments: a partition's arguments reach it as values captured by ``warp_specialize``, and one more
    capture would move main's barriers in shared memory.)"""
    _fp8_consumer_body(WG, k_ring, v_ring, q_stages, p_stages, bars, geom, Q, OPart, LsePart, KDescale, VDescale,
                       stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_osplit, stride_lb,
                       stride_lh, stride_ls, stride_lsplit, scale_log2, GROUP, HAS_SEQUSED, CAUSAL, STAGES, True)


@gluon.jit
def _fp8_consumer_body(WG: gl.constexpr, k_ring, v_ring, q_stages, p_stages, bars, geom, Q, OPart, LsePart,
                       KDescale, VDescale, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                       stride_osplit, stride_lb, stride_lh, stride_ls, stride_lsplit, scale_log2, GROUP: gl.constexpr,
                       HAS_SEQUSED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                       OVERLAP: gl.constexpr):
    """One warpgroup: for each work item, the recurrence of its N_Q packed query rows (row n: query
    n // GROUP of head hk GROUP + n % GROUP) over keys [64 WG, 64 WG + 64) of each of the item's
    tiles, written as partial state ``2 split + WG``."""
    k_full, v_full, k_empty, v_empty = bars
    SequsedK, batch, nheads_k, seqlen_q, seqlen_k_arg, num_splits, tiles_per_split = geom
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 8, 16])
    a_f16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, acc_layout)  # [N_Q]: one value per query row
    key_s: gl.constexpr = gl.SliceLayout(1, acc_layout)  # [KEYS] (or [HEAD_DIM]): one per accumulator row
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 4], [1, 0])
    q_tile = q_stages.index(WG)  # [N_Q, HEAD_DIM] fp16, columns relabelled

    n_q = gl.arange(0, N_Q, layout=gl.SliceLayout(1, q_layout))  # [N_Q] packed rows
    kk = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))  # [HEAD_DIM] logical columns
    q_ok = n_q // GROUP < seqlen_q
    q_off = (n_q // GROUP) * stride_qs + (n_q % GROUP) * stride_qh  # [N_Q]
    n_s = gl.arange(0, N_Q, layout=col_s)  # [N_Q] packed rows, accumulator columns
    s_zero = gl.zeros([KEYS, N_Q], gl.float32, layout=acc_layout)
    c = 0  # K/V copies consumed so far
    for w in range(gl.program_id(0), batch * nheads_k * num_splits, gl.num_programs(0)):
        b, hk, split, seqlen_k, n_lo, n_hi = _item(w, geom, HAS_SEQUSED)
        b64 = b.to(gl.int64)
        # Q^T's rows in shared memory: the group's query rows scaled into fp16's range, relabelled columns
        q_base = Q + b64 * stride_qb + (hk * GROUP).to(gl.int64) * stride_qh
        q = gl.load(q_base + q_off[:, None] + _logical_col(kk)[None, :], mask=q_ok[:, None], other=0.0)
        q = q.to(gl.float32)  # [N_Q, HEAD_DIM]
        q_exp = gl.ceil(gl.log2(gl.maximum(gl.max(gl.max(gl.abs(q), 1), 0), 1e-30))) - 14.0
        kv = b64 * nheads_k + hk
        s_scale = scale_log2 * gl.exp2(q_exp) * gl.load(KDescale + kv)  # scores to log2 units
        v_scale = gl.load(VDescale + kv)
        gl.thread_barrier()  # the previous item's products have read the Q tile (every warp past them)
        q_tile.store((q * gl.exp2(-q_exp)).to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()

        m_i = gl.full([N_Q], float("-inf"), gl.float32, layout=col_s)  # running max, log2 units
        l_acc = gl.zeros([KEYS, N_Q], gl.float32, layout=acc_layout)  # running sums per key slot
        o = gl.zeros([HEAD_DIM, N_Q], gl.float32, layout=acc_layout)  # O^T, rows at relabelled d
        diag = seqlen_k - seqlen_q  # query i sees keys <= i + diag (CAUSAL)
        if OVERLAP:  # O^T of tile t - 1 runs on the tensor cores during S^T and the softmax of tile t
            if n_hi > n_lo:
                # Tile n_lo alone: its scores and softmax; its O^T product is issued in the loop (or
                # after it, for an item of one tile).
                k_op = _k_operand(_wait_tile(k_full, k_ring, c, STAGES, BLOCK_N, HEAD_DIM).slice(WG * KEYS, KEYS), a_f16)
                v8 = _fp8_v_regs(v_full, v_ring, c, n_lo, seqlen_k, WG, STAGES)
                mbarrier.arrive(k_empty.index(c % STAGES), count=1)  # both tiles are in registers
                mbarrier.arrive(v_empty.index(c % STAGES), count=1)
                s = warpgroup_mma(k_op, q_tile.permute((1, 0)), s_zero, use_acc=False)  # [KEYS, N_Q] S^T
                p, m_i, l_acc, alpha = _fp8_softmax(s, m_i, l_acc, n_lo * BLOCK_N + WG * KEYS, seqlen_k, diag, n_s,
                                                    s_scale, GROUP, CAUSAL, key_s)
                p_stages.index(2 * WG + c % 2).store(p.to(gl.float16).permute((1, 0)))  # [N_Q, KEYS] P^T
                fence_async_shared()
                gl.thread_barrier()  # every warp's P^T rows stored before the product reads them
                o = o * alpha[None, :]
                v_op = _v_operand(v8, a_f16)  # [HEAD_DIM, KEYS] fp16 A operand of tile n_lo's O^T product
                c += 1
                for t in range(n_lo + 1, n_hi):
                    k_op = _k_operand(_wait_tile(k_full, k_ring, c, STAGES, BLOCK_N, HEAD_DIM).slice(WG * KEYS, KEYS),
                                      a_f16)
                    s_tok = warpgroup_mma(k_op, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    # O^T += V^T P^T of tile t - 1 (o already rescaled by its alpha), after S^T: the
                    # groups complete in order, so waiting with one outstanding waits for S^T alone
                    o_tok = warpgroup_mma(v_op, p_stages.index(2 * WG + (c - 1) % 2).permute((1, 0)),
                                          o, is_async=True)
                    v8 = _fp8_v_regs(v_full, v_ring, c, t, seqlen_k, WG, STAGES)
                    mbarrier.arrive(k_empty.index(c % STAGES), count=1)  # both tiles are in registers
                    mbarrier.arrive(v_empty.index(c % STAGES), count=1)
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))  # S^T of tile t, O^T still running
                    p, m_i, l_acc, alpha = _fp8_softmax(s, m_i, l_acc, t * BLOCK_N + WG * KEYS, seqlen_k, diag, n_s,
                                                        s_scale, GROUP, CAUSAL, key_s)
                    # P^T's other buffer: last read by tile t - 2's product, which every warp waited for
                    # before the previous tile's barrier
                    p_stages.index(2 * WG + c % 2).store(p.to(gl.float16).permute((1, 0)))  # [N_Q, KEYS]
                    fence_async_shared()
                    o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))  # [HEAD_DIM, N_Q]
                    gl.thread_barrier()  # every warp's P^T rows stored and tile t - 1's product done
                    o = o * alpha[None, :]
                    v_op = _v_operand(v8, a_f16)  # tile t's, for the next tile's O^T product (its registers
                    # are free: the product that read the previous operand has completed)
                    c += 1
                o = warpgroup_mma(v_op, p_stages.index(2 * WG + (c - 1) % 2).permute((1, 0)), o)  # the last tile's
        else:  # each product waited for at once; the other warpgroup overlaps this one's chain
            for t in range(n_lo, n_hi):
                k_op = _k_operand(_wait_tile(k_full, k_ring, c, STAGES, BLOCK_N, HEAD_DIM).slice(WG * KEYS, KEYS), a_f16)
                v8 = _fp8_v_regs(v_full, v_ring, c, t, seqlen_k, WG, STAGES)
                mbarrier.arrive(k_empty.index(c % STAGES), count=1)  # both tiles are in registers
                mbarrier.arrive(v_empty.index(c % STAGES), count=1)
                s = warpgroup_mma(k_op, q_tile.permute((1, 0)), s_zero, use_acc=False)  # [KEYS, N_Q] S^T
                p, m_i, l_acc, alpha = _fp8_softmax(s, m_i, l_acc, t * BLOCK_N + WG * KEYS, seqlen_k, diag, n_s,
                                                    s_scale, GROUP, CAUSAL, key_s)
                p_buf = p_stages.index(2 * WG + c % 2)  # [N_Q, KEYS] P^T, last read by the product two tiles ago
                p_buf.store(p.to(gl.float16).permute((1, 0)))  # [N_Q, KEYS]
                fence_async_shared()
                gl.thread_barrier()  # every warp's P^T rows stored before the product reads them
                o = warpgroup_mma(_v_operand(v8, a_f16), p_buf.permute((1, 0)), o * alpha[None, :])  # [HEAD_DIM, N_Q]
                c += 1

        l_i = gl.sum(l_acc, 0)  # [N_Q]
        l_safe, lse = _finish_rows(m_i, l_i)  # [N_Q]: rows that saw no key get out 0, lse -inf
        o = o * (v_scale / l_safe)[None, :]
        part = (2 * split + WG).to(gl.int64)
        row_ok = n_s // GROUP < seqlen_q
        head = hk * GROUP + n_s % GROUP  # [N_Q]
        o_col = part * stride_osplit + b64 * stride_ob + (n_s // GROUP) * stride_os + head * stride_oh  # [N_Q]
        d = _physical_d(gl.arange(0, HEAD_DIM, layout=key_s))  # [HEAD_DIM] O^T's rows
        gl.store(OPart + o_col[None, :] + d[:, None], o, mask=row_ok[None, :])
        l_off = part * stride_lsplit + b64 * stride_lb + head * stride_lh + (n_s // GROUP) * stride_ls
        gl.store(LsePart + l_off, lse, mask=row_ok)


@gluon.jit
def _decode_fp8_hopper_kernel(
    k_desc, v_desc, Q, OPart, LsePart, KDescale, VDescale, SequsedK, BlockTable,
    stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_osplit, stride_lb, stride_lh, stride_ls,
    stride_lsplit, stride_tb, table_len, batch, nheads_k, seqlen_q, seqlen_k, num_splits, tiles_per_split, scale_log2,
    GROUP: gl.constexpr, HAS_SEQUSED: gl.constexpr, CAUSAL: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
    OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Program ``pid`` of ``P`` walks work items pid, pid + P, ... (split ``s`` of KV head ``hk`` of
    sequence ``b``, item ``(b nheads_k + hk) num_splits + s``): a persistent grid of one program per
    SM. ``k_desc``/``v_desc`` are 4-D descriptors over the fp8 cache (batch, seqlen, heads_k, 128) or
    the paged pool (num_blocks, PAGE, heads_k, 128) with ``BlockTable``; q (batch, seqlen_q, heads,
    128) bf16 or fp16 with ``seqlen_q x GROUP <= N_Q``; ``OPart`` (2 num_splits, batch, seqlen_q,
    heads, 128) and ``LsePart`` (2 num_splits, batch, heads, seqlen_q) fp32 by their strides;
    ``KDescale``/``VDescale`` contiguous (batch, heads_k) fp32."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(k_desc.block_type.shape[3] == HEAD_DIM, "head dim 128")
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_stages = gl.allocate_shared_memory(gl.float16, [2, N_Q, HEAD_DIM],
                                         gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16))
    p_stages = gl.allocate_shared_memory(gl.float16, [4, N_Q, KEYS],  # two per consumer warpgroup
                                         gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16))
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(v_empty.index(i), count=2)
    bars = (k_full, v_full, k_empty, v_empty)
    geom = (SequsedK, batch, nheads_k, seqlen_q, seqlen_k, num_splits, tiles_per_split)
    consumer_args = (k_ring, v_ring, q_stages, p_stages, bars, geom, Q, OPart, LsePart, KDescale, VDescale, stride_qb,
                     stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_osplit, stride_lb, stride_lh,
                     stride_ls, stride_lsplit, scale_log2, GROUP, HAS_SEQUSED, CAUSAL, STAGES)
    if OVERLAP:
        gl.warp_specialize([
            (_fp8_consumer_overlap, (0,) + consumer_args),
            (_fp8_consumer_overlap, (1,) + consumer_args),
            (_fp8_producer, (k_desc, v_desc, k_ring, v_ring, bars, geom, BlockTable, stride_tb, table_len, HAS_SEQUSED,
                             PAGE, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_fp8_consumer, (0,) + consumer_args),
            (_fp8_consumer, (1,) + consumer_args),
            (_fp8_producer, (k_desc, v_desc, k_ring, v_ring, bars, geom, BlockTable, stride_tb, table_len, HAS_SEQUSED,
                             PAGE, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
