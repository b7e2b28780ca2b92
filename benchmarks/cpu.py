"""CPU attention: tileattn's tiled torch path vs torch SDPA vs naive softmax(q kᵀ) v.

fp32, (batch 1, 8 heads, N tokens, hdim 64), not causal; N = 1024 / 2048 / 4096 (and 8192
with ``--full``). Each implementation gets its inputs in its own layout, made before timing
(SDPA and naive: (1, 8, N, 64); tileattn: (1, N, 8, 64)); all see the same values.
Throughput is 4·N²·8·64 FLOPs over the median time (``time.perf_counter``, after a warm-up).

Peak memory. tracemalloc cannot see torch's allocations, and torch's CPU profiler reports
allocations without the allocator's real footprint, so each (implementation, N) runs in a
fresh subprocess (Linux) that, just before its first call (inputs made, libraries loaded),
resets its resident-set high-water mark (``echo 5 > /proc/self/clear_refs``; the mark left
by ``import torch`` would otherwise hide smaller peaks, which is why ``ru_maxrss`` is not
used) and reports ``VmHWM`` after the call minus ``VmRSS`` before it, minus the output's own
bytes. Large torch CPU buffers are mmapped and returned to the OS when freed, so this is the
call's transient peak (a few MB of one-time thread-pool setup included).

    python benchmarks/cpu.py [--full] [--quick] [--out DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import common

IMPLS = ("tileattn", "sdpa", "naive")
HEADS, HDIM = 8, 64


def reps_for(n: int) -> int:
    return 5 if n <= 2048 else 3 if n <= 4096 else 2


def proc_status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: peak), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (the memory measurement needs Linux)")


def worker(impl: str, n: int) -> dict:
    """Runs in its own process: time one implementation at one N and measure its peak RSS growth."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, HEADS, n, HDIM, generator=g) for _ in range(3))  # (B, H, N, D)
    if impl == "tileattn":
        import tileattn

        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, N, H, D)
        fn = lambda: tileattn.flash_attn_func(q, k, v)  # noqa: E731
    elif impl == "sdpa":
        fn = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    else:
        fn = lambda: torch.softmax(q @ k.transpose(-1, -2) * HDIM**-0.5, dim=-1) @ v  # noqa: E731
    with torch.inference_mode():
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        before = proc_status_kib("VmRSS")
        out = fn()
        extra_mb = (proc_status_kib("VmHWM") - before) / 1024 - out.numel() * out.element_size() / 2**20
        del out
        ms = common.bench(fn, "cpu", cpu_reps=reps_for(n))
    return {"ms": ms, "peak_extra_mb": max(extra_mb, 0.0), "threads": torch.get_num_threads()}


def run(impl: str, n: int, timeout: int) -> dict:
    """Start a worker process; a failure or a timeout becomes an n/a row with a note."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, str(n)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"note": f"timed out after {timeout} s"}
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["?"])[-1]
        return {"note": f"worker failed: {tail[:160]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def plot(rows, path, env) -> None:
    fig, axes = common.new_figure(2, 1, width=4.5)
    for impl in IMPLS:
        pts = sorted((r["N"], common.nan(r["gflops"]), common.nan(r["peak_extra_mb"])) for r in rows if r["impl"] == impl)
        if pts:
            xs, ys, ms = zip(*pts)
            axes[0][0].plot(xs, ys, marker="o", label=impl)
            axes[0][1].plot(xs, ms, marker="o", label=impl)
    for ax, label in ((axes[0][0], "GFLOP/s"), (axes[0][1], "peak RSS growth (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][1].set_yscale("log")
    common.save_figure(fig, path, f"CPU fp32 (1, 8, N, 64) · {env['device']} · torch {env['torch']}")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="add N = 8192 (naive then needs ~4 GB)")
    p.add_argument("--quick", action="store_true", help="N = 1024 and 2048 only")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--dry-run", action="store_true", help="print the cases; run nothing")
    p.add_argument("--timeout", type=int, default=900, help="seconds per (implementation, N) worker")
    args = p.parse_args()
    ns = (1024, 2048) if args.quick else (1024, 2048, 4096, 8192) if args.full else (1024, 2048, 4096)
    if args.dry_run:
        common.print_table("cpu cases", ["N", "GFLOP", "reps", "naive scores MB"],
                           [[n, common.fmt(common.attn_flops(1, HEADS, n, n, HDIM) / 1e9), reps_for(n),
                             common.fmt(HEADS * n * n * 4 / 2**20)] for n in ns])
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = common.env_info("cpu")
    common.print_env(env)
    rows = []
    for n in ns:
        for impl in IMPLS:
            r = {"N": n, "impl": impl, "load_1min": round(os.getloadavg()[0], 2), **run(impl, n, args.timeout)}
            r["gflops"] = common.tflops(common.attn_flops(1, HEADS, n, n, HDIM), r.get("ms"))
            r["gflops"] = r["gflops"] and r["gflops"] * 1e3
            rows.append(r)
            print(f"  N {n} {impl}: {common.fmt(r.get('ms'))} ms, {common.fmt(r['gflops'])} GFLOP/s, "
                  f"+{common.fmt(r.get('peak_extra_mb'))} MB {r.get('note', '')}", flush=True)
    sdpa = {r["N"]: r.get("ms") for r in rows if r["impl"] == "sdpa"}
    common.print_table("CPU attention, fp32 (1, 8, N, 64), not causal",
                       ["N", "impl", "ms", "GFLOP/s", "× SDPA throughput", "peak RSS growth MB", "load avg"],
                       [[r["N"], r["impl"], common.fmt(r.get("ms")), common.fmt(r["gflops"]),
                         common.fmt(sdpa[r["N"]] / r["ms"], 2) if r.get("ms") and sdpa.get(r["N"]) else "n/a",
                         common.fmt(r.get("peak_extra_mb")), common.fmt(r["load_1min"], 1)] for r in rows],
                       caption="load avg: the machine's 1-minute load average when the case started (2 cores)")
    common.print_notes(rows)
    common.write_csv(f"{args.out}/cpu.csv", rows, env)
    plot(rows, f"{args.out}/cpu.png", env)


if __name__ == "__main__":
    main()
