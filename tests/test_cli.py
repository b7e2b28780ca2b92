"""``tileattn demo | trace | memory | bench`` run as a user runs them, and keep what they print.

Each command runs once in a subprocess (``python -m tileattn.cli``); the checks read the
summary lines that the commands print below their tables.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# One BLAS thread: the reference multiplies small tiles, and OpenBLAS's threads spinning on a
# busy 2-core CI machine make that up to 10x slower; the printed numbers do not depend on it.
ENV = {**os.environ, "COLUMNS": "200", "OPENBLAS_NUM_THREADS": "1"}


def tileattn(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, "-m", "tileattn.cli", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)
    assert proc.returncode == 0, f"tileattn {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in the output:\n{text}"
    return float(found.group(1))


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
    assert "rows whose first key tile is masked: True" in demo
    assert number(r"guarded: max error (\S+), all finite: True", demo) <= 1e-12


def test_demo_shows_the_public_api_within_tolerance(demo):
    rows = [line for line in demo.splitlines() if re.match(r"^│\s+(cpu|cuda) ", line)]
    assert any(" cpu " in row for row in rows), demo
    assert all(row.rstrip(" │").endswith("yes") for row in rows), "\n".join(rows)


@pytest.mark.parametrize("tile", ["1", "4"])
def test_trace_ends_exact(tile):
    out = tileattn("trace", "--keys", "13", "--tile", tile, "--seed", "5")
    assert number(r"final error after the last tile: (\S+)", out) <= 1e-14
    later_tiles = -(-13 // int(tile)) - 1
    assert number(r"rescalings: \d+ of (\d+) tiles after the first", out) == later_tiles
    assert 0 <= number(r"rescalings: (\d+) of", out) <= later_tiles


def test_trace_plot_writes_a_png(tmp_path):
    path = tmp_path / "trace.png"
    tileattn("trace", "--keys", "20", "--seed", "1", "--plot", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_subcommand_and_bench_run():
    out = tileattn("memory", "--sizes", "64", "256", "--block", "16")
    assert number(r"from N=64 to N=256 \(4x longer\): naive grew (\S+)x", out) >= 8.0
    out = tileattn("bench", "--sizes", "128", "--repeats", "1")
    row = next(line for line in out.splitlines() if re.match(r"^│\s+128 ", line))
    assert len(re.findall(r"\d+\.\d+ \(\d+\.\d+\)", row)) == 3, row  # tileattn, SDPA, naive: ms (GFLOP/s)


def test_bad_arguments_are_refused():
    proc = subprocess.run([sys.executable, "-m", "tileattn.cli", "trace", "--tile", "0"], capture_output=True,
                          text=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and "--tile must be >= 1" in proc.stderr
