"""Host overhead: what one eager call costs the CPU before its kernels run, and where it goes.

Cases: a decoding step (batch 1, 8k keys, GQA 32/8, hdim 128, bf16; contiguous and paged-16
caches, with and without the append of a new token, and through a ``DecodePlan``), SDPA's
cuDNN on the same step (the anchor), two host floors (an empty Triton launch, a torch.empty),
a short prefill (32×16 heads of 512 tokens, forward and forward+backward) and the same at batch
1, where the step is host-bound (its wall time is its host time), beside SDPA's cuDNN on it; the
decode and the prefill also through the backend launcher alone (no input checks, no custom op).

For each it prints the wall time per call of a loop of calls (host-bound when the GPU work is
shorter; the median of ``--repeats`` loops), the GPU kernels one call launches with their start
and duration on the device, and cProfile's top functions by own time.

    python benchmarks/overhead.py [--calls 200] [--repeats 5] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import triton

import tileattn
from tileattn.ops import _custom


def per_call_us(fn, calls: int, repeats: int) -> float:
    """The median over ``repeats`` loops of each loop's wall time per call (the GPU hosts are noisy)."""
    fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(loops)


@triton.jit
def _nothing_kernel(x_ptr, n):
    pass


def kernels_launched(fn) -> list[str]:
    """Each GPU kernel of one call after an L2 flush: 'name start+duration µs' (start from the first)."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.zero_()
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    kernels = kernels[1:]  # the flush
    t0 = kernels[0].time_range.start if kernels else 0
    return [f"{e.name[:32]} {e.time_range.start - t0:.1f}+{e.time_range.elapsed_us():.1f}µs" for e in kernels]


def top_functions(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in s.getvalue().splitlines() if line.strip())[-6000:]


def cases():
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kc = torch.randn(1, 8192, 8, 128, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    lens = torch.full((1,), 8192, dtype=torch.int32, device=dev)
    yield "decode contiguous", lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    # the anchors of the same step, and what single host operations cost on this machine
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    F = torch.nn.functional
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # compiles cuDNN's plan once

    def sdpa_cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    yield "sdpa cudnn decode (anchor)", sdpa_cudnn
    yield "one empty Triton launch", lambda: _nothing_kernel[(1,)](lens, 1)
    yield "one torch.empty", lambda: torch.empty(1, device=dev)
    pool_k = kc.view(512, 16, 8, 128)
    pool_v = vc.view(512, 16, 8, 128)
    table = torch.randperm(512, device=dev).to(torch.int32).view(1, 512)
    yield "decode paged16", lambda: tileattn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens,
                                                                     block_table=table)
    knew = torch.randn(1, 1, 8, 128, device=dev, dtype=dt)
    lens_app = torch.full((1,), 8000, dtype=torch.int32, device=dev)
    yield "decode contiguous + append", lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, knew, knew,
                                                                                 cache_seqlens=lens_app)
    lens_paged = torch.full((1,), 8000, dtype=torch.int32, device=dev)
    yield "decode paged16 + append", lambda: tileattn.flash_attn_with_kvcache(q, pool_k, pool_v, knew, knew,
                                                                              cache_seqlens=lens_paged,
                                                                              block_table=table)
    plan = tileattn.DecodePlan(q, pool_k, pool_v, lens_paged, table, seqlen_new=1)
    yield "DecodePlan.run paged16 + append", lambda: plan.run(q, pool_k, pool_v, k=knew, v=knew)
    params = tileattn.contract.AttnParams(128 ** -0.5)
    out = torch.empty_like(q)
    lse = torch.empty((1, 32, 1), device=dev, dtype=torch.float32)
    from tileattn import gpu
    yield "decode launcher only", lambda: gpu.attn_fwd(q, kc, vc, out, lse, params=params, seqused_k=lens,
                                                      num_splits=0)
    qp = torch.randn(32, 512, 16, 128, device=dev, dtype=dt)
    kp, vp = torch.randn_like(qp), torch.randn_like(qp)
    yield "prefill 512", lambda: tileattn.flash_attn_func(qp, kp, vp)
    qg, kg, vg = (t.clone().requires_grad_() for t in (qp, kp, vp))
    grad = torch.randn_like(qp)

    def forward_backward():
        tileattn.flash_attn_func(qg, kg, vg).backward(grad)
        qg.grad = kg.grad = vg.grad = None

    yield "prefill 512 forward+backward", forward_backward
    q1, k1, v1 = (torch.randn(1, 512, 16, 128, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    grad1 = torch.randn_like(q1)

    def forward_backward_batch1():  # host-bound: the step's wall time is its host time
        tileattn.flash_attn_func(q1, k1, v1).backward(grad1)
        q1.grad = k1.grad = v1.grad = None

    yield "prefill 1x512 forward+backward", forward_backward_batch1
    yield "prefill 1x512 forward, no grad", lambda: tileattn.flash_attn_func(q1.detach(), k1.detach(), v1.detach())
    q1t, k1t, v1t = (t.detach().transpose(1, 2).requires_grad_() for t in (q1, k1, v1))
    grad1t = grad1.transpose(1, 2)

    def sdpa_cudnn_step():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q1t, k1t, v1t).backward(grad1t)
        q1t.grad = k1t.grad = v1t.grad = None

    def sdpa_cudnn_no_grad():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(q1t, k1t, v1t)

    yield "sdpa cudnn 1x512 fwd+bwd (anchor)", sdpa_cudnn_step
    yield "sdpa cudnn 1x512 fwd, no grad (anchor)", sdpa_cudnn_no_grad
    outp = torch.empty_like(qp)
    lsep = torch.empty((32, 16, 512), device=dev, dtype=torch.float32)
    yield "prefill 512 launcher only", lambda: gpu.attn_fwd(qp, kp, vp, outp, lsep, params=params)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5, help="loops per case; the median is reported")
    p.add_argument("--top", type=int, default=18)
    args = p.parse_args()
    assert _custom is not None
    rows = []
    for name, fn in cases():
        us = per_call_us(fn, args.calls, args.repeats)
        launched = kernels_launched(fn)
        rows.append((name, us, launched))
        print(f"\n##### {name}: {us:.1f} µs per call; kernels: {launched}")
        print(top_functions(fn, args.calls, args.top))
    print("\nper-call wall time of a loop of eager calls (host-bound when the kernels are shorter)")
    for name, us, launched in rows:
        print(f"  {name:32s} {us:8.1f} µs   {len(launched)} kernels")


if __name__ == "__main__":
    main()
