"""A/B of tileattn variants ("arms"), each a source tree and module constants, in alternating fresh processes.

    python benchmarks/ab.py --arm main=src --arm branch=../branch/src \\
        --arm tma=src:tileattn.gpu.hopper.TMA_STORE_HEAD_DIMS=(64,) \\
        [--hdims 64,128] [--seqlens 2048,8192] [--causal both] [--rounds 2] [--backward] [--out DIR]
    [--group G] [--varlen]

An arm is ``NAME=TREE`` with optional ``:module.ATTR=LITERAL`` settings (``;`` between several):
the process imports tileattn from TREE (its ``src`` folder) and sets each constant before the
first call, the way a launcher rule's tuple or threshold is switched for a comparison. Each round
runs every arm once, in the order given, each in a fresh process; the rounds repeat that order,
so drift of the host and the GPU's clocks (a process's first measurement meets a cool GPU) falls
on every arm alike. In each process: prefill.py's shapes (16k tokens a batch, nheads x hdim =
2048, bf16), ``tileattn.flash_attn_func`` forward alone without grad (``--backward``: also
forward + backward, the backward's TFLOP/s as prefill.py counts it), and SDPA's cuDNN backend on
the same tensors as the anchor (on the CPU, ``--smoke``: fp32, tiny shapes, SDPA's default).
``--group G``: G query heads per key/value head (GQA; the anchor gets K and V repeated to every
query head, the same FLOPs). ``--varlen``: each batch's sequences packed into one
``flash_attn_varlen_func`` call, half of them 1/2 and half 3/2 of the seqlen (16k tokens all the same;
one sequence where the batch is one), without an anchor (SDPA has no packed form).

The table gives, per cell and arm, the median TFLOP/s over the rounds, its ratio to the first
arm's, and the anchor's median over every process. Write down what a change should gain before
running it (docs/perf-notes.md).
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import common
from prefill import TOKENS, WIDTH  # prefill.py's shapes


def parse_arm(text: str) -> dict:
    """``NAME=TREE[:module.ATTR=LITERAL[;...]]`` -> {"name", "tree", "settings": [(module, attr, literal)]}
    (the literal as written, checked here and evaluated in the arm's process: JSON would turn a tuple
    into a list on the way)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"--arm {text!r}: expected NAME=TREE[:module.ATTR=LITERAL[;...]]")
    tree, _, spec = rest.partition(":")
    settings = []
    for item in filter(None, spec.split(";")):
        target, sep, literal = item.partition("=")
        module, _, attr = target.rpartition(".")
        if not sep or not module:
            raise SystemExit(f"--arm {text!r}: setting {item!r} is not module.ATTR=LITERAL")
        try:
            ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--arm {text!r}: {literal!r} is not a Python literal") from None
        settings.append((module, attr, literal))
    if not Path(tree).is_dir():
        raise SystemExit(f"--arm {text!r}: {tree} is not a folder")
    return {"name": name, "tree": str(Path(tree).resolve()), "settings": settings}


def build_cases(args) -> list[dict]:
    if args.smoke:
        return [dict(hdim=16, causal=c, seqlen=64, batch=2, nheads=2, group=args.group, varlen=args.varlen)
                for c in (False, True)]
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return [dict(hdim=d, causal=c, seqlen=s, batch=TOKENS // s, nheads=WIDTH // d, group=args.group,
                 varlen=args.varlen)
            for d in (int(x) for x in args.hdims.split(",")) for s in (int(x) for x in args.seqlens.split(","))
            for c in causal]


def varlen_lengths(batch: int, seqlen: int) -> list[int]:
    """``--varlen``'s sequence lengths: 1/2 and 3/2 of ``seqlen`` in turn, the last one ``seqlen`` when the
    count is odd, so that they add up to batch x seqlen."""
    lengths = [seqlen // 2 if i % 2 == 0 else seqlen + seqlen // 2 for i in range(batch)]
    if batch % 2:
        lengths[-1] = seqlen
    return lengths


def worker(spec: dict) -> None:
    """One arm's process: set its constants, time every case, print one JSON line per case."""
    import importlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    settings = [(module, attr, ast.literal_eval(literal)) for module, attr, literal in spec["settings"]]
    for module, attr, value in settings:
        mod = importlib.import_module(module)
        if not hasattr(mod, attr):
            raise SystemExit(f"{module} has no {attr}")
        setattr(mod, attr, value)
    import tileattn

    device, backward = spec["device"], spec["backward"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for case in spec["cases"]:
        g = torch.Generator(device=device).manual_seed(case["seqlen"] + case["hdim"])
        nheads, hdim, causal = case["nheads"], case["hdim"], case["causal"]
        nheads_k = nheads // case["group"]
        if case["varlen"]:
            lengths = varlen_lengths(case["batch"], case["seqlen"])
            rows_q, rows_k = (sum(lengths), nheads, hdim), (sum(lengths), nheads_k, hdim)
            flops = sum(common.attn_flops(1, nheads, n, n, hdim, causal) for n in lengths)
        else:
            rows_q, rows_k = (case["batch"], case["seqlen"], nheads, hdim), (case["batch"], case["seqlen"], nheads_k,
                                                                            hdim)
            flops = common.attn_flops(case["batch"], nheads, case["seqlen"], case["seqlen"], hdim, causal)
        q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype, generator=g)
                         for shape in (rows_q, rows_k, rows_k, rows_q))
        if case["varlen"]:
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

            def call():
                return tileattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)

            anchor = None
        else:
            def call():
                return tileattn.flash_attn_func(q, k, v, causal=causal)

            qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(case["group"], 2),
                                                       v.repeat_interleave(case["group"], 2)))
            backend = SDPBackend.CUDNN_ATTENTION if device == "cuda" else SDPBackend.MATH

            def anchor():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        with torch.no_grad():
            fwd = common.bench(call, device, cpu_reps=2)
            fwd_anchor = common.bench(anchor, device, cpu_reps=2) if anchor else None
        row = {**case, "arm": spec["name"], "settings": repr(settings), "fwd_tflops": common.tflops(flops, fwd),
               "anchor_fwd_tflops": common.tflops(flops, fwd_anchor)}
        if backward:
            for t in (q, k, v):
                t.requires_grad_(True)
            step = common.bench(lambda: call().backward(dout), device, grad_to_none=[q, k, v], cpu_reps=2)
            # the step's own time too: bwd_tflops is empty where it did not exceed the forward's (two noisy
            # timings on a busy CPU), while fwdbwd_ms shows the backward ran
            row["fwdbwd_ms"], row["bwd_tflops"] = step, common.bwd_tflops(flops, fwd, step)
        print("AB " + json.dumps(row), flush=True)


def run_arm(arm: dict, args, cases) -> list[dict]:
    spec = {**arm, "device": args.device, "backward": args.backward, "cases": cases}
    env = {**os.environ, "PYTHONPATH": arm["tree"]}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=args.timeout)
    rows = [json.loads(line[3:]) for line in proc.stdout.splitlines() if line.startswith("AB ")]
    if proc.returncode != 0 or len(rows) != len(cases):  # a comparison with a broken arm says nothing
        raise SystemExit(f"arm {arm['name']}: exit {proc.returncode}, {len(rows)} of {len(cases)} cases\n"
                         f"{proc.stderr[-1500:]}")
    return rows


def table(rows: list[dict], arms: list[str], backward: bool, device: str) -> None:
    parts = ["fwd", "bwd"] if backward else ["fwd"]
    cells = sorted({(r["hdim"], r["causal"], r["seqlen"]) for r in rows}, key=lambda c: (-c[0], c[1], c[2]))
    header = ["hdim", "causal", "seqlen", "part"] + [a for a in arms] + [f"{a} / {arms[0]}" for a in arms[1:]]
    header += ["cuDNN" if device == "cuda" else "SDPA"]
    out = []
    for hdim, causal, seqlen in cells:
        for part in parts:
            mine = [r for r in rows if (r["hdim"], r["causal"], r["seqlen"]) == (hdim, causal, seqlen)]
            med = {a: _median(r.get(f"{part}_tflops") for r in mine if r["arm"] == a) for a in arms}
            ratios = [_ratio_cell(mine, a, arms[0], part, med) for a in arms[1:]]
            anchor = _median(r.get("anchor_fwd_tflops") for r in mine) if part == "fwd" else None
            out.append([str(hdim), "yes" if causal else "no", str(seqlen), part, *(common.fmt(med[a]) for a in arms),
                        *ratios, common.fmt(anchor)])
    common.print_table("A/B: TFLOP/s, medians over the rounds (alternating processes); ratios: median [each round]",
                       header, out)


def _ratio_cell(rows: list[dict], arm: str, first: str, part: str, med: dict) -> str:
    """``arm``'s median over ``first``'s, then each round's own ratio in brackets (the two arms' processes
    of one round ran back to back), so that "ahead in every round" reads off the table."""
    if not med[arm] or not med[first]:
        return "–"
    by_round = {(r["arm"], r["round"]): r.get(f"{part}_tflops") for r in rows}
    per = [by_round[arm, i] / by_round[first, i] for (a, i) in sorted(by_round) if a == arm
           and by_round[arm, i] and by_round.get((first, i))]
    return f"{med[arm] / med[first]:.3f} [{' '.join(f'{x:.3f}' for x in per)}]"


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return

    def extra(p):
        p.add_argument("--arm", action="append", default=[], help="NAME=TREE[:module.ATTR=LITERAL[;...]] (two or more)")
        p.add_argument("--hdims", default="64,128", help="comma-separated head dims (default 64,128)")
        p.add_argument("--seqlens", default="2048,8192", help="comma-separated seqlens (default 2048,8192)")
        p.add_argument("--causal", default="both", choices=("both", "yes", "no"))
        p.add_argument("--rounds", type=int, default=2, help="rounds of one process per arm (default 2)")
        p.add_argument("--backward", action="store_true", help="also time forward + backward")
        p.add_argument("--timeout", type=float, default=300, help="seconds per process (default 300)")
        p.add_argument("--group", type=int, default=1, help="query heads per key/value head (GQA; default 1)")
        p.add_argument("--varlen", action="store_true", help="packed sequences of 1/2 and 3/2 the seqlen")

    args = common.parse_args(__doc__.splitlines()[0], extra)
    arms = [parse_arm(a) for a in args.arm]
    if len(arms) < 2 or len({a["name"] for a in arms}) != len(arms):
        raise SystemExit("give two or more --arm with distinct names")
    cases = build_cases(args)
    print(f"{len(arms)} arms x {args.rounds} rounds x {len(cases)} cases: {', '.join(a['name'] for a in arms)}")
    if args.dry_run:
        return
    env = common.env_info(args.device)
    common.print_env(env)
    rows = []
    for r in range(args.rounds):
        for arm in arms:
            rows += [{**row, "round": r} for row in run_arm(arm, args, cases)]
            Path(args.out).mkdir(parents=True, exist_ok=True)
            common.write_csv(f"{args.out}/ab.csv", rows, env, quiet=True)
    common.write_csv(f"{args.out}/ab.csv", rows, env)
    table(rows, [a["name"] for a in arms], args.backward, args.device)


if __name__ == "__main__":
    main()
