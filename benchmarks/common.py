"""Shared pieces of the tileattn benchmarks: timing, ceilings, FLOP counts, tables, CSV, plots.

Every script in this folder is run as ``python benchmarks/<name>.py [--quick] [--out DIR]``
(this folder is then on ``sys.path``, so ``import common`` works) with ``PYTHONPATH=src``.

Timing rules:

* GPU: the median of ``triton.testing.do_bench(fn, warmup=25, rep=100)``; do_bench clears
  the L2 cache before every repetition, so a kernel is timed reading from HBM. It clears it
  by writing zeros to 256 MB, which leaves the L2 full of dirty lines: a kernel that reads
  less than the L2 holds also pays for writing those back. ``bench(..., l2="read")`` clears
  it by reading the 256 MB instead (clean lines), with the same warm-up, repetition time and
  median: the state a serving loop's attention finds after kernels that mostly read weights.
* CPU: the median of ``time.perf_counter`` over a few repetitions after one warm-up call.

Counting rules (see docs/benchmarks.md):

* attention forward FLOPs = 4·b·h·sq·sk·d (two matmuls, 2 FLOPs per multiply-add), half that
  when causal; backward = 2.5 × forward, timed as (forward+backward) − forward.
* bytes: what a kernel must move at least once (decode: K and V read once).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import functools
import math
import os
import platform
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable, Sequence

HBM_PEAK_GBS = 4800.0  # H200 datasheet HBM3e bandwidth, GB/s
GPU_WARMUP_MS = 25
GPU_REP_MS = 100


# ----------------------------------------------------------------------------- arguments
def parse_args(description: str, add_extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """The arguments every benchmark takes: --quick, --out DIR, --dry-run, --smoke, --device."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a few representative shapes only")
    p.add_argument("--out", default="bench_out", help="folder for the CSV and PNG (default: bench_out)")
    p.add_argument("--dry-run", action="store_true", help="print the cases and their FLOP/byte counts; run nothing")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on any device (CPU without a GPU): checks the code paths, not speed")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    if add_extra is not None:
        add_extra(p)
    args = p.parse_args()
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not (args.smoke or args.dry_run):
        p.error("GPU benchmark: without CUDA, use --smoke (tiny shapes) or --dry-run")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


# ----------------------------------------------------------------------------- environment
def env_info(device: str = "cuda") -> dict:
    """Date, device name, torch/triton/CUDA versions: recorded in every CSV row."""
    import torch

    info = {"date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "absent"
    if device.startswith("cuda"):
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda or ""
    else:
        info["device"] = f"{cpu_model()} ({torch.get_num_threads()} threads)"
        info["loadavg_1min"] = round(os.getloadavg()[0], 2)  # other work on the machine skews CPU timings
    return info


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- timing
def bench(fn: Callable[[], object], device: str, grad_to_none: Sequence | None = None, cpu_reps: int = 5,
          l2: str = "zero") -> float:
    """Median milliseconds of one call of ``fn`` (see the module docstring); ``l2`` is how the
    GPU's L2 is cleared before each repetition: "zero" (do_bench's own) or "read"."""
    if device.startswith("cuda"):
        if l2 == "read":
            return _bench_read_flush(fn, grad_to_none)
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=GPU_WARMUP_MS, rep=GPU_REP_MS, grad_to_none=grad_to_none,
                              return_mode="median"))
    times = []
    for i in range(cpu_reps + 1):
        if grad_to_none is not None:
            for t in grad_to_none:
                t.grad = None
        t0 = time.perf_counter()
        fn()
        if i:  # the first call is the warm-up
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _bench_read_flush(fn, grad_to_none) -> float:
    """do_bench's loop with the L2 cleared by reading 256 MB (a sum), which leaves clean lines."""
    import torch

    flush = torch.zeros(64 * 2**20, dtype=torch.int32, device="cuda")

    def clear():
        flush.sum()
        for t in grad_to_none or ():
            t.grad = None

    clear()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        clear()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)  # ms per (clear + call)
    for _ in range(max(1, int(GPU_WARMUP_MS / estimate))):
        fn()
    reps = max(1, min(1000, int(GPU_REP_MS / estimate)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        clear()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def cuda_graph(fn: Callable[[], object]):
    """Capture ``fn`` in a CUDA graph (after warm-up calls: autotuning happens outside the capture).

    Returns ``(replay, out)``: calling ``replay()`` reruns the captured kernels, which write
    into ``out``, the tensor the captured call returned.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph.replay, out


def attempt(fn: Callable[[], object]):
    """``(fn(), '')`` or ``(None, 'ExcType: message')``: one failing backend never stops a run."""
    try:
        return fn(), ""
    except Exception as exc:  # noqa: BLE001 — any backend failure becomes an 'n/a' cell
        msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return None, f"{type(exc).__name__}: {msg}"


def free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@functools.cache
def compiled_flex():
    """FlexAttention compiled once (static shapes: each new shape recompiles, so the limit is raised)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    return torch.compile(flex_attention, dynamic=False)


def measure_ceilings(device: str) -> dict:
    """bf16 matmul 8192³ TFLOP/s and device-to-device copy GB/s (bytes read + written)."""
    import torch

    if not device.startswith("cuda"):
        return {"matmul_tflops": None, "copy_gbs": None}
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = bench(lambda: torch.mm(a, b), device)
    del a, b
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    cp_ms = bench(lambda: dst.copy_(src), device)
    del src, dst
    free_cuda()
    return {"matmul_tflops": tflops(2 * n**3, mm_ms), "copy_gbs": gbs(2 * (1 << 30), cp_ms)}


@functools.cache
def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_all(X, Sink, n, BLOCK: tl.constexpr, EVICT: tl.constexpr = ""):
        """Each program folds its strided share of ``X`` (int32 words) into one xor: every byte read once.
        ``EVICT="evict_first"``: the loads carry an L2 evict-first policy (createpolicy + ld...L2::cache_hint
        on sm_90; the loop is not software-pipelined, so Triton keeps the hint)."""
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc ^= tl.load(X + offs, mask=offs < n, other=0, eviction_policy=EVICT)
        tl.store(Sink + pid, tl.xor_sum(acc, 0))

    return read_all


def read_floor(nbytes: int, device: str, l2: str = "zero", evict: str = "") -> float | None:
    """Median ms of the fastest plain streaming read of ``nbytes`` (one kernel, replayed from a CUDA
    graph, timed as ``bench(..., l2=l2)``): the least time a kernel that must read that many bytes
    takes here, launch included. The best of a few grid and block sizes; None off the GPU.
    ``evict="evict_first"``: the same read with an L2 evict-first hint on every load, so that the
    streamed lines replace each other rather than the lines the L2 already holds (after do_bench's
    flush: dirty zeros, whose write-back the plain read pays)."""
    import torch

    if not device.startswith("cuda"):
        return None
    kernel = _read_kernel()
    words = torch.empty(nbytes // 4, dtype=torch.int32, device=device).random_()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    best = None
    for per_sm in (2, 4, 8):
        for block in (2048, 4096):
            sink = torch.empty(sms * per_sm, dtype=torch.int32, device=device)

            def run(sink=sink, block=block):
                kernel[(sink.numel(),)](words, sink, words.numel(), BLOCK=block, EVICT=evict, num_warps=8)
                return sink

            replay, _ = cuda_graph(run)
            ms = bench(replay, device, l2=l2)
            best = ms if best is None else min(best, ms)
    del words
    free_cuda()
    return best


# ----------------------------------------------------------------------------- counting
def attn_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, hdim: int, causal: bool = False) -> float:
    """Forward FLOPs of attention: 4·b·h·sq·sk·d, half when causal (the papers' convention)."""
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * hdim
    return flops / 2 if causal else flops


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / (ms * 1e-3) / 1e12


def gbs(nbytes: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else nbytes / (ms * 1e-3) / 1e9


def bwd_tflops(fwd_flops: float, fwd_ms: float | None, fwdbwd_ms: float | None) -> float | None:
    """Backward TFLOP/s: 2.5 × forward FLOPs over (forward+backward time − forward time)."""
    if fwd_ms is None or fwdbwd_ms is None or fwdbwd_ms <= fwd_ms:
        return None
    return tflops(2.5 * fwd_flops, fwdbwd_ms - fwd_ms)


# ----------------------------------------------------------------------------- output
def fmt(x, digits: int | None = None) -> str:
    """A table cell: 'n/a' for a missing value, otherwise a number (3 significant digits by default)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        if digits is None:
            digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2
        return f"{x:,.{digits}f}"
    return str(x)


def print_notes(rows: list[dict]) -> None:
    """Each distinct note (why a cell is n/a, how SDPA ran GQA) once per implementation."""
    seen: dict[tuple, int] = {}
    for r in rows:
        if r.get("note"):
            seen[(r["impl"], r["note"])] = seen.get((r["impl"], r["note"]), 0) + 1
    for (impl, note), n in seen.items():
        print(f"note  {impl} ({n} case{'s' if n > 1 else ''}): {note}")


def start_run(device: str):
    """The dtype of a run (bf16 on a GPU, fp32 on the CPU) and its environment with the
    ceilings measured now, printed as the header: every GPU benchmark begins so."""
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    env = env_info(device)
    ceilings = measure_ceilings(device)
    print_env(env, ceilings)
    env.update(ceilings)
    return dtype, env


def print_env(env: dict, ceilings: dict | None = None) -> None:
    from rich.console import Console

    line = f"{env['date']} · {env['device']} · torch {env['torch']} · triton {env['triton']}"
    if "loadavg_1min" in env:
        line += f" · load average {env['loadavg_1min']}"
    if env.get("cuda"):
        line += f" · CUDA {env['cuda']}"
    if ceilings and ceilings.get("matmul_tflops") is not None:
        line += (f"\nceilings: bf16 matmul 8192³ {ceilings['matmul_tflops']:.0f} TFLOP/s · "
                 f"device copy {ceilings['copy_gbs']:.0f} GB/s (read+write) · HBM datasheet {HBM_PEAK_GBS:.0f} GB/s")
    Console().print(line)


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[str]], caption: str | None = None) -> None:
    """A rich table of already formatted cells (first columns left-aligned, numbers right)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*[str(c) for c in r])
    Console(width=220).print(table)  # wide enough for every table here; narrower ones keep their size


def write_csv(path: str | Path, rows: list[dict], env: dict, quiet: bool = False) -> Path:
    """One row per measurement; the environment (and ceilings) repeated in each row.

    Benchmarks rewrite their CSV after every case, so a run cut short keeps what it measured.
    """
    path = Path(path)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    keys += [k for k in env if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({**env, **{k: ("" if v is None else v) for k, v in r.items()}})
    if not quiet:
        print(f"wrote {path}")
    return path


def read_csv(path: str | Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def num(x) -> float | None:
    """A CSV cell back as a float (None when empty)."""
    try:
        return float(x) if x not in ("", None) else None
    except ValueError:
        return None


def new_figure(ncols: int, nrows: int = 1, width: float = 4.0, height: float = 3.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes


def save_figure(fig, path: str | Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def nan(x) -> float:
    return float("nan") if x is None else float(x)
