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


# --- item 3: O^T = V^T P^T with V^T an fp16 register A operand made from V's fp8 bytes ---------------

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
def ot_kernel(v_desc, p_ptr, ot_ptr, TRIVIAL: gl.constexpr):
    """ot[d, n] = sum_key v[key, d] p[n, key] for one 64 x 128 fp8 V tile and P [8, 64] fp16.
    TRIVIAL: assert that the relabelled tile converts to the A layout with no data movement."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    a_f16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [KEYS, HEAD_DIM], v_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [0, 0], bar.index(0), v_smem)

    p_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 4], [1, 0])
    rows = gl.arange(0, N_Q, layout=gl.SliceLayout(1, p_layout))
    keys = gl.arange(0, KEYS, layout=gl.SliceLayout(0, p_layout))
    p = gl.load(p_ptr + rows[:, None] * KEYS + keys[None, :])  # [8, 64] fp16
    p_smem = gl.allocate_shared_memory(gl.float16, [N_Q, KEYS],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16), p)
    fence_async_shared()
    mbarrier.wait(bar.index(0), 0)

    v = _transpose_convert(v_smem.load(V_LOAD))  # [64, 128] fp16
    vt = _relabel_d(v.permute((1, 0)))  # [128 d', 64 keys]
    if TRIVIAL:
        vt_op = gl.convert_layout(vt, a_f16, assert_trivial=True)
    else:
        vt_op = gl.convert_layout(vt, a_f16)
    acc = gl.zeros([HEAD_DIM, N_Q], gl.float32, layout=acc_layout)
    acc = warpgroup_mma(vt_op, p_smem.permute((1, 0)), acc, use_acc=False)
    mbarrier.invalidate(bar.index(0))

    dl = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, acc_layout))
    n = gl.arange(0, N_Q, layout=gl.SliceLayout(0, acc_layout))
    gl.store(ot_ptr + _physical_d(dl)[:, None] * N_Q + n[None, :], acc)


# --- host side: launches (GPU) and the offline sm_90 report (no GPU) --------------------------------

def st_product(k, q, mech=1):
    """S^T = K Q^T, [64, 8] fp32, from K [64, 128] (fp8 e4m3, or fp16 with ``mech`` 3) and Q [8, 128] fp16."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    assert k.shape == (64, 128) and q.shape == (8, 128) and q.dtype == torch.float16
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=k.element_size() * 8)
    st = torch.empty(64, 8, dtype=torch.float32, device=k.device)
    st_kernel[(1,)](TensorDescriptor.from_tensor(k.contiguous(), [64, 128], layout), q.contiguous(), st, MECH=mech,
                    num_warps=4)
    return st


def ot_product(v, p, trivial=True):
    """O^T = V^T P^T, [128, 8] fp32, from V [64 keys, 128] fp8 e4m3 and P [8, 64 keys] fp16."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    assert v.shape == (64, 128) and p.shape == (8, 64) and p.dtype == torch.float16
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8)
    ot = torch.empty(128, 8, dtype=torch.float32, device=v.device)
    ot_kernel[(1,)](TensorDescriptor.from_tensor(v.contiguous(), [64, 128], layout), p.contiguous(), ot,
                    TRIVIAL=trivial, num_warps=4)
    return ot


SASS_OPS = ("LDS", "LDSM", "STS", "SHFL", "PRMT", "F2FP", "HGMMA")


def offline_report():
    """{variant: (shared bytes, 'regs=.. stack=..', {op: count} over SASS_OPS, instructions)} of
    every variant compiled for sm_90 (needs no GPU; run without TRITON_INTERPRET), or
    {variant: 'FAIL: message'} where the compiler refuses it."""
    import collections
    import os
    import re
    import subprocess
    import sys
    import tempfile

    import torch
    import triton
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    sys.path.insert(0, os.path.dirname(__file__))
    import hopper_compile as hc

    def sass(compiled):
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout

    def one(fn, args, kwargs):
        try:
            c = hc.compile_gluon(fn, args, kwargs)
        except Exception as e:  # the compiler's refusal is the result
            while e.__cause__ is not None:
                e = e.__cause__
            return "FAIL: " + " | ".join(line for line in str(e).splitlines() if line.strip())[-600:]
        ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)",
                                                                    sass(c)))
        return c.metadata.shared, hc.registers(c), {k: ops[k] for k in SASS_OPS}, sum(ops.values())

    out = {}
    q = torch.zeros(8, 128, dtype=torch.float16)
    for mech in (0, 1, 2, 3):
        dt = torch.float16 if mech == 3 else torch.float8_e4m3fn
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16 if mech == 3 else 8)
        kd = TensorDescriptor.from_tensor(torch.zeros(64, 128, dtype=dt), [64, 128], layout)
        out[f"st MECH {mech}"] = one(st_kernel, (kd, q, torch.zeros(64, 8)), dict(MECH=mech, num_warps=4))
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8)
    vd = TensorDescriptor.from_tensor(torch.zeros(64, 128, dtype=torch.float8_e4m3fn), [64, 128], layout)
    for trivial in (1, 0):
        out[f"ot TRIVIAL {trivial}"] = one(ot_kernel, (vd, torch.zeros(8, 64, dtype=torch.float16),
                                                       torch.zeros(128, 8)), dict(TRIVIAL=trivial, num_warps=4))
    return out


if __name__ == "__main__":  # python tests/fp8_operands_spike.py: the offline sm_90 report
    for name, result in offline_report().items():
        print(name, result, flush=True)
