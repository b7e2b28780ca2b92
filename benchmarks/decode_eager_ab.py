"""Eager decoding calls with the split merge in the forward launch or not (``gpu.combine.EAGER_MERGE``), on a GPU.

The decoding step of docs/perf-notes.md (batch 1, GQA 32/8, hdim 128, bf16, 8k keys with 8000 in
use; contiguous and paged 16, split as the GPU's rule splits them), called eagerly in a loop: the
wall time per call is host-bound there. Each process times both arms interleaved, the constant
flipped between loops (it is read on every call), the first arm alternating from loop to loop,
beside SDPA's cuDNN decode as the in-process anchor; the GPU hosts' speed drifts up to 2x between
processes, so run it in several fresh ones and compare each process's pair. It also prints the
kernels one call of each arm launches (start+duration on the device, after an L2 flush).

    for i in 1 2 3 4 5; do python benchmarks/decode_eager_ab.py [--calls 300] [--loops 9]; done
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tileattn
from overhead import kernels_launched
from tileattn.gpu import combine


def cases():
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt, generator=gen)
    kc, vc = (torch.randn(1, 8192, 8, 128, device=dev, dtype=dt, generator=gen) for _ in "kv")
    lens = torch.tensor([8000], dtype=torch.int32, device=dev)
    table = torch.randperm(512, device=dev, generator=gen).to(torch.int32).view(1, 512)
    qs, ks, vs = q.transpose(1, 2), kc[:, :8000].transpose(1, 2), vc[:, :8000].transpose(1, 2)

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

    yield "sdpa cudnn decode (anchor)", cudnn
    yield "decode contiguous", lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    yield "decode paged16", lambda: tileattn.flash_attn_with_kvcache(
        q, kc.view(512, 16, 8, 128), vc.view(512, 16, 8, 128), cache_seqlens=lens, block_table=table)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--loops", type=int, default=9, help="loops per arm; the median is reported")
    args = p.parse_args()
    times, names = {}, []
    for name, fn in cases():
        names.append(name)
        for merge in (False, True):  # warm: each arm's kernels compiled and kept
            combine.EAGER_MERGE = merge
            for _ in range(30):
                fn()
        torch.cuda.synchronize()
        for loop in range(args.loops):
            for merge in ((False, True) if loop % 2 == 0 else (True, False)):
                combine.EAGER_MERGE = merge
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                torch.cuda.synchronize()
                times.setdefault((name, merge), []).append((time.perf_counter() - t0) / args.calls * 1e6)
        for merge in (False, True):
            combine.EAGER_MERGE = merge
            print(f"# {name}, EAGER_MERGE={merge}: {'  '.join(kernels_launched(fn))}")
    anchor = statistics.median(times["sdpa cudnn decode (anchor)", False] + times["sdpa cudnn decode (anchor)", True])
    print(f"{'case':28s} {'two launches':>13s} {'merged':>8s} {'delta':>7s}   (µs per call, median; "
          f"cuDNN anchor {anchor:.1f})")
    for name in names:
        two, merged = (statistics.median(times[name, merge]) for merge in (False, True))
        print(f"{name:28s} {two:13.1f} {merged:8.1f} {merged - two:+7.1f}")


if __name__ == "__main__":
    main()
