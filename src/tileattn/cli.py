"""``tileattn demo | trace | memory | bench``: FlashAttention explained by running it.

    tileattn demo                     agreement, measured memory, the fully-masked tile, the torch path
    tileattn trace --keys 16 --tile 4 the online softmax on one query row, tile by tile [--plot f.png]
    tileattn memory --sizes 512 2048  peak intermediate memory, naive vs tiled, measured
    tileattn bench --sizes 1024 2048  CPU GFLOP/s: tileattn vs torch SDPA vs naive torch

The numbers come from ``tileattn.teaching``; this module parses arguments and prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from . import teaching

# Piped output (a file, a test) gets 120 columns rather than rich's 80, unless COLUMNS says otherwise.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.2f}"


def _err(x: float) -> str:
    return "[red]NaN/inf[/red]" if not np.isfinite(x) else f"{x:.1e}"


# --------------------------------------------------------------------------- demo parts


def show_agreement(seed: int) -> float:
    """Print (a); returns the largest error."""
    table = Table(title="(a) Four algorithms, one answer: max |x - naive| over out and LSE, float64")
    for col in ("case", "shape b x sq x sk", "tile", "tiled", "paged", "split (3)"):
        table.add_column(col, justify="left" if col in ("case", "shape b x sq x sk") else "right")
    worst = 0.0
    for label, shape, tile, *errs in teaching.agreement(seed):
        table.add_row(label, shape, str(tile), *(_err(e) for e in errs))
        worst = max(worst, *errs)
    console.print(table)
    console.print("naive: softmax(q k^T) v with the whole score matrix; tiled: FlashAttention, "
                  "row blocks x key tiles; paged: key tiles read through a shuffled block table "
                  "(unused slots NaN); split: flash-decoding, 3 key ranges merged by their LSE.")
    console.print(f"max error over all cases: {worst:.1e}\n")
    return worst


def show_memory(sizes, block: int = 128) -> None:
    """Print (b): measured peak intermediate memory."""
    rows = teaching.memory_table(sizes, block=block)
    table = Table(title=f"(b) Peak intermediate memory, MiB, measured with tracemalloc (1 head, d=64, tile {block})")
    for col in ("N", "naive", "x prev", "flash (tiled)", "x prev", "one N x N fp64", "one tile fp64"):
        table.add_column(col, justify="right")
    prev = None
    for row in rows:
        grow = ("", "") if prev is None else (f"{row.naive_bytes / prev.naive_bytes:.1f}x",
                                              f"{row.flash_bytes / prev.flash_bytes:.2f}x")
        table.add_row(str(row.seqlen), _mib(row.naive_bytes), grow[0], _mib(row.flash_bytes), grow[1],
                      _mib(row.scores_bytes), _mib(row.tile_bytes))
        prev = row
    console.print(table)
    console.print("Counted: everything allocated while the call runs (score matrices, exp, probabilities, "
                  "tiles, running max/sum); not counted: q, k, v (allocated before) and out, lse (returned).")
    if len(rows) >= 2:
        a, b = rows[-2], rows[-1]
        console.print(f"from N={a.seqlen} to N={b.seqlen} ({b.seqlen / a.seqlen:g}x longer): "
                      f"naive grew {b.naive_bytes / a.naive_bytes:.2f}x, flash grew {b.flash_bytes / a.flash_bytes:.2f}x")
    console.print()


def show_masked_tile() -> None:
    """Print (c): the fully-masked first tile, unguarded NaN vs guarded exact."""
    tile, left = 4, 3
    case = teaching.masked_tile(seqlen=16, window_left=left, tile=tile)
    console.print(f"[bold](c) The fully-masked tile[/bold]: sliding window ({left}, 0), query i sees keys "
                  f"i-{left}..i; key tiles of {tile} (■ seen, · masked, | tile edge)")
    table = Table()
    for col in ("row", "keys seen", "first key tile", "unguarded out[0]", "guarded out[0]", "|guarded - exact|"):
        table.add_column(col, justify="right", no_wrap=True)
    for i in range(len(case.seen)):
        picture = "|".join("".join("■" if s else "·" for s in case.seen[i, j:j + tile])
                           for j in range(0, case.seen.shape[1], tile))
        unguarded = case.unguarded[i, 0]
        table.add_row(str(i), picture, "[yellow]masked[/yellow]" if case.first_tile_blind[i] else "sees keys",
                      "[red]nan[/red]" if np.isnan(unguarded) else f"{unguarded:+.6f}",
                      f"{case.guarded[i, 0]:+.6f}", f"{np.abs(case.guarded[i] - case.exact[i]).max():.1e}")
    console.print(table)
    nan_rows = np.isnan(case.unguarded).any(axis=1)
    console.print("Without the guard the first tile gives m = -inf, so exp(m_old - m_new) = exp(-inf + inf) = NaN, "
                  "and the NaN survives every later tile. The guard uses 0 in place of a -inf running max.")
    console.print(f"unguarded: NaN in {nan_rows.sum()} of {len(nan_rows)} rows "
                  f"(the rows whose first key tile is masked: {np.array_equal(nan_rows, case.first_tile_blind)})")
    console.print(f"guarded: max error {np.abs(case.guarded - case.exact).max():.1e}, "
                  f"all finite: {bool(np.isfinite(case.guarded).all())}\n")


def show_public_api(seed: int) -> None:
    """Print (d): tileattn.flash_attn_func (torch CPU path, GPU when present) against the reference."""
    rows = teaching.public_api_agreement(seed)
    table = Table(title="(d) tileattn.flash_attn_func against the float64 reference (max |out - ref|)")
    for col in ("device", "dtype", "case", "tileattn", "plain torch, same dtype", "within 2x torch + 1e-5"):
        table.add_column(col, justify="right")
    for device, dtype, label, err_fast, err_torch, ok in rows:
        table.add_row(device, dtype, label, _err(err_fast), _err(err_torch), "yes" if ok else "[red]NO[/red]")
    console.print(table)


def cmd_demo(args) -> None:
    start = time.perf_counter()
    show_agreement(args.seed)
    show_memory((512, 2048, 8192))
    show_masked_tile()
    show_public_api(args.seed)
    console.print(f"demo took {time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------------------- trace


def cmd_trace(args) -> None:
    scores, steps, exact = teaching.trace_online_softmax(args.keys, args.tile, args.seed, args.dim)
    console.print(f"One query row, {args.keys} keys in tiles of {args.tile}, head dim {args.dim}. "
                  "Scores s_j = q.k_j / sqrt(d):")
    console.print("  " + " | ".join(" ".join(f"{s:+.2f}" for s in scores[lo:lo + args.tile])
                                    for lo in range(0, len(scores), args.tile)))
    table = Table(title="The online softmax, tile by tile")
    for col in ("tile", "keys", "tile max", "running max m", "alpha = exp(m_old - m_new)", "running sum l",
                "o = acc / l", "max |o - exact|"):
        table.add_column(col, justify="right", no_wrap=col == "o = acc / l")
    for n, step in enumerate(steps):
        alpha = "-" if np.isnan(step.alpha) else f"{step.alpha:.4f}" + (" [yellow]rescale[/yellow]" if step.rescaled else "")
        table.add_row(str(n), f"{step.keys.start}..{step.keys.stop - 1}", f"{step.tile_max:+.4f}", f"{step.m:+.4f}",
                      alpha, f"{step.l:.4f}", " ".join(f"{x:+.4f}" for x in step.o), f"{step.err:.1e}")
    console.print(table)
    console.print("exact  o = softmax(s) V = " + " ".join(f"{x:+.4f}" for x in exact))
    console.print(f"rescalings: {sum(s.rescaled for s in steps)} of {len(steps) - 1} tiles after the first "
                  "(the running max grew, so l and acc were multiplied by exp(m_old - m_new) < 1)")
    console.print("o is exact only once every key has been seen; before that it is the answer for the keys so far.")
    console.print(f"final error after the last tile: {steps[-1].err:.1e}")
    if args.plot:
        plot_trace(args.plot, scores, steps)
        console.print(f"plot written to {args.plot}")


def plot_trace(path: str, scores, steps) -> None:
    """Scores with tile edges and the running max (top); error of o per tile, log scale (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), constrained_layout=True)
    top.bar(np.arange(len(scores)), scores, color="tab:blue", label="score s_j")
    for step in steps:
        top.hlines(step.m, step.keys.start - 0.5, step.keys.stop - 0.5, color="tab:red")
        top.axvline(step.keys.start - 0.5, color="grey", lw=0.5)
    top.plot([], [], color="tab:red", label="running max m after the tile")
    top.set(xlabel="key", ylabel="score", title="Online softmax: scores and running max")
    top.legend(loc="upper left", fontsize="small")
    errs = np.maximum([s.err for s in steps], 1e-18)
    bottom.semilogy(np.arange(len(steps)), errs, "o-")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set(xlabel="tile", ylabel="max |o - exact|", title="The output is exact only after the last tile")
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------- memory, bench


def cmd_memory(args) -> None:
    show_memory(args.sizes, block=args.block)


def cmd_bench(args) -> None:
    rows = teaching.bench(args.sizes, args.repeats)
    table = Table(title=f"CPU, fp32, (1, 8, N, 64): ms (GFLOP/s), median of {args.repeats}; FLOPs = 4 N^2 8 64")
    table.add_column("N", justify="right")
    for name in rows[0][1]:
        table.add_column(name, justify="right")
    for n, times in rows:
        flops = 4 * n * n * 8 * 64
        table.add_row(str(n), *(f"{t * 1e3:.1f} ({flops / t / 1e9:.1f})" for t in times.values()))
    console.print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tileattn", description="FlashAttention explained by running it.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="agreement, measured memory, the fully-masked tile, the torch path")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)
    trace = sub.add_parser("trace", help="the online softmax on one query row, tile by tile")
    trace.add_argument("--keys", type=int, default=16, help="number of keys (default 16)")
    trace.add_argument("--tile", type=int, default=4, help="keys per tile (default 4)")
    trace.add_argument("--dim", type=int, default=4, help="head dimension (default 4)")
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--plot", metavar="FILE.png", help="write a matplotlib figure")
    trace.set_defaults(func=cmd_trace)
    memory = sub.add_parser("memory", help="peak intermediate memory, naive vs tiled, measured")
    memory.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    memory.add_argument("--block", type=int, default=128, help="row block and key tile of the tiled path")
    memory.set_defaults(func=cmd_memory)
    bench = sub.add_parser("bench", help="CPU GFLOP/s: tileattn vs torch SDPA vs naive torch")
    bench.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    bench.add_argument("--repeats", type=int, default=3)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("keys", "tile", "dim", "block", "repeats"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name} must be >= 1")
    if any(n < 1 for n in getattr(args, "sizes", [1])):
        parser.error("--sizes must be >= 1")
    args.func(args)


if __name__ == "__main__":
    main()
