"""Host overhead on the CPU: a tiny decoding call and a tiny prefill, tileattn against torch SDPA.

Problems small enough that the arithmetic is a few microseconds, so the per-call cost is the
Python and dispatch around it (issue #17's CPU target: within 2x of SDPA's per-call time):

* decode: q (1, 1, 8, 64) over a contiguous fp32 cache of 200 keys (GQA 8/2) given by
  ``cache_seqlens``; SDPA gets the same 200 keys as (1, 2, 200, 64) with ``enable_gqa``;
* decode + append: the same, writing one new key/value into the cache first;
* prefill: q, k, v (1, 64, 8, 64) fp32, causal; SDPA with ``is_causal``;
* varlen prefill: two packed sequences of 32 tokens, causal; SDPA on (2, 8, 32, 64).

Both run in one process, interleaved, one thread (``torch.set_num_threads(1)``, as the tests
run). Time is the process's CPU time (``time.process_time``), which other processes on a
shared machine do not inflate; the table shows the least over ``--rounds`` rounds of
``--calls`` calls each.

    python benchmarks/overhead_cpu.py [--calls 300] [--rounds 7] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

os.environ.setdefault("TILEATTN_BACKEND", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tileattn  # noqa: E402


def cases():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, 64, generator=gen)
    kc, vc = torch.randn(1, 256, 2, 64, generator=gen), torch.randn(1, 256, 2, 64, generator=gen)
    lens = torch.tensor([200], dtype=torch.int32)
    k_new, v_new = torch.randn(1, 1, 2, 64, generator=gen), torch.randn(1, 1, 2, 64, generator=gen)
    qs, ks, vs = q.transpose(1, 2), kc[:, :200].transpose(1, 2).contiguous(), vc[:, :200].transpose(1, 2).contiguous()
    yield ("decode", lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
           lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
    yield ("decode + append", lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens,
                                                                       causal=True),
           lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
    qp, kp, vp = (torch.randn(1, 64, 8, 64, generator=gen) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (qp, kp, vp))
    yield ("prefill 64", lambda: tileattn.flash_attn_func(qp, kp, vp, causal=True),
           lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    qv, kv, vv = qp[0], kp[0], vp[0]
    qb, kb, vb = (t.view(2, 32, 8, 64).transpose(1, 2).contiguous() for t in (qv, kv, vv))
    yield ("varlen prefill 2x32", lambda: tileattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, 32, 32, causal=True),
           lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True))


def per_call_us(fn, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions of each tileattn call")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, backend {os.environ['TILEATTN_BACKEND']}, 1 thread")
    print(f"{'case':22s} {'tileattn µs':>12s} {'SDPA µs':>9s} {'ratio':>6s}")
    for name, ours, theirs in cases():
        for fn in (ours, theirs):
            per_call_us(fn, 20)  # warm-up
        t_ours, t_theirs = [], []
        for _ in range(args.rounds):
            t_ours.append(per_call_us(ours, args.calls))
            t_theirs.append(per_call_us(theirs, args.calls))
        a, b = min(t_ours), min(t_theirs)
        print(f"{name:22s} {a:12.1f} {b:9.1f} {a / b:6.2f}")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            per_call_us(ours, args.calls)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-3000:])


if __name__ == "__main__":
    main()
