"""Ring attention per GPU against the single-GPU kernel, and how much communication it hides.

    torchrun --nproc_per_node N benchmarks/ring.py [--tokens 8192 16384 32768]
    python benchmarks/ring.py                         # a world of one process

For every per-GPU length s (tokens per GPU), causal (zigzag layout) and not, bf16, batch 1,
16 heads of 128 (nheads x hdim = 2048, as in the FlashAttention papers), it times:

    single   the backend kernel alone on s tokens (attn_fwd; attn_fwd + attn_bwd)
    ring     the ring over W s tokens, each GPU holding s of them
    compute  the same ring loop with every transfer replaced by the local K/V (same blocks,
             same masks, same merges: the ring's time if communication were free)
    comm     the W-1 K/V transfers of one forward alone

FLOPs: forward 4 b h S^2 d (half when causal), fwd + bwd 3.5x that (backward 2.5x); the ring's
per-GPU share is 1/W of the whole sequence's count. ``hidden`` = 1 - (ring - compute) / comm is
the share of the forward's transfer time hidden behind compute.

Timing: every rank runs the same fixed number of repetitions between barriers (do_bench picks
its own count per rank, which would deadlock the ring); per repetition the slowest rank counts,
and the median over repetitions is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import tileattn
from tileattn.distributed.ring import _ring_bwd, _ring_fwd, _Ring, ring_flash_attn_func, zigzag_shard, zigzag_unshard
from tileattn.contract import AttnParams
from tileattn.ops.backend import backend_for


class _LocalRing:
    """The ring's interface with no communication: every "received" shard is the local one."""

    class _Done:
        def __init__(self, tensor):
            self._tensor = tensor

        def wait(self):
            return self._tensor

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def shift(self, tensor, tag):
        return self._Done(tensor)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(fn, device, warmup: int, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's time of ``fn()``, in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item() * 1e3)
    return statistics.median(times)


def init() -> torch.device:
    if "RANK" not in os.environ:  # plain `python benchmarks/ring.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def run_case(tokens: int, causal: bool, args, device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = backend_for(device)
    dtype = getattr(torch, args.dtype)
    shape = (args.batch, tokens, args.heads, args.hdim)
    gen = torch.Generator(device=device).manual_seed(1234)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(4))
    scale = args.hdim**-0.5
    params = AttnParams(softmax_scale=scale, window_right=0 if causal else -1)
    out, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse = torch.empty(args.batch, args.heads, tokens, device=device, dtype=torch.float32)

    def single_fwd():
        backend.attn_fwd(q, k, v, out, lse, params=params)

    def single_fwd_bwd():
        single_fwd()
        backend.attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, params=params)

    real, local = _Ring(None), _LocalRing(rank, world)
    opts = dict(scale=scale, causal=causal, layout="zigzag")

    def ring_fwd(ring):
        return lambda: _ring_fwd(q, k, v, ring=ring, **opts)

    def ring_fwd_bwd(ring):
        def fn():
            o, l = _ring_fwd(q, k, v, ring=ring, **opts)
            _ring_bwd(dout, q, k, v, o, l, ring=ring, deterministic=False, **opts)
        return fn

    kv = torch.stack([k, v])

    def comm():
        shard = kv
        for _ in range(world - 1):
            shard = real.shift(shard, 0).wait()

    flops_single = 4 * args.batch * args.heads * tokens**2 * args.hdim * (0.5 if causal else 1.0)
    flops_ring = flops_single * world  # (W s)^2 / W
    timing = dict(warmup=args.warmup, reps=args.reps, device=device)
    ms = {
        "single fwd": bench(single_fwd, **timing),
        "ring fwd": bench(ring_fwd(real), **timing),
        "compute fwd": bench(ring_fwd(local), **timing),
        "single fwd+bwd": bench(single_fwd_bwd, **timing),
        "ring fwd+bwd": bench(ring_fwd_bwd(real), **timing),
        "compute fwd+bwd": bench(ring_fwd_bwd(local), **timing),
        "comm": bench(comm, **timing),
    }
    tflops = {name: (flops_single if name.startswith("single") else flops_ring) * (3.5 if "bwd" in name else 1.0)
              / (t * 1e-3) / 1e12 for name, t in ms.items() if name != "comm"}
    exposed = ms["ring fwd"] - ms["compute fwd"]
    hidden = 1.0 - exposed / ms["comm"] if world > 1 and ms["comm"] > 0 else float("nan")
    return dict(ms=ms, tflops=tflops, hidden=hidden)


def check(tokens: int, causal: bool, args, device) -> float:
    """Largest |ring - one GPU| over out, dq, dk, dv: ``ring_flash_attn_func`` on the zigzag shards
    of one sequence of W x tokens, gathered, against ``flash_attn_func`` on the whole of it
    (both in the benchmark's dtype; tests/test_ring.py holds them to the tolerance rule)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(99)  # the same full tensors on every rank
    shape = (args.batch, tokens * world, args.heads, args.hdim)
    full = [torch.randn(shape, generator=gen, device=device, dtype=getattr(torch, args.dtype)) for _ in range(4)]
    q, k, v = (zigzag_shard(t, rank, world).detach().requires_grad_() for t in full[:3])
    out = ring_flash_attn_func(q, k, v, causal=causal)
    out.backward(zigzag_shard(full[3], rank, world))
    mine = [out.detach(), q.grad, k.grad, v.grad]
    gathered = []
    for t in mine:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        gathered.append(zigzag_unshard(parts))
    qf, kf, vf = (t.detach().requires_grad_() for t in full[:3])
    ref = tileattn.flash_attn_func(qf, kf, vf, causal=causal)
    ref.backward(full[3])
    return max((a.float() - b.float()).abs().max().item()
               for a, b in zip(gathered, [ref.detach(), qf.grad, kf.grad, vf.grad]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768], help="tokens per GPU")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--check-tokens", type=int, default=2048, help="tokens per GPU of the correctness check")
    args = parser.parse_args()
    device = init()
    world = dist.get_world_size()
    for causal in (False, True):
        err = check(args.check_tokens, causal, args, device)
        if dist.get_rank() == 0:
            print(f"check: {world} ranks x {args.check_tokens} tokens, causal {causal}: largest |ring - one GPU| "
                  f"over out, dq, dk, dv = {err:.3g}", flush=True)
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"ring attention: {world} x {name}, torch {torch.__version__}, {args.dtype}, batch {args.batch}, "
              f"{args.heads} heads x {args.hdim}; TFLOP/s per GPU (ms)")
        print(f"{'tokens/GPU':>10} {'causal':>6} | {'single fwd':>16} {'ring fwd':>16} {'compute fwd':>16} | "
              f"{'single f+b':>16} {'ring f+b':>16} {'compute f+b':>16} | {'comm ms':>8} {'hidden':>7}")
    for tokens in args.tokens:
        for causal in (False, True):
            res = run_case(tokens, causal, args, device)
            if dist.get_rank() == 0:
                cells = [f"{res['tflops'][n]:7.1f} ({res['ms'][n]:6.2f})" for n in
                         ("single fwd", "ring fwd", "compute fwd", "single fwd+bwd", "ring fwd+bwd", "compute fwd+bwd")]
                print(f"{tokens:>10} {str(causal):>6} | {' '.join(cells[:3])} | {' '.join(cells[3:])} | "
                      f"{res['ms']['comm']:8.2f} {res['hidden']:7.1%}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
