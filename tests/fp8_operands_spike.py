"""Spike for issue #19 (not production code, not wired into any dispatch): can Gluon feed an FP8 e4m3
tile from shared memory to ``warpgroup_mma`` as an fp16 *register* A operand with no shared-memory
round trip and no shuffle, by permuting the reduction index?  See docs/perf-notes.md, "Spike, offline".

Item 2, ``st_kernel``: S^T = K Q^T for one [64 keys, 128 d] fp8 K tile (TMA into shared memory) and
Q^T [128, 8] fp16 (Q: 8 rows, d contiguous).

The fp16 A layout of wgmma (k_width 2) gives thread (warp w, lane 4g + t) rows 16w + g, 16w + g + 8
and, per 16-column step, columns {2t, 2t+1, 2t+8, 2t+9}; the FP8 layout (k_width 4) gives it the
bytes {4t..4t+3} of each 16-column half of a 32-column step. Relabel the reduction index within each
16-column block, physical column c = 16 blk + 4 t + 2 jh + jl  <->  logical kk = 16 blk + 8 jh + 2 t + jl,
and the bytes a thread holds are exactly what the fp16 layout wants at the logical columns. The
product does not see the relabelling if Q^T's rows are relabelled identically: the kernel stores
``qp[n, kk] = q[n, PI(kk)]`` into shared memory (once per item in a real kernel).

In Gluon the relabelling is a register-only reshape / permute / reshape chain ([64, 128] ->
[64, 8, 4, 2, 2] -> permute (0, 1, 3, 2, 4) -> [64, 128]) followed by
``gl.convert_layout(..., assert_trivial=True)``, which refuses at compile time any conversion that
would move data between threads or through shared memory.

``MECH`` selects the way the K tile reaches the A operand:

* 0: baseline, the fp8 tile loaded in the FP8 dot-operand layout (k_width 4), ``.to(fp16)`` and a
  plain ``convert_layout`` into the fp16 A layout with no relabelling: what a naive kernel does, to
  count what the others avoid.
* 1 (mechanism a): loaded in the FP8 dot-operand layout (k_width 4), ``.to(fp16)``, the relabelling
  chain, ``convert_layout(assert_trivial=True)`` into the fp16 A layout (k_width 2).
* 2 (mechanism b): loaded directly in a hand-made ``DistributedLinearLayout`` (the fp16 A layout with
  the relabelling applied to its column bases, ``_permuted_a_layout``), ``.to(fp16)``, the chain,
  ``convert_layout(assert_trivial=True)``.
* 3: K in fp16 (no conversion) loaded in the fp16 A layout: the register-operand cost floor.

Item 3, ``ot_kernel``: O^T = V^T P^T for one [64 keys, 128 d] fp8 V tile and P^T [64 keys, 8] fp16.
A = V^T [128 d, 64 keys] needs (d, key k) and (d, key k+1) in one f16x2 register while V's bytes are
contiguous along d. Each thread loads, per key pair, two 32-bit words (4 d values of keys k and k+1),
and one ``gl.inline_asm_elementwise`` call (pack 8) does two ``prmt.b32`` and four
``cvt.rn.f16x2.e4m3x2``; the relabelling that this transpose implies (within each 8-element pack) and
the permutations of d (rows of O^T) and of keys (rows of P^T) are again a reshape / permute chain and
a trivial ``convert_layout``. The kernel stores O^T's rows at their physical d and reads P^T's rows
at the physical keys, so the test compares with torch directly.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

KEYS: gl.constexpr = gl.constexpr(64)
HEAD_DIM: gl.constexpr = gl.constexpr(128)
N_Q: gl.constexpr = gl.constexpr(8)


def _permuted_a_layout():
    """Mechanism (b)'s load layout for the fp8 [64, 128] K tile: the linear layout of the fp16 A
    operand (4 warps, k_width 2) with its column bases mapped through the relabelling
    kk -> c (kk = 16 blk + 8 jh + 2 t + jl  ->  c = 16 blk + 4 t + 2 jh + jl), written out by hand."""
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


@gluon.jit
def st_kernel(k_desc, q_ptr, st_ptr, MECH: gl.constexpr):
    """st[key, n] = sum_d k[key, d] q[n, d] for one 64 x 128 K tile (fp8, or fp16 when MECH 3)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    a_f16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    a_f8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KEYS, HEAD_DIM], k_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [0, 0], bar.index(0), k_smem)

    # Q with its columns relabelled as K's (physical columns when K is fp16: MECH 3, 0)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 4], [1, 0])
    rows = gl.arange(0, N_Q, layout=gl.SliceLayout(1, q_layout))
    kk = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    if MECH == 1 or MECH == 2:
        cols = _logical_col(kk)
    else:
        cols = kk
    q = gl.load(q_ptr + rows[:, None] * HEAD_DIM + cols[None, :])  # [8, 128] fp16, logical columns
    q_smem = gl.allocate_shared_memory(gl.float16, [N_Q, HEAD_DIM],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16), q)
    fence_async_shared()
    mbarrier.wait(bar.index(0), 0)

    if MECH == 0:
        k_op = gl.convert_layout(k_smem.load(a_f8).to(gl.float16), a_f16)  # no relabelling: data moves
    elif MECH == 1:
        k_op = gl.convert_layout(_relabel_k(k_smem.load(a_f8).to(gl.float16)), a_f16, assert_trivial=True)
    elif MECH == 2:
        k_op = gl.convert_layout(_relabel_k(k_smem.load(PERMUTED_A).to(gl.float16)), a_f16, assert_trivial=True)
    else:
        k_op = k_smem.load(a_f16)
    acc = gl.zeros([KEYS, N_Q], gl.float32, layout=acc_layout)
    acc = warpgroup_mma(k_op, q_smem.permute((1, 0)), acc, use_acc=False)
    mbarrier.invalidate(bar.index(0))

    r = gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    n = gl.arange(0, N_Q, layout=gl.SliceLayout(0, acc_layout))
    gl.store(st_ptr + r[:, None] * N_Q + n[None, :], acc)
