"""Learnable sinks on gpt-oss's attention shape: the cost of the sink (issue #18's 0.95x target).

gpt-oss: 64 query heads over 8 KV heads, hdim 64, bf16, causal; full layers and sliding-window
layers (128 keys). Forward and forward+backward of ``tileattn.flash_attn_func`` with and without
``learnable_sink`` on the same tensors, median of ``triton.testing.do_bench`` (ms), and the ratio
(time without / time with; the target is >= 0.95). "default" is the usual dispatch (the Gluon
Hopper forward serves calls without sinks; with sinks the portable Triton kernel runs), "portable"
forces the portable kernel for both (``TILEATTN_HOPPER=0``), which isolates the sink's own cost.

    python benchmarks/sinks.py [--seqlen 8192] [--batch 2]
"""

from __future__ import annotations

import argparse
import os

import torch
import triton

import tileattn


def timings(batch: int, seqlen: int, window: int) -> dict[str, float]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen, 64, 64, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
            for _ in range(2))
    sink = torch.randn(64, device="cuda", generator=gen, requires_grad=True)
    dout = torch.randn_like(q)
    win = (window - 1, 0) if window else (-1, -1)
    result = {}
    for name, s in (("no sink", None), ("sink", sink)):
        def fwd():
            return tileattn.flash_attn_func(q, k, v, causal=True, window_size=win, learnable_sink=s)

        def fwd_bwd():
            grads = [q, k, v] + ([s] if s is not None else [])
            torch.autograd.grad(fwd(), grads, dout)

        with torch.no_grad():
            result[f"fwd {name}"] = triton.testing.do_bench(fwd)
        result[f"fwd+bwd {name}"] = triton.testing.do_bench(fwd_bwd)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(f"gpt-oss attention: batch {args.batch} x {args.seqlen} tokens, 64 q heads / 8 kv heads, hdim 64, bf16, "
          f"causal; {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for dispatch in ("default", "portable"):
        os.environ["TILEATTN_HOPPER"] = "1" if dispatch == "default" else "0"
        for window in (0, 128):
            t = timings(args.batch, args.seqlen, window)
            layer = f"window {window}" if window else "full"
            for part in ("fwd", "fwd+bwd"):
                ratio = t[f"{part} no sink"] / t[f"{part} sink"]
                print(f"{dispatch:8s} {layer:10s} {part:8s} no sink {t[f'{part} no sink']:7.3f} ms  "
                      f"sink {t[f'{part} sink']:7.3f} ms  ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
