"""``tileattn demo | trace | memory | bench``: FlashAttention explained by running it.

    tileattn demo                     agreement, measured memory, the fully-masked tile, the torch path
    tileattn trace --keys 16 --tile 4 the online softmax on one query row, tile by tile [--plot f.png]
    tileattn memory --sizes 512 2048  peak intermediate memory, naive vs tiled, measured
    tileattn bench --sizes 1024 2048  CPU speed: tileattn vs torch SDPA vs naive torch

The numbers come from ``tileattn.teaching``; this module parses arguments and prints. Every
table fits an 80-column terminal: each ``*_view`` function turns numbers into what is printed
(tables and notes), so a test can render it at width 80. ``tileattn demo`` prints the sections
of ``DEMO_SECTIONS`` in order, lettered (a), (b), ...: a new section is one more function there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.columns import Columns
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import teaching

# Piped output (a file, a test) gets 120 columns rather than rich's 80, unless COLUMNS says otherwise.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)

# A run whose slowest repeat took this many times its fastest is flagged as noisy.
WIDE_SPREAD = 1.3
# A naive case runs only when its estimated peak stays below this share of the available memory.
MEMORY_SHARE = 0.8


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.2f}"


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def _err(x: float) -> str:
    return "[red]NaN/inf[/red]" if not np.isfinite(x) else f"{x:.1e}"


def _print(*renderables) -> None:
    for r in renderables:
        console.print(r)


def progress() -> Progress:
    """A progress bar for work that takes seconds, drawn only on a terminal and erased when done."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


# --------------------------------------------------------------------------- demo parts


def agreement_view(rows, label: str = "") -> list:
    table = Table(title=f"{label}Four algorithms, one answer: max |x - naive| over out and LSE, float64")
    for col in ("case", "shape", "tile", "tiled", "paged", "split"):
        table.add_column(col, justify="left" if col in ("case", "shape") else "right")
    for case, shape, tile, *errs in rows:
        table.add_row(case, shape, str(tile), *(_err(e) for e in errs))
    worst = max(max(errs) for _, _, _, *errs in rows)
    return [table,
            "shape: batch x seqlen_q x seqlen_k, h query heads / key-value heads (h8/2: 8 query heads share "
            "2 key-value heads), d head dim; tile: rows and keys per tile.",
            "naive: softmax(q k^T) v with the whole score matrix; tiled: FlashAttention, row blocks x key tiles; "
            "paged: key tiles read through a shuffled block table (unused slots NaN); split: flash-decoding, "
            "3 key ranges merged by their LSE.",
            f"max error over all cases: {worst:.1e}\n"]


def show_agreement(args, label: str = "") -> None:
    """The float64 algorithms of the reference against each other."""
    _print(*agreement_view(teaching.agreement(args.seed), label))


def memory_view(rows, block: int, label: str = "") -> list:
    """Rows of :class:`teaching.MemoryRow`; a row whose naive case was skipped shows "skipped"."""
    table = Table(title=f"{label}Peak intermediate memory in MiB, measured with tracemalloc "
                        f"(1 head, d=64, tile {block})")
    for col in ("N", "naive", "x prev", "tiled", "x prev", "N x N fp64", "tile fp64"):
        table.add_column(col, justify="right")
    prev = None
    for row in rows:
        naive = "skipped" if row.naive_bytes is None else _mib(row.naive_bytes)
        grow_naive = grow_flash = ""
        if prev is not None:
            grow_flash = f"{row.flash_bytes / prev.flash_bytes:.2f}x"
            if row.naive_bytes is not None and prev.naive_bytes is not None:
                grow_naive = f"{row.naive_bytes / prev.naive_bytes:.1f}x"
        table.add_row(str(row.seqlen), naive, grow_naive, _mib(row.flash_bytes), grow_flash,
                      _mib(row.scores_bytes), _mib(row.tile_bytes))
        prev = row
    notes = ["naive: softmax(q k^T) v with the N x N scores; tiled: FlashAttention. x prev: growth over the row "
             "above. Counted: everything allocated while the call runs (score matrices, exp, probabilities, "
             "tiles, running max/sum); not counted: q, k, v (allocated before) and out, lse (returned)."]
    measured = [r for r in rows if r.naive_bytes is not None]
    if len(measured) >= 2:
        a, b = measured[-2], measured[-1]
        notes.append(f"from N={a.seqlen} to N={b.seqlen} ({b.seqlen / a.seqlen:g}x longer): naive grew "
                     f"{b.naive_bytes / a.naive_bytes:.2f}x, flash grew {b.flash_bytes / a.flash_bytes:.2f}x")
    return [table, *notes, ""]


def measure_memory(sizes, block: int) -> list:
    """Measure each size under a progress bar; a naive case whose estimated peak would not fit in
    the available memory is skipped, with a line saying why."""
    per_score = teaching.naive_bytes_per_score()
    available = teaching.available_memory()
    console.print("estimated peak of naive attention: "
                  + ", ".join(f"N={n} {_size(per_score * n * n)}" for n in sizes)
                  + f" ({per_score:.0f} bytes per score, measured at N=256); available memory: "
                  + ("unknown, every naive case runs" if available is None else _size(available)))
    rows = []
    with progress() as bar:
        task = bar.add_task("measuring", total=len(sizes))
        for n in sizes:
            estimate = per_score * n * n
            fits = available is None or estimate <= MEMORY_SHARE * available
            if not fits:
                console.print(f"N={n}: naive skipped: about {_size(estimate)} is more than {MEMORY_SHARE:.0%} "
                              f"of the {_size(available)} available")
            bar.update(task, description=f"N={n}: naive ~{_size(estimate)} and tiled" if fits else f"N={n}: tiled")
            rows.append(teaching.memory_row(n, block=block, naive=fits))
            bar.advance(task)
    return rows


def show_memory(args, label: str = "") -> None:
    """Peak intermediate memory, naive vs tiled, for ``args.sizes`` and ``args.block``."""
    _print(*memory_view(measure_memory(args.sizes, args.block), args.block, label))


def masked_tile_view(case, tile: int, left: int, label: str = "") -> list:
    """The fully-masked first key tile: the unguarded recurrence's NaN against the guard's exact rows."""
    heading = (f"[bold]{label}The fully-masked tile[/bold]: sliding window ({left}, 0), query i sees keys "
               f"i-{left}..i; key tiles of {tile} (■ seen, · masked, | tile edge)")
    table = Table()
    for col in ("row", "keys seen", "tile 0", "unguarded", "guarded", "error"):
        table.add_column(col, justify="right", no_wrap=col == "keys seen")
    for i in range(len(case.seen)):
        picture = "|".join("".join("■" if s else "·" for s in case.seen[i, j:j + tile])
                           for j in range(0, case.seen.shape[1], tile))
        unguarded = case.unguarded[i, 0]
        table.add_row(str(i), picture, "[yellow]masked[/yellow]" if case.first_tile_blind[i] else "seen",
                      "[red]nan[/red]" if np.isnan(unguarded) else f"{unguarded:+.6f}",
                      f"{case.guarded[i, 0]:+.6f}", f"{np.abs(case.guarded[i] - case.exact[i]).max():.1e}")
    nan_rows = np.isnan(case.unguarded).any(axis=1)
    return [heading, table,
            "tile 0: does the row see any key of the first key tile; unguarded / guarded: out\\[i, 0] without / "
            "with the guard; error: max |guarded - exact| over the row.",
            "Without the guard the first tile gives m = -inf, so exp(m_old - m_new) = exp(-inf + inf) = NaN, "
            "and the NaN survives every later tile. The guard uses 0 in place of a -inf running max.",
            f"unguarded: NaN in {nan_rows.sum()} of {len(nan_rows)} rows "
            f"(the rows whose first key tile is masked: {np.array_equal(nan_rows, case.first_tile_blind)})",
            f"guarded: max error {np.abs(case.guarded - case.exact).max():.1e}, "
            f"all finite: {bool(np.isfinite(case.guarded).all())}\n"]


def show_masked_tile(args, label: str = "") -> None:
    tile, left = 4, 3
    _print(*masked_tile_view(teaching.masked_tile(seqlen=16, window_left=left, tile=tile), tile, left, label))


def public_api_view(rows, label: str = "") -> list:
    table = Table(title=f"{label}tileattn.flash_attn_func against the float64 reference: max |out - ref|")
    for col in ("device", "dtype", "case", "tileattn", "torch", "ok"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for device, dtype, case, err_fast, err_torch, ok in rows:
        table.add_row(device, dtype, case, _err(err_fast), _err(err_torch), "yes" if ok else "[red]NO[/red]")
    return [table, "torch: plain softmax(q k^T) v in the same dtype, the error that dtype allows anyway; "
                   "ok: tileattn <= 2 x torch + 1e-5 (the project's tolerance rule)."]


def show_public_api(args, label: str = "") -> None:
    """tileattn.flash_attn_func (torch CPU path, GPU when present) against the reference."""
    _print(*public_api_view(teaching.public_api_agreement(args.seed), label))


# Each section prints itself given the parsed arguments and its label "(a) ", "(b) ", ...
DEMO_SECTIONS = [show_agreement, show_memory, show_masked_tile, show_public_api]


def cmd_demo(args) -> None:
    start = time.perf_counter()
    for letter, section in zip("abcdefghijklmnopqrstuvwxyz", DEMO_SECTIONS):
        section(args, f"({letter}) ")
    console.print(f"demo took {time.perf_counter() - start:.1f} s")


# ---------------------------------------------------------------------------- trace


def trace_view(scores, steps, exact, tile: int) -> list:
    """The scores by tile, the recurrence's scalars per tile, then o = acc / l per tile beside the exact o."""
    by_tile = Columns([f"tile {n}: " + " ".join(f"{s:+.2f}" for s in scores[lo:lo + tile])
                       for n, lo in enumerate(range(0, len(scores), tile))], padding=(0, 3))
    table = Table(title="The online softmax, tile by tile")
    for col in ("tile", "keys", "tile max", "m", "alpha", "l", "error of o"):
        table.add_column(col, justify="right")
    for n, step in enumerate(steps):
        alpha = "-" if np.isnan(step.alpha) else f"{step.alpha:.4f}" + ("[yellow]*[/yellow]" if step.rescaled else "")
        table.add_row(str(n), f"{step.keys.start}..{step.keys.stop - 1}", f"{step.tile_max:+.4f}", f"{step.m:+.4f}",
                      alpha, f"{step.l:.4f}", f"{step.err:.1e}")
    legend = ("m: running max; alpha = exp(m_old - m_new), the factor l and acc are multiplied by "
              "(* a rescale: the max grew); l: running sum of exp(s_j - m); error of o: max |o - exact|.")
    outputs = Table(title="o = acc / l after each tile")
    outputs.add_column("tile", justify="right")
    outputs.add_column("o", justify="left")
    for n, step in enumerate(steps):
        outputs.add_row(str(n), " ".join(f"{x:+.4f}" for x in step.o))
    outputs.add_row("exact", " ".join(f"{x:+.4f}" for x in exact), style="bold")
    return ["Scores s_j = q.k_j / sqrt(d), by key tile:", by_tile, table, legend, outputs,
            f"rescalings: {sum(s.rescaled for s in steps)} of {len(steps) - 1} tiles after the first "
            "(the running max grew, so l and acc were multiplied by exp(m_old - m_new) < 1)",
            "o is exact only once every key has been seen; before that it is the answer for the keys so far.",
            f"final error after the last tile: {steps[-1].err:.1e}"]


def cmd_trace(args) -> None:
    scores, steps, exact = teaching.trace_online_softmax(args.keys, args.tile, args.seed, args.dim)
    console.print(f"One query row, {args.keys} keys in tiles of {args.tile}, head dim {args.dim}.")
    _print(*trace_view(scores, steps, exact, args.tile))
    if args.sink is not None:
        show_sink(args)
    if args.plot:
        plot_trace(args.plot, scores, steps)
        console.print(f"plot written to {args.plot}")


def show_sink(args) -> None:
    """The same row's weights without and with a learnable sink of logit ``args.sink``."""
    scores, plain, with_sink, p_sink = teaching.sink_weights(args.keys, args.sink, args.seed, args.dim)
    table = Table(title=f"A learnable sink of logit {args.sink:+.2f} on this row")
    for col in ("key", "score", "weight, no sink", "weight, with sink"):
        table.add_column(col, justify="right")
    for j, (s, w0, w1) in enumerate(zip(scores, plain, with_sink)):
        table.add_row(str(j), f"{s:+.4f}", f"{w0:.4f}", f"{w1:.4f}")
    table.add_row("sink", f"{args.sink:+.4f}", "-", f"{p_sink:.4f}")
    table.add_row("sum", "", f"{plain.sum():.4f}", f"{with_sink.sum() + p_sink:.4f}")
    console.print(table)
    console.print(f"the sink takes {p_sink:.4f} of the row and has no value:")
    console.print(f"every weight, and the output, shrinks by {1 - p_sink:.4f}")


def plot_format(path: str) -> str:
    """The figure format of ``path``: its suffix, or png for a name without one (written as given)."""
    return Path(path).suffix[1:].lower() or "png"


def plot_formats() -> list[str]:
    """The file formats matplotlib can write, by suffix."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def plot_trace(path: str, scores, steps) -> None:
    """Scores with tile edges and the running max (top); error of o per tile, log scale (bottom),
    written to ``path`` itself in the format of its suffix (png without one)."""
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
    fig.savefig(path, dpi=100, format=plot_format(path))
    plt.close(fig)


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------- memory, bench


def cmd_memory(args) -> None:
    show_memory(args)


def bench_view(rows, repeats: int, warmup: int) -> list:
    """Rows ``(N, {name: [seconds, ...]})``: min / median / max ms, GFLOP/s and speed beside SDPA."""
    table = Table(title=f"CPU, fp32, (1, 8, N, 64): ms over {repeats} calls after {warmup} warm-up calls")
    for col in ("N", "", "min", "median", "max", "GFLOP/s", "vs SDPA"):
        table.add_column(col, justify="left" if col == "" else "right")
    noisy = False
    for n, times in rows:
        flops = 4 * n * n * 8 * 64
        sdpa = statistics.median(times["torch SDPA"])
        for name, ts in times.items():
            low, mid, high = min(ts), statistics.median(ts), max(ts)
            wide = high > WIDE_SPREAD * low
            noisy |= wide
            table.add_row(str(n), name, f"{low * 1e3:.2f}", f"{mid * 1e3:.2f}",
                          f"{high * 1e3:.2f}" + ("[yellow]*[/yellow]" if wide else ""),
                          f"{flops / mid / 1e9:.1f}", f"{sdpa / mid:.2f}x")
        table.add_section()
    notes = ["GFLOP/s: 4 N^2 8 64 FLOPs over the median; vs SDPA: SDPA's median time over this one's "
             "(above 1x: faster than SDPA)."]
    if noisy:
        notes.append(f"[yellow]*[/yellow] wide spread: the slowest call took over {WIDE_SPREAD}x the fastest. The "
                     "machine was busy or changing its clock speed: the ratios may be off; rerun with more "
                     "--repeats on an idle machine.")
    return [table, *notes]


def cmd_bench(args) -> None:
    rows = []
    with progress() as bar:
        task = bar.add_task("timing", total=len(args.sizes) * 3)
        for n in args.sizes:
            times = {}
            for name, fn in teaching.bench_cases(n).items():
                bar.update(task, description=f"N={n} {name}")
                times[name] = teaching.time_calls(fn, args.repeats, args.warmup)
                bar.advance(task)
            rows.append((n, times))
    _print(*bench_view(rows, args.repeats, args.warmup))


# --------------------------------------------------------------------------- parsing


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals are one line on stderr (exit status 2), not usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def at_least(low: int):
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} (got {value})")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def sink_logit(text: str) -> float:
    """An argparse type: a sink logit, a finite number or -inf (no sink); +inf or nan would make
    every weight nan."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if np.isnan(value) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number or -inf (got {text})")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tileattn", description="FlashAttention explained by running it.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    seed_help = "seed of the random inputs (default 0)"
    demo = sub.add_parser("demo", help="agreement, measured memory, the fully-masked tile, the torch path "
                                       "(about 30 s)")
    demo.add_argument("--seed", type=at_least(0), default=0, help=seed_help)
    demo.set_defaults(func=cmd_demo, sizes=[512, 2048, 8192], block=128)  # its memory section
    trace = sub.add_parser("trace", help="the online softmax on one query row, tile by tile")
    trace.add_argument("--keys", type=at_least(1), default=16, help="number of keys (default 16)")
    trace.add_argument("--tile", type=at_least(1), default=4, help="keys per tile (default 4)")
    trace.add_argument("--dim", type=at_least(1), default=4, help="head dimension (default 4)")
    trace.add_argument("--seed", type=at_least(0), default=0, help=seed_help)
    trace.add_argument("--plot", metavar="FILE.png",
                       help="also write a figure of the scores, running max and error (needs matplotlib)")
    trace.add_argument("--sink", type=sink_logit, metavar="LOGIT",
                       help="also show a learnable sink's effect on the row")
    trace.set_defaults(func=cmd_trace)
    memory = sub.add_parser("memory", help="peak intermediate memory, naive vs tiled, measured")
    memory.add_argument("--sizes", type=at_least(1), nargs="+", default=[512, 2048, 8192], metavar="N",
                        help="sequence lengths to measure (default 512 2048 8192); a naive case that would "
                             f"not fit in {MEMORY_SHARE * 100:.0f}%% of the available memory is skipped")
    memory.add_argument("--block", type=at_least(1), default=128,
                        help="row block and key tile of the tiled path (default 128)")
    memory.set_defaults(func=cmd_memory)
    bench = sub.add_parser("bench", help="CPU speed: tileattn vs torch SDPA vs naive torch")
    bench.add_argument("--sizes", type=at_least(1), nargs="+", default=[1024, 2048], metavar="N",
                       help="sequence lengths to time (default 1024 2048)")
    bench.add_argument("--repeats", type=at_least(1), default=5, help="timed calls per case (default 5)")
    bench.add_argument("--warmup", type=at_least(0), default=2,
                       help="untimed calls before the timed ones (default 2)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "plot", None):
        if not has_matplotlib():
            parser.exit(2, "tileattn trace: error: --plot needs matplotlib: "
                           "python3 -m pip install 'tileattn[plot]' (or: python3 -m pip install matplotlib)\n")
        if not Path(args.plot).resolve().parent.is_dir():
            parser.exit(2, f"tileattn trace: error: --plot: no folder {Path(args.plot).parent} to write into\n")
        if Path(args.plot).is_dir():
            parser.exit(2, f"tileattn trace: error: --plot: {args.plot} is a folder: give a file, "
                           f"e.g. {Path(args.plot) / 'trace.png'}\n")
        formats = plot_formats()
        if plot_format(args.plot) not in formats:
            parser.exit(2, f"tileattn trace: error: --plot: no figure format {Path(args.plot).suffix!r} "
                           f"(one of: {', '.join('.' + f for f in formats)})\n")
    args.func(args)


if __name__ == "__main__":
    main()
