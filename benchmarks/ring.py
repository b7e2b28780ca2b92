"""Context parallelism per GPU against the single-GPU kernel, and how much of the transfer it hides.

    torchrun --nproc_per_node N benchmarks/ring.py [--tokens 8192 16384] [--varlen llama3] [--model-world 4 8]
    python benchmarks/ring.py --tokens 512 --heads 2 --hdim 32   # a world of one process (CPU ok)

Dense (default): per-GPU length s, causal (zigzag shards) and not, bf16, batch 1, 16 heads of
128. ``--varlen llama3``: documents of 1k-16k tokens (seeded) packed into s tokens per GPU,
causal, through llama3's forward and backward (the rows other ranks read travel
``--heads-k-stride`` heads at a time); one GPU runs ``flash_attn_varlen_func`` on s tokens
packed the same way (the first s tokens of the same draw: rank 0's documents). Timed:

    single   the backend kernel alone on s tokens per GPU (fwd; fwd + bwd)
    ring     the ring (or llama3) on W s tokens, each GPU holding s of them
    compute  the same loop with every transfer replaced by local data (same calls, same merges:
             the time if communication were free)
    comm     the transfers of one forward alone (dense: the K/V exchanges of the plan; llama3:
             the all-gathers), and of one forward + backward (dense: K/V twice and the dK/dV
             returns; llama3: gathers twice and the reduce-scatters)

``hidden`` = 1 - (ring - compute) / comm: the share of the transfer time hidden behind compute.
FLOPs: 4 h d per visible (query, key) pair (causal: half), fwd + bwd 3.5x the forward; a ring
GPU's share is 1/W of the whole batch's count.

``--model-world 4 8`` (dense): after the measured table, a MODELLED one for those world sizes,
from this run's own columns (``model_world``): per-rank compute = single + (W-1) x the time of
one off-diagonal block, exposed transfer = (W-1) x the exposed transfer per step measured.

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
from tileattn.contract import AttnParams
from tileattn.distributed import llama3 as L3
from tileattn.distributed import (
    contiguous_shard,
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    zigzag_ring_flash_attn_func,
    zigzag_shard,
    zigzag_unshard,
)
from tileattn.distributed.comm import Peers
from tileattn.distributed.engine import Shard, _post_grad, _post_kv, _span, ring_bwd, ring_fwd
from tileattn.distributed.ring import DensePlan
from tileattn.ops.backend import backend_for


class _Done:
    def __init__(self, tensor):
        self._tensor = tensor

    def wait(self):
        return self._tensor


class LocalPeers:
    """``Peers`` with no communication: every "received" tensor is one of the local shape."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def exchange(self, send, send_to, recv_like, recv_from, tag):
        return _Done(recv_like)

    def post(self, sends, recvs):
        return _Done(None)


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


def _summary(ms: dict, flops_single: float, flops_ring: float, world: int) -> dict:
    tflops = {name: (flops_single if name.startswith("single") else flops_ring) * (3.5 if "bwd" in name else 1.0)
              / (t * 1e-3) / 1e12 for name, t in ms.items() if not name.startswith("comm")}
    hidden = {}
    for part, comm in (("fwd", "comm fwd"), ("fwd+bwd", "comm fwd+bwd")):
        exposed = ms[f"ring {part}"] - ms[f"compute {part}"]
        hidden[part] = 1.0 - exposed / ms[comm] if world > 1 and ms[comm] > 0 else float("nan")
    return dict(ms=ms, tflops=tflops, hidden=hidden)


def model_world(ms: dict, world: int, target: int) -> dict:
    """Modelled ms of a zigzag ring of ``target`` GPUs at the same tokens per GPU, from the ms
    measured on ``world`` >= 2 GPUs. Per part (fwd, fwd+bwd): one off-diagonal block (two shards,
    s^2/2 entries causal, s^2 full: the same at any W) takes ``t_off = (compute - single) / (W - 1)``
    and each ring step exposes ``e = (ring - compute) / (W - 1)`` of transfer (a step moves the same
    bytes at any W); then ``compute_T = single + (T - 1) t_off`` and ``ring_T = compute_T + (T - 1) e``.
    A GPU's share of the FLOPs is T x one GPU's, so ``ring/1 = T single / ring_T``."""
    out = {}
    for part in ("fwd", "fwd+bwd"):
        single, compute, ring = ms[f"single {part}"], ms[f"compute {part}"], ms[f"ring {part}"]
        t_off, exposed = (compute - single) / (world - 1), (ring - compute) / (world - 1)
        out[f"compute {part}"] = single + (target - 1) * t_off
        out[f"ring {part}"] = out[f"compute {part}"] + (target - 1) * exposed
        out[f"ring/1 {part}"] = target * single / out[f"ring {part}"]
    return out


# ----------------------------------------------------------------------------- dense, zigzag


def run_dense(tokens: int, causal: bool, args, device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = backend_for(device)
    dtype = getattr(torch, args.dtype)
    shape = (args.batch, tokens, args.heads, args.hdim)
    gen = torch.Generator(device=device).manual_seed(1234)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(4))
    params = AttnParams(softmax_scale=args.hdim**-0.5, window_right=0 if causal else -1)
    plan = DensePlan(world, tokens, params, zigzag=True)
    out, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse = torch.empty(args.batch, args.heads, tokens, device=device, dtype=torch.float32)

    def single_fwd():
        backend.attn_fwd(q, k, v, out, lse, params=params)

    def single_fwd_bwd():
        single_fwd()
        backend.attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, params=params)

    real, local = Peers(None), LocalPeers(rank, world)

    def ring(peers, bwd: bool):
        def fn():
            o, l_ = ring_fwd(q, k, v, plan, peers)
            if bwd:
                ring_bwd(dout, q, k, v, o, l_, plan, peers, deterministic=False)
        return fn

    shard = Shard(k, v, plan.packed)
    kv = shard.pack(k, v)  # what the engine sends: one message per step; the gradients of the rows
    # another rank read return in the same dtype and layout
    steps = plan.steps(world)[1:]

    def comm(bwd: bool):  # the ring's own exchanges (only the rows each rank reads), one after the other
        def fn():
            for _ in range(2 if bwd else 1):
                for s in steps:
                    _post_kv(real, plan, kv, shard.axis, s).wait()
            if bwd:  # the dK/dV returns
                for s in steps:
                    span = _span(plan.calls(rank, (rank - s) % world), tokens)
                    grad = None if span is None else kv.narrow(shard.axis, span.start,
                                                               span.stop - span.start).contiguous()
                    _post_grad(real, plan, kv, shard.axis, grad, s).wait()
        return fn

    flops_single = 4 * args.batch * args.heads * tokens**2 * args.hdim * (0.5 if causal else 1.0)
    timing = dict(warmup=args.warmup, reps=args.reps, device=device)
    ms = {"single fwd": bench(single_fwd, **timing), "ring fwd": bench(ring(real, False), **timing),
          "compute fwd": bench(ring(local, False), **timing), "single fwd+bwd": bench(single_fwd_bwd, **timing),
          "ring fwd+bwd": bench(ring(real, True), **timing), "compute fwd+bwd": bench(ring(local, True), **timing),
          "comm fwd": bench(comm(False), **timing), "comm fwd+bwd": bench(comm(True), **timing)}
    return _summary(ms, flops_single, flops_single * world, world)


def check_dense(tokens: int, causal: bool, args, device) -> float:
    """Largest |ring - one GPU| over out, dq, dk, dv: ``zigzag_ring_flash_attn_func`` on the shards of
    one sequence of W x tokens, gathered, against ``flash_attn_func`` on the whole of it (both in
    the benchmark's dtype; tests/test_ring.py holds them to the tolerance rule)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(99)  # the same full tensors on every rank
    shape = (args.batch, tokens * world, args.heads, args.hdim)
    full = [torch.randn(shape, generator=gen, device=device, dtype=getattr(torch, args.dtype)) for _ in range(4)]
    q, k, v = (zigzag_shard(t, rank, world).detach().requires_grad_() for t in full[:3])
    out = zigzag_ring_flash_attn_func(q, k, v, causal=causal)
    out.backward(zigzag_shard(full[3], rank, world))
    gathered = [zigzag_unshard(_all_gather(t)) for t in (out.detach(), q.grad, k.grad, v.grad)]
    qf, kf, vf = (t.detach().requires_grad_() for t in full[:3])
    ref = tileattn.flash_attn_func(qf, kf, vf, causal=causal)
    ref.backward(full[3])
    return _max_diff(gathered, [ref.detach(), qf.grad, kf.grad, vf.grad])


def _all_gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _max_diff(xs, ys) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(xs, ys))


# ----------------------------------------------------------------------------- packed, llama3


def packed_docs(tokens: int, seed: int, lo: int, hi: int) -> list[int]:
    """Document lengths drawn uniformly from [lo, hi] (seeded), the last cut to fill ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    while sum(docs) < tokens:
        docs.append(min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), tokens - sum(docs)))
    return docs


def _cu(docs, device):
    return torch.tensor([0] + docs, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def _causal_flops(docs, heads: int, hdim: int) -> float:
    return sum(4 * heads * hdim * n * (n + 1) / 2 for n in docs)


def run_llama3(tokens: int, args, device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(4321)
    docs = packed_docs(tokens * world, 7, args.doc_min, args.doc_max)
    one = packed_docs(tokens, 7, args.doc_min, args.doc_max)  # one GPU: the same draw on s tokens
    cu, cu_one = _cu(docs, device), _cu(one, device)
    shape = (tokens, args.heads, args.hdim)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(4))
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)

    def single(bwd: bool):
        qs, ks, vs = (t.detach().requires_grad_(bwd) for t in (q, k, v))

        def fn():
            o = tileattn.flash_attn_varlen_func(qs, ks, vs, cu_one, cu_one, max(one), max(one), causal=True)
            if bwd:
                o.backward(dout)
        return fn

    params = AttnParams(softmax_scale=args.hdim**-0.5, window_right=0)
    real, local = Peers(None), LocalPeers(rank, world)
    plan = L3._plan(q, cu_q, cu_k, k_slice, params, False, args.heads_k_stride, args.heads, real)

    def ring(peers, bwd: bool):
        def fn():
            o, l_, kept = L3.llama3_fwd(q, k, v, plan, peers)
            if bwd:
                L3.llama3_bwd(dout, q, k, v, o, l_, None, plan, kept, peers, deterministic=False)
        return fn

    def comm(bwd: bool):  # the rows other ranks read, and with bwd their gradients' return
        def fn():
            for c in range(len(plan.chunks)):
                bufs, transfer = L3._post_kv(plan, k, v, c, real)
                transfer.wait()
                if bwd:
                    L3._post_grads(plan, k, v, c, bufs, real)[0].wait()
        return fn

    timing = dict(warmup=args.warmup, reps=args.reps, device=device)
    ms = {"single fwd": bench(single(False), **timing), "ring fwd": bench(ring(real, False), **timing),
          "compute fwd": bench(ring(local, False), **timing), "single fwd+bwd": bench(single(True), **timing),
          "ring fwd+bwd": bench(ring(real, True), **timing),
          "compute fwd+bwd": bench(ring(local, True), **timing),
          "comm fwd": bench(comm(False), **timing), "comm fwd+bwd": bench(comm(True), **timing)}
    res = _summary(ms, _causal_flops(one, args.heads, args.hdim), _causal_flops(docs, args.heads, args.hdim) / world,
                   world)
    res["docs"] = len(docs)
    return res


def check_llama3(tokens: int, args, device) -> float:
    """Largest |llama3 ring - one GPU| over out, dq, dk, dv on one packed batch of W x tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(98)
    docs = packed_docs(tokens * world, 8, max(1, tokens // 8), tokens)
    cu = _cu(docs, device)
    shape = (tokens * world, args.heads, args.hdim)
    full = [torch.randn(shape, generator=gen, device=device, dtype=getattr(torch, args.dtype)) for _ in range(4)]
    q, k, v = (contiguous_shard(t, rank, world, dim=0).detach().requires_grad_() for t in full[:3])
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
    out = llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, args.heads_k_stride, k_slice, causal=True)
    out.backward(contiguous_shard(full[3], rank, world, dim=0))
    gathered = [torch.cat(_all_gather(t), 0) for t in (out.detach(), q.grad, k.grad, v.grad)]
    qf, kf, vf = (t.detach().requires_grad_() for t in full[:3])
    ref = tileattn.flash_attn_varlen_func(qf, kf, vf, cu, cu, max(docs), max(docs), causal=True)
    ref.backward(full[3])
    return _max_diff(gathered, [ref.detach(), qf.grad, kf.grad, vf.grad])


# ----------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384], help="tokens per GPU")
    parser.add_argument("--varlen", choices=["none", "llama3"], default="none")
    parser.add_argument("--heads-k-stride", type=int, default=4, help="llama3: K/V heads gathered at a time")
    parser.add_argument("--doc-min", type=int, default=1024)
    parser.add_argument("--doc-max", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--check-tokens", type=int, default=2048, help="tokens per GPU of the correctness check")
    parser.add_argument("--model-world", type=int, nargs="*", default=[],
                        help="dense: also print modelled figures for these world sizes (see model_world)")
    args = parser.parse_args()
    device = init()
    world, rank = dist.get_world_size(), dist.get_rank()
    llama3 = args.varlen == "llama3"
    cases = [(t, True) for t in args.tokens] if llama3 else [(t, c) for t in args.tokens for c in (False, True)]
    for causal in sorted({c for _, c in cases}):
        err = check_llama3(args.check_tokens, args, device) if llama3 else check_dense(args.check_tokens, causal,
                                                                                       args, device)
        if rank == 0:
            print(f"check: {world} ranks x {args.check_tokens} tokens, {args.varlen if llama3 else 'zigzag'}, causal "
                  f"{causal}: largest |ring - one GPU| over out, dq, dk, dv = {err:.3g}", flush=True)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        what = (f"llama3 varlen, documents {args.doc_min}-{args.doc_max}, heads_k_stride {args.heads_k_stride}"
                if llama3 else "zigzag")
        print(f"context parallel ({what}): {world} x {name}, torch {torch.__version__}, {args.dtype}, "
              f"batch {args.batch}, {args.heads} heads x {args.hdim}; TFLOP/s per GPU (ms)")
        print(f"{'tokens/GPU':>10} {'causal':>6} | {'single fwd':>16} {'ring fwd':>16} {'compute fwd':>16} | "
              f"{'single f+b':>16} {'ring f+b':>16} {'compute f+b':>16} | {'ring/1':>6} | {'comm f':>7} "
              f"{'comm f+b':>8} | {'hidden f':>8} {'hidden f+b':>10}")
    measured = []
    for tokens, causal in cases:
        res = run_llama3(tokens, args, device) if llama3 else run_dense(tokens, causal, args, device)
        measured.append((tokens, causal, res))
        if rank == 0:
            cells = [f"{res['tflops'][n]:7.1f} ({res['ms'][n]:6.2f})" for n in
                     ("single fwd", "ring fwd", "compute fwd", "single fwd+bwd", "ring fwd+bwd", "compute fwd+bwd")]
            ratio = res["tflops"]["ring fwd+bwd"] / res["tflops"]["single fwd+bwd"]
            print(f"{tokens:>10} {str(causal):>6} | {' '.join(cells[:3])} | {' '.join(cells[3:])} | {ratio:6.2f} | "
                  f"{res['ms']['comm fwd']:7.2f} {res['ms']['comm fwd+bwd']:8.2f} | {res['hidden']['fwd']:8.1%} "
                  f"{res['hidden']['fwd+bwd']:10.1%}", flush=True)
    if rank == 0 and args.model_world and not llama3:
        if world < 2:
            print("--model-world needs a measured ring of at least 2 GPUs")
        else:
            print(f"MODELLED from the {world}-GPU rows above (model_world): ms per GPU, TFLOP/s in brackets")
            print(f"{'GPUs':>4} {'tokens/GPU':>10} {'causal':>6} | {'compute fwd':>16} {'ring fwd':>16} | "
                  f"{'compute f+b':>16} {'ring f+b':>16} | {'ring/1 f':>8} {'ring/1 f+b':>10}")
            for target in args.model_world:
                for tokens, causal, res in measured:
                    m = model_world(res["ms"], world, target)
                    flops = 4 * args.batch * args.heads * tokens**2 * args.hdim * (0.5 if causal else 1.0) * target
                    cells = [f"{m[n]:7.2f} ({flops * (3.5 if 'bwd' in n else 1.0) / (m[n] * 1e-3) / 1e12:6.1f})"
                             for n in ("compute fwd", "ring fwd", "compute fwd+bwd", "ring fwd+bwd")]
                    print(f"{target:>4} {tokens:>10} {str(causal):>6} | {' '.join(cells[:2])} | "
                          f"{' '.join(cells[2:])} | {m['ring/1 fwd']:8.2f} {m['ring/1 fwd+bwd']:10.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
