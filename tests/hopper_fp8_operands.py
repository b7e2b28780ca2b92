"""The Gluon FP8 decode's operand conversions (issue #19), each in a minimal kernel of its own, with
the helpers of kernels/decode_fp8_hopper.py: Gluon feeds an FP8 e4m3 tile from shared memory to
``warpgroup_mma`` as an fp16 *register* A operand with no shared-memory round trip and no shuffle, by
permuting the reduction index (docs/perf-notes.md, "Spike, offline", where they were first built).

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

# the helpers live in the kernel that uses them (kernels/decode_fp8_hopper.py); these kernels test them alone
from tileattn.kernels.decode_fp8_hopper import (HEAD_DIM, KEYS, N_Q, PERMUTED_A, V_LOAD, _logical_col,  # noqa: F401
                                                _physical_d, _relabel_d, _relabel_k, _transpose_convert)


@gluon.jit
def _start_tile_copy(desc):
    """Allocate a [KEYS, HEAD_DIM] tile in shared memory and start its TMA copy: (tile, barrier)."""
    smem = gl.allocate_shared_memory(desc.dtype, [KEYS, HEAD_DIM], desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [0, 0], bar.index(0), smem)
    return smem, bar


@gluon.jit
def st_kernel(k_desc, q_ptr, st_ptr, MECH: gl.constexpr):
    """st[key, n] = sum_d k[key, d] q[n, d] for one 64 x 128 K tile (fp8, or fp16 when MECH 3)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    a_f16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    a_f8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    k_smem, bar = _start_tile_copy(k_desc)

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

@gluon.jit
def ot_kernel(v_desc, p_ptr, ot_ptr, TRIVIAL: gl.constexpr):
    """ot[d, n] = sum_key v[key, d] p[n, key] for one 64 x 128 fp8 V tile and P [8, 64] fp16.
    TRIVIAL: assert that the relabelled tile converts to the A layout with no data movement."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    a_f16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    v_smem, bar = _start_tile_copy(v_desc)

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


if __name__ == "__main__":  # python tests/hopper_fp8_operands.py: the offline sm_90 report
    for name, result in offline_report().items():
        print(name, result, flush=True)
