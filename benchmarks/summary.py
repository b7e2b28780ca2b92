"""The short combined table that ``run_gpu.sh`` prints last: headline numbers against the targets.

Reads the CSVs the benchmarks wrote into DIR (whatever exists) and the GPU test log; each
line holds tileattn's number, the comparison from the same run, and the target from the
anchors in docs/benchmarks.md ('bar' must pass, 'aim' is the goal).

    python benchmarks/summary.py DIR [STEP_STATUS ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import common
from common import fmt, num


def load(out: Path, name: str) -> list[dict]:
    path = out / f"{name}.csv"
    return common.read_csv(path) if path.exists() else []


def verdict(ok_bar: bool | None, ok_aim: bool | None) -> str:
    if ok_aim:
        return "aim ✓"
    if ok_bar:
        return "bar ✓"
    return "?" if ok_bar is None else "✗"


def prefill_lines(rows: list[dict]) -> list[list[str]]:
    speed = [r for r in rows if r["table"] == "speed"]
    lines = []
    for hdim in ("128", "64"):
        for causal in ("False", "True"):
            here = [r for r in speed if r["hdim"] == hdim and r["causal"] == causal]
            flex_at = {int(r["seqlen"]) for r in here if r["impl"] == "flex"}
            lens = sorted({int(r["seqlen"]) for r in here})
            if not lens:
                continue
            s = max(flex_at) if flex_at else max(lens)
            by = {r["impl"]: r for r in here if int(r["seqlen"]) == s}
            for key, label in (("fwd_tflops", "fwd"), ("bwd_tflops", "bwd")):
                mine, cudnn, flex = (num(by.get(i, {}).get(key)) for i in ("tileattn", "sdpa cudnn", "flex"))
                bar = None if mine is None or flex is None else mine > flex
                aim = None if mine is None or cudnn is None else mine >= cudnn
                if flex is None and aim is False:
                    bar = None
                lines.append([f"prefill {label} TFLOP/s, hdim {hdim}, {'causal' if causal == 'True' else 'full'}, s={s}",
                              fmt(mine), f"cuDNN {fmt(cudnn)} · Flex {fmt(flex)}", "bar > Flex · aim ≥ cuDNN",
                              verdict(bar, aim)])
    for r in (r for r in rows if r["table"] == "memory" and r["impl"] == "tileattn"):
        mb = num(r["extra_fwdbwd_mb"])
        naive = num(r["naive_scores_mb"])
        lines.append([f"extra memory fwd+bwd MB, hdim {r['hdim']}, s={r['seqlen']}", fmt(mb),
                      f"naive fp32 scores {fmt(naive)}", "O(N), never N²",
                      "?" if mb is None else "✓" if mb < 0.05 * naive else "✗"])
    return lines


def decode_lines(rows: list[dict]) -> list[list[str]]:
    by = {(r["batch"], r["kv_len"], r["impl"]): r for r in rows}
    lines = []
    big = max(((int(r["batch"]) * int(r["kv_len"]), r["batch"], r["kv_len"]) for r in rows), default=None)
    if big:
        _, b, n = big
        cudnn = num(by.get((b, n, "sdpa cudnn"), {}).get("gbs"))
        for impl in ("paged256·graph", "paged16·graph", "tileattn·graph"):
            g = num(by.get((b, n, impl), {}).get("gbs"))
            lines.append([f"decode GB/s {impl}, b={b}, kv={n}", fmt(g), f"cuDNN contiguous {fmt(cudnn)}",
                          "bar ≥ 4300 · aim ≥ cuDNN",
                          verdict(None if g is None else g >= 4300, None if g is None or cudnn is None else g >= cudnn)])
    for n, frac, aim_us in (("32768", 0.5, 35.0), ("8192", 0.25, 10.0)):
        mine = num(by.get(("1", n, "tileattn·graph"), {}).get("us"))
        eager = num(by.get(("1", n, "tileattn"), {}).get("us"))
        cudnn = num(by.get(("1", n, "sdpa cudnn"), {}).get("us"))
        floor = num(by.get(("1", n, "read floor"), {}).get("us"))
        if mine is None and cudnn is None:
            continue
        lines.append([f"decode µs, b=1, kv={n} (graph; eager)", f"{fmt(mine)}; {fmt(eager)}",
                      f"cuDNN {fmt(cudnn)} · read floor {fmt(floor)}",
                      f"bar ≤ {frac:g}×cuDNN · aim ≤ {aim_us:g}",
                      verdict(None if mine is None or cudnn is None else mine <= frac * cudnn,
                              None if mine is None else mine <= aim_us)])
    return lines


def window_lines(rows: list[dict]) -> list[list[str]]:
    lines = []
    for r in rows:
        if r["impl"] == "tileattn" and r["window"] != "full":
            lines.append([f"window {r['window']} / full causal time, fwd; fwd+bwd",
                          f"{fmt(num(r.get('fwd_ratio')), 3)}; {fmt(num(r.get('fwdbwd_ratio')), 3)}",
                          f"pairs ratio {fmt(num(r['pairs_ratio']), 3)}", "≈ pairs ratio", ""])
    return lines


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out")
    steps = sys.argv[2:]
    prefill, decode, window = load(out, "prefill"), load(out, "decode"), load(out, "window")
    any_rows = next((rows[0] for rows in (prefill, decode, window) if rows), None)
    if any_rows:
        print(f"\n{any_rows['date']} · {any_rows['device']} · torch {any_rows['torch']} · triton {any_rows['triton']}"
              f" · matmul {fmt(num(any_rows.get('matmul_tflops')))} TFLOP/s · copy {fmt(num(any_rows.get('copy_gbs')))} GB/s")
    lines = prefill_lines(prefill) + decode_lines(decode) + window_lines(window)
    common.print_table("tileattn headline numbers (details: bench.log, *.csv, *.png)",
                       ["what", "tileattn", "same run", "target", "status"], lines or [["no results found", "", "", "", ""]])
    log = out / "gpu_tests.log"
    if log.exists():
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        print(f"GPU tests: {tail[-1] if tail else '(empty log)'}")
    for s in steps:
        print(f"step {s}")


if __name__ == "__main__":
    main()
