"""Does wgmma read a row slice of a TMA-filled ring tile right? (Triton 3.6, Gluon, sm_90.)

The question ``HALF_LAST``'s wrong outputs left open (docs/perf-notes.md, 2026-12-02 04:00): its
half-width tile took the first 64 keys of a K/V ring tile as ``ring.index(s).reshape([N, D]).slice(0,
64, dim=0)``, an S product over that slice's transpose and a P V product over the same slice of V, and
the outputs were garbage on the GPU. Not a test of tileattn's kernels: a record of what this toolchain
does, built the way the forward builds its ring (4-D descriptors, a [1, 1, N, 1, D] buffer,
``NVMMASharedLayout.get_default_for``), each product beside the full-width one as a control:

1. S = Q K^T over the whole [N, D] tile (the control);
2. S_half = Q K_slice^T over rows ``START`` .. ``START`` + N / 2 of it;
3. O = P V_slice with P = S_half in bf16 as a register operand (the forward's P V product layout).

    python tests/hopper_slice_probe.py    # on a GPU: runs each case, compares with torch, prints the errors
                                          # without one: compiles each case for sm_90
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: E402

ROWS, BLOCK_N = 64, 128
CASES = [(d, start) for d in (64, 128) for start in (0, BLOCK_N // 2)]


@gluon.jit
def _probe(q_desc, k_desc, v_desc, Out, START: gl.constexpr):
    D: gl.constexpr = k_desc.block_type.shape[3]
    N: gl.constexpr = k_desc.block_type.shape[1]
    M: gl.constexpr = q_desc.block_type.shape[1]
    HALF: gl.constexpr = N // 2
    q_s = gl.allocate_shared_memory(q_desc.dtype, [1] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [1, 1, N, 1, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [1, 1, N, 1, D], v_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), q_desc.block_type.nbytes + 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [0, 0, 0, 0], bar.index(0), q_s.index(0))
    tma.async_copy_global_to_shared(k_desc, [0, 0, 0, 0], bar.index(0), k_ring.index(0))
    tma.async_copy_global_to_shared(v_desc, [0, 0, 0, 0], bar.index(0), v_ring.index(0))
    mbarrier.wait(bar.index(0), 0)
    q = q_s.index(0).reshape([M, D])
    k = k_ring.index(0).reshape([N, D])
    v = v_ring.index(0).reshape([N, D])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([M, N], gl.float32, layout=s_layout), use_acc=False)
    s_half = warpgroup_mma(q, k.slice(START, HALF, dim=0).permute((1, 0)),
                           gl.zeros([M, HALF], gl.float32, layout=h_layout), use_acc=False)
    p = gl.convert_layout(s_half.to(q_desc.dtype), p_layout)
    o = warpgroup_mma(p, v.slice(START, HALF, dim=0), gl.zeros([M, D], gl.float32, layout=o_layout), use_acc=False)
    mbarrier.invalidate(bar.index(0))
    # Out: S [M, N], then S_half [M, HALF], then O [M, D], row-major fp32
    rs = gl.arange(0, M, layout=gl.SliceLayout(1, s_layout))
    cs = gl.arange(0, N, layout=gl.SliceLayout(0, s_layout))
    gl.store(Out + rs[:, None] * N + cs[None, :], s)
    rh = gl.arange(0, M, layout=gl.SliceLayout(1, h_layout))
    ch = gl.arange(0, HALF, layout=gl.SliceLayout(0, h_layout))
    gl.store(Out + M * N + rh[:, None] * HALF + ch[None, :], s_half)
    ro = gl.arange(0, M, layout=gl.SliceLayout(1, o_layout))
    co = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(Out + M * N + M * HALF + ro[:, None] * D + co[None, :], o)


def _layout(block):
    """The shared-memory layout the forward's launcher gives a descriptor's tile."""
    from tileattn.gpu.hopper import _smem_layout

    return _smem_layout(tuple(block), torch.bfloat16)


def run(d: int, start: int) -> dict[str, float]:
    """The three products of one case on the GPU, each one's largest error against torch."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    torch.manual_seed(d + start)
    q = torch.randn(1, ROWS, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, BLOCK_N, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qb, kb = [1, ROWS, 1, d], [1, BLOCK_N, 1, d]
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), b, _layout(b)) for t, b in ((q, qb), (k, kb), (v, kb))]
    half = BLOCK_N // 2
    out = torch.full((ROWS * BLOCK_N + ROWS * half + ROWS * d,), float("nan"), device="cuda")
    _probe[(1,)](*descs, out, START=start, num_warps=4)
    torch.cuda.synchronize()
    q2, k2, v2 = (t[0, :, 0].float() for t in (q, k, v))
    s_ref = q2 @ k2.T
    s_half = out[ROWS * BLOCK_N:ROWS * BLOCK_N + ROWS * half].view(ROWS, half)
    p = s_half.to(torch.bfloat16).float()  # the kernel's own P, so O's check is of the P V product alone
    got = {"S": out[:ROWS * BLOCK_N].view(ROWS, BLOCK_N), "S_half": s_half,
           "O": out[ROWS * BLOCK_N + ROWS * half:].view(ROWS, d)}
    ref = {"S": s_ref, "S_half": s_ref[:, start:start + half], "O": p @ v2[start:start + half]}
    return {name: (got[name] - ref[name]).abs().max().item() / max(ref[name].abs().max().item(), 1.0) for name in got}


def compile_case(d: int, start: int) -> str:
    """Compile one case for sm_90 without a GPU: registers, shared memory, ptxas' say."""
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block):
        return f"tensordesc<bf16[{', '.join(map(str, block))}],{_layout(block)!r}>"

    sig = {"q_desc": desc([1, ROWS, 1, d]), "k_desc": desc([1, BLOCK_N, 1, d]), "v_desc": desc([1, BLOCK_N, 1, d]),
           "Out": "*fp32", "START": "constexpr"}
    k = triton.compile(GluonASTSource(_probe, sig, constexprs={"START": start}), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hopper_compile import registers

    return f"{registers(k)}, {k.metadata.shared} bytes of shared memory"


def main() -> int:
    bad = 0
    for d, start in CASES:
        if torch.cuda.is_available():
            errors = run(d, start)
            ok = all(e < 2e-2 for e in errors.values())  # bf16 inputs, fp32 products: ~1e-6; a wrong read: O(1)
            bad += not ok
            print(f"hdim {d:3d} slice rows {start:3d}..{start + BLOCK_N // 2 - 1:3d}: "
                  + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()) + ("" if ok else "  WRONG"), flush=True)
        else:
            print(f"hdim {d:3d} slice rows {start:3d}..: sm_90 {compile_case(d, start)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
