"""The benchmark scripts keep working: each runs with ``--smoke`` (tiny fp32 shapes on the CPU)
in a fresh process and writes its CSV, and the outputs it compares agree.

Speed is never checked here (benchmarks measure it on the GPU). The numbers checked are the
scripts' own sanity checks: each output's largest difference from the script's reference
(decode.py and decode_tiles.py: an fp32 softmax; prefill.py: the first implementation's
output, which SDPA's rows are then compared with; generate.py: SDPA's greedy tokens), so a
script that stopped computing the right thing, or stopped running at all, fails.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
FP32_AGREEMENT = 1e-4  # tiny fp32 problems: the implementations agree to about 1e-6
BF16_AGREEMENT = 1e-2  # bf16 outputs of O(1) attention: their rounding alone reaches 4e-3; a wrong one is off by O(1)


def run_smoke(script: str, out: Path, env: dict | None = None, extra: tuple = ()) -> list[dict]:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", "--device", "cpu", "--out", str(out),
                           *extra],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    csv_path = out / script.replace(".py", ".csv")
    assert csv_path.exists(), f"{script} wrote no {csv_path.name}"
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


def errors(rows: list[dict]) -> list[float]:
    return [float(r["err"]) for r in rows if r.get("err")]


@pytest.mark.parametrize("script", ["prefill.py", "decode.py"])
def test_benchmark_outputs_agree(tmp_path, script):
    rows = run_smoke(script, tmp_path, extra=("--rounds", "2") if script == "prefill.py" else ())
    if script == "prefill.py":  # each implementation timed twice per shape, interleaved: one row of medians
        timed = [r for r in rows if r["table"] == "speed" and r["fwd_ms"]]
        assert timed and all(r["rounds"] == "2" and float(r["fwd_spread"]) >= 0 for r in timed), timed
        assert len({(r["hdim"], r["causal"], r["seqlen"], r["impl"]) for r in rows if r["table"] == "speed"}) == \
            len([r for r in rows if r["table"] == "speed"]), "one row per shape and implementation"
    tile_rows = [r for r in rows if r["impl"].startswith(("tileattn", "paged", "mla paged", "mla contiguous"))]
    assert tile_rows and all(r["note"] == "" or "CUDA" in r["note"] for r in tile_rows), tile_rows
    errs = errors(rows)
    assert len(errs) > len(tile_rows) // 2, "too few outputs were compared"
    assert max(errs) < FP32_AGREEMENT, f"{script}: outputs differ by {max(errs):.3e}"
    if script == "decode.py":  # MLA's absorbed decoding (576 latent, 128 heads): tileattn and plain torch
        mla = {r["impl"] for r in rows if r["impl"].startswith("mla") and r.get("err")}
        assert {"mla paged64", "mla contiguous", "mla torch bmm"} <= mla, mla


def test_window_benchmark_times_every_window(tmp_path):
    rows = run_smoke("window.py", tmp_path)
    tile_rows = [r for r in rows if r["impl"] == "tileattn"]
    assert len(tile_rows) >= 2 and all(float(r["fwd_ms"]) > 0 and float(r["fwdbwd_ms"]) > 0 for r in tile_rows)


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_tile_sweep_through_the_triton_kernels(tmp_path, fp8):
    """decode_tiles.py sets the launcher's decode constants; its outputs come from the Triton
    kernels (the interpreter on CPU tensors) with each tile it sets, over a bf16 or fp32 cache
    and over an FP8 one (``--fp8``, against the dequantised cache; bf16 queries there)."""
    import numpy as np

    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4):
        # The test extra pins numpy < 2.4 (CI has it); the GPU machine's image has a newer numpy.
        pytest.skip(f"Triton 3.6's interpreter needs numpy < 2.4, this is {np.__version__}")
    rows = run_smoke("decode_tiles.py", tmp_path, env={"TILEATTN_BACKEND": "triton", "TRITON_INTERPRET": "1"},
                     extra=("--fp8",) if fp8 else ())
    assert {r["case"] for r in rows} == {"b1 300", "b2 300 paged16"}
    errs = errors(rows)
    assert len(errs) == len(rows), [r["note"] for r in rows if not r.get("err")]
    assert max(errs) < (BF16_AGREEMENT if fp8 else FP32_AGREEMENT)


def test_generate_benchmark_gives_sdpa_tokens(tmp_path):
    """generate.py on the tiny CPU model in fp32: tileattn decodes the same greedy tokens as SDPA. The
    eager mode is asked for twice, so the per-mode loop runs twice as it does on a GPU (eager, then
    compiled, which the CPU skips): every row of both passes gets its tokens/s."""
    pytest.importorskip("transformers")
    rows = run_smoke("generate.py", tmp_path, env={"TILEATTN_BACKEND": "cpu"}, extra=("--modes", "eager,eager"))
    assert len(rows) == 6 and all(float(r["tokens_per_s"]) > 0 for r in rows)
    tile = [r for r in rows if r["impl"] == "tileattn" and r["mode"] == "eager"]
    assert tile and all(r["same_tokens"] == "100%" for r in tile)


def test_ab_runs_every_arm_in_every_round(tmp_path):
    """ab.py: each round runs each arm in a process of its own with its constants set (here the Hopper
    store rule, which the CPU path does not read: the outputs are the same, the rows say which ran)."""
    src = str(BENCHMARKS.parent / "src")
    rows = run_smoke("ab.py", tmp_path, extra=("--arm", f"plain={src}", "--arm",
                                               f"set={src}:tileattn.gpu.hopper.TMA_STORE_HEAD_DIMS=(64,)",
                                               "--rounds", "2", "--backward"))
    assert sorted((r["arm"], r["round"], r["causal"]) for r in rows) == sorted(
        (arm, str(n), causal) for arm in ("plain", "set") for n in range(2) for causal in ("False", "True"))
    settings = {r["settings"] for r in rows if r["arm"] == "set"}
    assert settings == {"[('tileattn.gpu.hopper', 'TMA_STORE_HEAD_DIMS', (64,))]"}  # a tuple stays a tuple
    assert all(float(r["fwd_tflops"]) > 0 and float(r["anchor_fwd_tflops"]) > 0 for r in rows)


@pytest.mark.parametrize("shape", [("--group", "2"), ("--varlen",)])
def test_ab_times_gqa_and_packed_batches(tmp_path, shape):
    """ab.py's other shapes: GQA (the anchor on K and V repeated to every head) and packed sequences of
    1/2 and 3/2 the seqlen (no anchor), forward and backward, each row saying which it was."""
    src = str(BENCHMARKS.parent / "src")
    rows = run_smoke("ab.py", tmp_path, extra=("--arm", f"a={src}", "--arm", f"b={src}", "--rounds", "1",
                                               "--backward", *shape))
    # the backward ran in every row (its TFLOP/s, a difference of two CPU timings, may be empty on a busy host:
    # 8 test workers beside it made it so on the GPU machine, 2026-12-02)
    assert len(rows) == 4 and all(float(r["fwd_tflops"]) > 0 and float(r["fwdbwd_ms"]) > 0 for r in rows)
    if shape[0] == "--varlen":
        assert all(r["varlen"] == "True" and not r["anchor_fwd_tflops"] for r in rows)
    else:
        assert all(r["group"] == "2" and float(r["anchor_fwd_tflops"]) > 0 for r in rows)


def test_ab_varlen_lengths_keep_the_tokens(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import ab

    for batch, seqlen in ((8, 2048), (2, 8192), (1, 16384), (3, 100)):
        lengths = ab.varlen_lengths(batch, seqlen)
        assert len(lengths) == batch and sum(lengths) == batch * seqlen and min(lengths) > 0


def test_ab_ratio_cells_give_each_round(monkeypatch):
    """ab.py's ratio cell: the median ratio, then each round's own (the arms' processes of one round
    ran back to back), so that "ahead in every round" reads off the table."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import ab

    rows = [dict(arm=arm, round=i, fwd_tflops=v) for arm, i, v in
            (("main", 0, 100.0), ("new", 0, 110.0), ("main", 1, 200.0), ("new", 1, 190.0))]
    med = {"main": 150.0, "new": 150.0}
    assert ab._ratio_cell(rows, "new", "main", "fwd", med) == "1.000 [1.100 0.950]"
    assert ab._ratio_cell(rows, "new", "main", "fwd", {"main": None, "new": 150.0}) == "–"


@pytest.mark.parametrize("arm, message", [("nofolder=/no/such/folder", "is not a folder"),
                                          ("x=src:tileattn.gpu.hopper.NOT_THERE=1", "has no NOT_THERE"),
                                          ("x=src:TMA_STORE_HEAD_DIMS=(64,)", "is not module.ATTR=LITERAL"),
                                          ("x=src:tileattn.gpu.hopper.TMA_STORE_HEAD_DIMS=sixty",
                                           "is not a Python literal")])
def test_ab_refuses_a_bad_arm(tmp_path, arm, message):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "ab.py"), "--smoke", "--device", "cpu",
                           "--out", str(tmp_path), "--arm", f"ok={BENCHMARKS.parent / 'src'}", "--arm", arm,
                           "--rounds", "1"],
                          capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent)
    assert message in proc.stdout + proc.stderr, proc.stdout[-1500:] + proc.stderr[-1500:]


def test_cpu_overhead_script_runs():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "overhead_cpu.py"), "--calls", "3", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("decode", "prefill", "varlen"))]
    assert len(rows) == 4 and all(float(row.split()[-1]) > 0 for row in rows), proc.stdout


def test_host_launch_times_triton_and_direct_launches():
    """host_launch.py runs Triton's launch path on a stand-in driver; the direct launch is taken
    (the script asserts it), every launcher case prints its three timings, every whole
    flash_attn_with_kvcache or flash_attn_func call its time and the launches it makes (a split
    decoding call one: its forward launch merges the splits), and every training step its forward,
    forward + backward and forward without grad, as this CPU dispatches and as the H200 does (the
    Gluon kernels where the Hopper rules take the 512-token calls; the script asserts that the
    timed calls launched them)."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "host_launch.py"), "--calls", "20", "--repeat", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    launchers, whole, cpu_steps, h200_steps = proc.stdout.split("\n\n")
    rows = [line.split() for line in launchers.splitlines()[1:]]
    assert len(rows) == 3 and all(float(r[-1]) > 0 for r in rows), proc.stdout
    calls = [line.rsplit(maxsplit=2) for line in whole.strip().splitlines()[1:]]  # name, µs, launches per call
    assert [name.strip() for name, _, _ in calls] == ["decode contiguous", "decode paged16", "decode contiguous, 16 splits",
                                                   "decode paged16, 33 splits", "decode contiguous + append",
                                                   "decode paged16 + append", "flash_attn_func, dense k/v"], proc.stdout
    assert all(float(us) > 0 and float(launches) >= 1 for _, us, launches in calls), proc.stdout
    launched = {name.strip(): float(launches) for name, _, launches in calls}  # split: merged in the one launch
    assert launched["decode contiguous, 16 splits"] == launched["decode paged16, 33 splits"] == 1, proc.stdout
    paths = {}
    for table in (cpu_steps, h200_steps):
        for line in table.strip().splitlines()[1:]:
            cell, numbers = line.split("  ", 1)
            fwd_us, step_us, no_grad_us, path = numbers.split(maxsplit=3)
            assert float(fwd_us) > 0 and float(step_us) > 0 and float(no_grad_us) > 0, proc.stdout
            paths.setdefault(cell, []).append(path.strip())
    cpu_paths = [p[0] for p in paths.values() if len(p) == 2]
    h200_paths = [p[-1] for p in paths.values()]
    assert len(paths) == 4 and len(cpu_paths) == 2 and set(cpu_paths) == {"portable / portable"}, proc.stdout
    kinds = {f"{fwd} / {bwd}" for fwd in ("gluon", "portable") for bwd in ("gluon", "portable")}
    assert set(h200_paths) <= kinds and any(p.startswith("gluon") for p in h200_paths), proc.stdout


def test_serving_benchmark_outputs_agree(tmp_path):
    """benchmarks/serving.py --smoke: the one mixed call equals the separate calls, cascade the plain
    paged call (fp32 on the CPU), the paged prefix launches the contiguous one, the FP8 call the
    bf16 call on the dequantised cache."""
    rows = run_smoke("serving.py", tmp_path)
    checked = {(r["scenario"], r["impl"]): float(r["err"]) for r in rows if r.get("err")}
    exact = [("mixed", "one call"), ("prefix", "cascade"), ("prefix launch", "paged 16"), ("prefix launch", "paged 256")]
    assert set(checked) >= {("fp8", "paged fp8"), *exact}, checked
    assert all(checked[name] < FP32_AGREEMENT for name in exact), checked
    assert checked[("fp8", "paged fp8")] < 2e-2, checked  # bf16 outputs: a few bf16 units apart


def test_serving_split_sweep_agrees_with_the_rule(tmp_path):
    """benchmarks/serving.py --smoke --only splits: every forced split count gives the rule's
    output on both batches (fp32 on the CPU), and each batch has its read-floor row."""
    rows = run_smoke("serving.py", tmp_path, extra=("--only", "splits"))
    forced = [r for r in rows if r["impl"].split(", splits ")[-1] in ("1", "4", "8", "16")]
    assert len(forced) == 8 and all(float(r["err"]) < FP32_AGREEMENT for r in forced), rows
    assert sum(r["impl"].endswith("read floor") for r in rows) == 2, rows


@pytest.mark.parametrize("layout", [("--tokens", "128"),
                                    ("--varlen", "llama3", "--tokens", "256", "--doc-min", "16", "--doc-max", "128",
                                     "--heads-k-stride", "1")], ids=["zigzag", "llama3"])
def test_ring_benchmark_runs_two_gloo_ranks(layout):
    """ring.py under torchrun with two CPU ranks: every timed loop runs, the transfer-only one
    included (it calls the engine's private exchanges, whose signatures it must follow), and
    its correctness check (fp32, against one process) agrees."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--standalone",
                           str(BENCHMARKS / "ring.py"), *layout, "--heads", "2", "--hdim", "32", "--reps", "1",
                           "--warmup", "0", "--check-tokens", "64", "--model-world", "4", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # gloo ranks, also on a GPU host
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    checks = [float(line.rsplit("=", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("check:")]
    assert checks and all(err <= FP32_AGREEMENT for err in checks), proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.strip().startswith(("128", "256"))]
    assert rows, proc.stdout


def test_generate_host_times_a_decoding_step_on_the_decoding_route():
    """generate_host.py times generate()'s decoding steps through the stand-in: every layer of every
    step runs a DecodePlan (the decoding route), and the steps after the first carry their plan on
    (fewer than one made anew per step) and its launch plan (the caches one key longer each step:
    fewer than one FwdPlan per step, with the plan cache emptied first)."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "generate_host.py"), "--steps", "4", "--sweeps", "1",
                           "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    us, made, fwd_made, runs = re.search(r"([\d.]+) µs per step.*?([\d.]+) DecodePlans made anew, ([\d.]+) FwdPlans "
                                         r"made \(cache emptied first\), ([\d.]+) plan runs", proc.stdout).groups()
    assert float(us) > 0 and float(made) < 1 and float(fwd_made) < 1 and float(runs) == 2, proc.stdout


def _ncu_raw_csv(path: Path, kernels: list[dict]) -> None:
    """A file as ``ncu --page raw --csv`` writes it: ncu's messages, the header, a row of units, a row a kernel."""
    names = ["ID", "Kernel Name", *kernels[0]]
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n==PROF== Profiling \"k\": 0%....100% - 40 passes\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(names)
        w.writerow(["", "", *("cycle" if "cycles" in m else "%" for m in kernels[0])])
        for i, k in enumerate(kernels):
            w.writerow([str(i), f"kernel_{i}", *k.values()])


def test_ncu_prefill_compare_reads_raw_pages(tmp_path):
    """ncu_prefill.py compare: the metrics that say where a kernel's time goes, side by side, from the raw
    pages of two profiles (the rest left out); of a page with several kernels, the longest."""
    ours = {"gpu__time_duration.sum": "370", "sm__cycles_active.avg": "640000", "other__metric": "1",
            "smsp__average_warp_latency_issue_stalled_barrier_per_issue_active.ratio": "2.5"}
    theirs = {**ours, "gpu__time_duration.sum": "350"}
    _ncu_raw_csv(tmp_path / "a.csv", [ours])
    _ncu_raw_csv(tmp_path / "b.csv", [theirs])
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "ncu_prefill.py"), "compare", str(tmp_path / "a.csv"),
                           str(tmp_path / "b.csv")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    assert lines["gpu__time_duration.sum"] == ["%", "370", "350"]
    assert lines["sm__cycles_active.avg"] == ["cycle", "640000", "640000"]
    assert "smsp__average_warp_latency_issue_stalled_barrier_per_issue_active.ratio" in lines
    assert "other__metric" not in lines
    reset = {**ours, "gpu__time_duration.sum": "2", "sm__cycles_active.avg": "900"}
    _ncu_raw_csv(tmp_path / "two.csv", [reset, ours])
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "ncu_prefill.py"), "compare", str(tmp_path / "two.csv")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "gpu__time_duration.sum" in proc.stdout and " 370" in proc.stdout and " 900" not in proc.stdout
