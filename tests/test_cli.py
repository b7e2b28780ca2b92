"""``tileattn demo | trace | memory | bench`` as a newcomer meets them: what they print, on an
80-column terminal, with help for every option and one-line refusals.

The demo runs once in a subprocess at 80 columns (``python -m tileattn.cli``); the checks read
the summary lines printed below its tables. Each table is also rendered at width 80 in-process
and every word of every cell and header must come out whole.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tileattn import cli, teaching

# One BLAS thread: the reference multiplies small tiles, and OpenBLAS's threads spinning on a
# busy 2-core CI machine make that up to 10x slower; the printed numbers do not depend on it.
ENV = {**os.environ, "COLUMNS": "80", "OPENBLAS_NUM_THREADS": "1"}
WIDTH = 80


def tileattn(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, "-m", "tileattn.cli", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)
    assert proc.returncode == 0, f"tileattn {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert_fits(proc.stdout)
    return proc.stdout


def number(pattern: str, text: str) -> float:
    """The first group of ``pattern`` in ``text``, read with line breaks and runs of spaces as one space."""
    found = re.search(pattern, " ".join(text.split()))
    assert found, f"{pattern!r} not in the output:\n{text}"
    return float(found.group(1))


def assert_fits(text: str, width: int = WIDTH) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > width]
    assert not too_wide, "lines wider than {width}:\n" + "\n".join(too_wide)
    assert "…" not in text, f"something was cut short:\n{text}"


def render(renderables, width: int = WIDTH, terminal: bool = False) -> str:
    console = Console(width=width, file=io.StringIO(), force_terminal=terminal, color_system=None, record=True)
    for r in renderables:
        console.print(r)
    return console.export_text()


def _plain(cell) -> str:
    return Text.from_markup(cell).plain if isinstance(cell, str) else str(getattr(cell, "plain", cell))


def assert_nothing_cut(renderables, width: int = WIDTH) -> str:
    """Render at ``width``: no line wider, no ellipsis, and every word of every table cell and
    header printed whole (a word broken across two lines is cut too)."""
    text = render(renderables, width)
    assert_fits(text, width)
    for table in (r for r in renderables if isinstance(r, Table)):
        for column in table.columns:
            for cell in (column.header, *column.cells):
                for word in _plain(cell).split():
                    assert word in text, f"{word!r} of column {_plain(column.header)!r} is cut at {width} columns:\n{text}"
    return text


@pytest.fixture
def recorded(monkeypatch):
    """cli's console replaced by an 80-column one whose output the test reads (``recorded()``)."""
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(width=WIDTH, file=buffer, color_system=None))
    return buffer.getvalue


# ------------------------------------------------------------------------------ demo


@pytest.fixture(scope="module")
def demo() -> str:
    return tileattn("demo", "--seed", "3")


def test_demo_algorithms_agree(demo):
    assert number(r"max error over all cases: (\S+)", demo) <= 1e-12
    assert "NaN/inf" not in demo


def test_demo_memory_is_quadratic_for_naive_and_flat_for_flash(demo):
    naive = number(r"from N=2048 to N=8192 \(4x longer\): naive grew (\S+)x", demo)
    flash = number(r"flash grew (\S+)x", demo)
    assert naive >= 8.0, f"naive attention's intermediates grew only {naive}x for 4x the length"
    assert flash <= 1.5, f"tiled attention's intermediates grew {flash}x for 4x the length"


def test_demo_unguarded_tile_is_nan_and_guarded_is_exact(demo):
    assert number(r"unguarded: NaN in (\d+) of 16 rows", demo) > 0
    assert "rows whose first key tile is masked: True" in " ".join(demo.split())
    assert number(r"guarded: max error (\S+), all finite: True", demo) <= 1e-12


def test_demo_shows_the_public_api_within_tolerance(demo):
    rows = [line for line in demo.splitlines() if re.match(r"^│\s+(cpu|cuda) ", line)]
    assert any(" cpu " in row for row in rows), demo
    assert all(row.rstrip(" │").endswith("yes") for row in rows), "\n".join(rows)


def test_demo_sections_are_lettered_in_order(demo):
    assert [m.group(1) for m in re.finditer(r"^\s*\(([a-z])\) ", demo, re.M)] == ["a", "b", "c", "d"]


# ---------------------------------------------------------------- 80 columns, in-process


def test_demo_tables_fit_80_columns():
    assert_nothing_cut(cli.agreement_view(teaching.agreement(0), "(a) "))
    case = teaching.masked_tile(seqlen=16, window_left=3, tile=4)
    assert_nothing_cut(cli.masked_tile_view(case, 4, 3, "(c) "))
    worst_api = [("cuda", "bfloat16", label, float("nan"), 1.2e-2, False) for label, *_ in teaching.API_CASES]
    assert_nothing_cut(cli.public_api_view(teaching.public_api_agreement(0) + worst_api, "(d) "))


def test_memory_table_fits_80_columns():
    rows = [teaching.MemoryRow(n, None if n > 8192 else 4 * 8 * n * n, 800_000 + n, 8 * n * n, 8 * 128 * 128)
            for n in (1, 512, 8192, 32768, 131072)]
    text = assert_nothing_cut(cli.memory_view(rows, 128, "(b) "))
    assert "skipped" in text


@pytest.mark.parametrize("keys, tile, dim", [(16, 4, 4), (13, 1, 2), (100, 32, 64), (1, 1, 1)])
def test_trace_fits_80_columns(keys, tile, dim):
    scores, steps, exact = teaching.trace_online_softmax(keys, tile, 0, dim)
    text = assert_nothing_cut(cli.trace_view(scores, steps, exact, tile))
    assert all(f"{s:+.2f}" in text for s in scores)  # every score printed whole


def test_bench_table_fits_80_columns_and_flags_a_wide_spread():
    steady = {"tileattn": [0.0101, 0.0102, 0.0104], "torch SDPA": [0.0081, 0.0080, 0.0082],
              "naive torch": [0.0090, 0.0091, 0.0093]}
    text = assert_nothing_cut(cli.bench_view([(1024, steady)], 3, 2))
    assert "wide spread" not in text
    noisy = {**steady, "tileattn": [0.21, 12.345, 98.765]}
    text = assert_nothing_cut(cli.bench_view([(1024, steady), (16384, noisy)], 3, 2))
    assert "wide spread" in " ".join(text.split())
    row = next(line for line in text.splitlines() if re.match(r"^│\s+16384\s+│ tileattn ", line))
    assert "98765.00*" in row and "210.00" in row and "12345.00" in row


# ---------------------------------------------------------------------- trace, memory, bench


@pytest.mark.parametrize("tile", ["1", "4"])
def test_trace_ends_exact(tile):
    out = tileattn("trace", "--keys", "13", "--tile", tile, "--seed", "5")
    assert number(r"final error after the last tile: (\S+)", out) <= 1e-14
    later_tiles = -(-13 // int(tile)) - 1
    assert number(r"rescalings: \d+ of (\d+) tiles after the first", out) == later_tiles
    assert 0 <= number(r"rescalings: (\d+) of", out) <= later_tiles


def test_trace_shows_a_sinks_effect_on_the_row():
    out = tileattn("trace", "--keys", "6", "--tile", "3", "--seed", "2", "--sink", "1.5")
    p_sink = number(r"the sink takes (\S+) of the row", out)
    shrink = number(r"shrinks by (\S+)", out)
    assert 0 < p_sink < 1 and abs(p_sink + shrink - 1) < 1e-4
    sums = re.search(r"│\s+sum\s+│\s+│\s+(\S+)\s+│\s+(\S+)\s+│", out)
    assert sums and float(sums.group(1)) == float(sums.group(2)) == 1.0, out


def test_trace_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "trace.png"
    cli.main(["trace", "--keys", "20", "--seed", "1", "--plot", str(path)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_plot_writes_the_file_named(tmp_path):
    """A name without a suffix gets a PNG under that very name (the message says where it went);
    a folder or a suffix matplotlib cannot write is refused before anything is computed."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "trace"
    cli.main(["trace", "--keys", "5", "--plot", str(path)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "trace.png").exists()
    for plot, message in ((tmp_path, "is a folder"), (tmp_path / "trace.xyz", "no figure format '.xyz'")):
        proc = subprocess.run([sys.executable, "-m", "tileattn.cli", "trace", "--plot", str(plot)],
                              capture_output=True, text=True, env=ENV, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
        assert proc.stdout == ""


def test_memory_tile_is_no_larger_than_the_sequence():
    row = teaching.memory_row(3, block=1000)
    assert row.tile_bytes == row.scores_bytes == 3 * 3 * 8


def test_trace_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(SystemExit) as exit_:
        cli.main(["trace", "--plot", str(tmp_path / "trace.png")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "pip install 'tileattn[plot]'" in err, err
    assert not (tmp_path / "trace.png").exists()


def test_memory_estimates_first_and_skips_what_would_not_fit(monkeypatch, recorded):
    per_score = teaching.naive_bytes_per_score()
    measured = teaching.memory_row(512, block=64).naive_bytes
    assert abs(per_score * 512**2 - measured) <= 0.05 * measured, (per_score * 512**2, measured)
    # 64 needs ~0.13 MB and runs; 1024 needs ~34 MB, more than 80 % of the 10 MB "available": skipped
    monkeypatch.setattr(teaching, "available_memory", lambda: 10_000_000)
    cli.main(["memory", "--sizes", "64", "1024", "--block", "16"])
    out = " ".join(recorded().split())
    assert "estimated peak of naive attention: N=64 0 MB, N=1024 34 MB" in out
    assert "N=1024: naive skipped: about 34 MB is more than 80% of the 10 MB available" in out
    assert re.search(r"│ 1024 │ skipped │", out) and re.search(r"│ 64 │ +0\.\d\d │", out), out
    assert "(b)" not in out


def test_memory_shows_progress_on_a_terminal(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(width=WIDTH, file=buffer, force_terminal=True))
    cli.main(["memory", "--sizes", "64", "256", "--block", "16"])
    assert "N=256: naive ~2 MB and tiled" in buffer.getvalue()  # the bar's description


def test_memory_subcommand_and_bench_run():
    out = tileattn("memory", "--sizes", "64", "256", "--block", "16")
    assert number(r"from N=64 to N=256 \(4x longer\): naive grew (\S+)x", out) >= 8.0
    out = tileattn("bench", "--sizes", "128", "--repeats", "3", "--warmup", "1")
    rows = [line for line in out.splitlines() if re.match(r"^│\s+128 ", line)]
    assert [row.split("│")[2].strip() for row in rows] == ["tileattn", "torch SDPA", "naive torch"], out
    for row in rows:
        low, mid, high = (float(x.strip(" *")) for x in row.split("│")[3:6])
        assert 0 < low <= mid <= high, row
    assert "ms over 3 calls after 1 warm-up calls" in " ".join(out.split())


# ------------------------------------------------------------------------ help, refusals


def _options(parser: argparse.ArgumentParser):
    """(command, option) for every option of the parser and of each subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {opt}", a) for opt, a in _options(sub))
        elif not isinstance(action, argparse._HelpAction):
            yield action.dest, action


def test_every_option_and_command_has_help():
    parser = cli.build_parser()
    missing = [name for name, action in _options(parser) if not action.help or action.help == argparse.SUPPRESS]
    assert not missing, f"options without help: {missing}"
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert all(choice.help for choice in commands._choices_actions)


@pytest.mark.parametrize("command", [[], ["demo"], ["trace"], ["memory"], ["bench"]])
def test_help_reads_at_80_columns(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "usage: tileattn" in out
    assert_fits(out)


@pytest.mark.parametrize("argv, message", [
    (["trace", "--tile", "0"], "argument --tile: must be >= 1 (got 0)"),
    (["trace", "--keys", "many"], "argument --keys: 'many' is not an integer"),
    (["memory", "--sizes", "512", "0"], "argument --sizes: must be >= 1 (got 0)"),
    (["memory", "--block", "-4"], "argument --block: must be >= 1 (got -4)"),
    (["bench", "--repeats", "0"], "argument --repeats: must be >= 1 (got 0)"),
    (["bench", "--warmup", "-1"], "argument --warmup: must be >= 0 (got -1)"),
    (["trace", "--plot", "no/such/folder/trace.png"], "--plot: no folder no/such/folder to write into"),
    (["trace", "--seed", "-1"], "argument --seed: must be >= 0 (got -1)"),
    (["demo", "--seed", "-3"], "argument --seed: must be >= 0 (got -3)"),
    (["trace", "--sink", "inf"], "argument --sink: must be a finite number or -inf (got inf)"),
    (["trace", "--sink", "nan"], "argument --sink: must be a finite number or -inf (got nan)"),
    (["trace", "--sink", "big"], "argument --sink: 'big' is not a number"),
    (["teach"], "argument COMMAND: invalid choice: 'teach'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_bad_argument_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "tileattn.cli", "trace", "--tile", "0"], capture_output=True,
                          text=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and proc.stderr == (
        "tileattn trace: error: argument --tile: must be >= 1 (got 0) (see tileattn trace --help)\n")

