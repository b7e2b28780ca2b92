"""examples/serve.py as a newcomer runs it: a short CPU run that checks its own answers, help
for every option, and a one-line refusal (exit status 2) for each bad argument."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SERVE = Path(__file__).resolve().parents[1] / "examples" / "serve.py"


@pytest.fixture(scope="module")
def serve():
    spec = importlib.util.spec_from_file_location("serve_example", SERVE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_a_short_cpu_run_serves_every_request_and_checks_out(serve, capsys):
    # 3 requests over 4 slots: idle slots from the start, more as the shorter answers retire
    serve.main(["--device", "cpu", "--requests", "3", "--slots", "4", "--max-new", "4", "--block-size", "5"])
    out = capsys.readouterr().out
    assert len(re.findall(r"^  request \d+: +\d+ prompt -> +\d+ new tokens: ", out, re.M)) == 3, out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    free, total = map(int, re.search(r"blocks free after serving: (\d+) of (\d+) \(4 scratch\)", out).groups())
    assert free == total - 4, out  # every request gave its blocks back; the slots' scratch blocks stay
    gap = float(re.search(r"largest logit gap of a greedy token (\S+)", out).group(1))
    assert gap <= 1e-4, out


@pytest.mark.parametrize("options, gap", [(["--mixed"], 1e-4), (["--shared-prefix", "19"], 1e-4),
                                          (["--mixed", "--fp8-cache"], 0.5),
                                          (["--shared-prefix", "9", "--fp8-cache"], 0.5)])
def test_serving_modes_check_out(serve, capsys, options, gap):
    """--mixed (one varlen call per layer over the paged cache), --shared-prefix (cascade) and
    --fp8-cache on the CPU: every greedy token is the argmax of a full recompute (fp32: up to
    rounding; an FP8 cache keeps 3 mantissa bits of the keys and values, and its queries are
    bf16, so its logits may move by a few hundredths)."""
    serve.main(["--device", "cpu", "--requests", "3", "--slots", "2", "--max-new", "4", *options])
    out = capsys.readouterr().out
    assert len(re.findall(r"^  request \d+: +\d+ prompt -> +\d+ new tokens: ", out, re.M)) == 3, out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    free, total = map(int, re.search(r"blocks free after serving: (\d+) of (\d+)", out).groups())
    prefix_blocks = -(-int(options[1]) // 16) if "--shared-prefix" in options else 0
    assert free == total - 2 - prefix_blocks, out  # the slots' scratch blocks and the shared prefix stay
    found = float(re.search(r"largest logit gap of a greedy token (\S+)", out).group(1))
    assert found <= gap, out


def test_every_option_has_help(serve):
    actions = [a for a in serve.build_parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert actions and all(a.help and a.help != argparse.SUPPRESS for a in actions), \
        [a.dest for a in actions if not a.help]


BAD = [
    (["--slots", "0"], "argument --slots: must be >= 1 (got 0)"),
    (["--requests", "0"], "argument --requests: must be >= 1 (got 0)"),
    (["--block-size", "0"], "argument --block-size: must be >= 1 (got 0)"),
    (["--max-new", "-3"], "argument --max-new: must be >= 2 (got -3)"),
    (["--max-new", "1"], "argument --max-new: must be >= 2 (got 1)"),  # every answer has 2 tokens or more
    (["--slots", "two"], "argument --slots: 'two' is not an integer"),
    (["--device", "tpu"], "argument --device: 'tpu' is not a device; use cpu or cuda"),
    (["--device", "meta"], "argument --device: 'meta': use cpu or cuda"),
    (["--device", "cuda:99"], "argument --device: 'cuda:99': "),
    (["--shared-prefix", "-3"], "--shared-prefix must be >= 0, got -3"),
    (["--mixed", "--shared-prefix", "5"], "--shared-prefix does not combine with --mixed"),
]
if not torch.cuda.is_available():
    BAD.append((["--device", "cuda"], "argument --device: 'cuda': no CUDA GPU is available here"))


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(argv) for argv, _ in BAD])
def test_bad_argument_is_refused_in_one_line(serve, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert err.startswith("serve.py: error: "), err


def test_bad_argument_from_the_command_line():
    """As typed in a shell: the process exits with status 2 and one line, before any serving starts."""
    proc = subprocess.run([sys.executable, str(SERVE), "--slots", "0"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "serve.py: error: argument --slots: must be >= 1 (got 0) (see serve.py --help)\n"


def test_help_reads_at_80_columns(serve, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: serve.py")
    assert max(len(line) for line in out.splitlines()) <= 80, out
