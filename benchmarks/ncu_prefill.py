"""One prefill forward for Nsight Compute, tileattn's or SDPA's cuDNN kernel, and a side-by-side reader.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --set full --page raw --csv \\
        python benchmarks/ncu_prefill.py run tileattn --hdim 64 --seqlen 2048 --causal > tileattn.csv
    python benchmarks/ncu_prefill.py compare tileattn.csv cudnn.csv

``run`` makes prefill.py's tensors (16k tokens a batch, nheads x hdim = 2048, bf16; ``--group G``: G
query heads per key/value head, K and V repeated to every head for cuDNN) and calls the forward three
times without grad, the third inside the NVTX range ``profile`` (the first two compile and touch
memory). ``compare`` reads the CSVs of ``--page raw --csv`` and prints, side by side, the metrics that say
where a forward's time goes: duration and clocks, the tensor pipe's and the exp2 (XU) pipe's busy share,
issue slots, instruction-cache requests and hit rate, the warp stall reasons, L2 hit rate and DRAM bytes. Of several kernels in a file (a counter's
reset beside the attention kernel) it takes the longest.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

from prefill import TOKENS, WIDTH  # prefill.py's shapes

# Metric name patterns for ``compare``, in the order printed (a metric is shown once, under its first match).
PATTERNS = (
    r"^gpu__time_duration\.sum$",
    r"^sm__cycles_elapsed\.avg$",
    r"^sm__cycles_active\.avg$",
    r"^sm__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^sm__pipe_tensor.*cycles_active.*pct_of_peak_sustained_(active|elapsed)$",
    r"^sm__inst_executed_pipe_tensor.*pct",
    r"^sm__inst_executed_pipe_xu.*pct",
    r"^sm__pipe_(fma|alu|xu|fp16)_cycles_active.*pct_of_peak_sustained_active$",
    r"^sm__inst_executed\.sum$",
    r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
    r"^smsp__inst_executed\.sum$",
    r"^sm__icc_request(s|_hit_rate)\.(sum|pct)$",
    r"^smsp__average_warp(s)?_(issue_stalled|latency_issue_stalled)_.*(_per_issue_active\.ratio)?$",
    r"^lts__t_sector(s)?_hit_rate\.pct$",
    r"^lts__t_sectors_srcunit_tex_op_read_lookup_hit\.sum$",
    r"^dram__bytes_read\.sum$",
    r"^dram__bytes_write\.sum$",
    r"^launch__registers_per_thread$",
    r"^launch__grid_size$",
    r"^launch__block_size$",
)


def make_call(impl: str, hdim: int, seqlen: int, causal: bool, group: int):
    import torch
    import torch.nn.functional as F

    nheads, batch = WIDTH // hdim, max(1, TOKENS // seqlen)
    q = torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, nheads // group, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if impl == "tileattn":
        import tileattn

        return lambda: tileattn.flash_attn_func(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return call


def read_raw(path: str) -> dict[str, tuple[str, str]]:
    """{metric: (unit, value)} of the longest kernel in an ``ncu --page raw --csv`` file (the rows before
    the header and ncu's own messages are skipped; a row of units after it, its ID cell empty, is read
    as such)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    header, rest = rows[start], [r for r in rows[start + 1:] if r and not r[0].startswith("==")]
    units = rest.pop(0) if len(rest) > 1 and rest[0][0] == "" else [""] * len(header)
    kernels = [{name: (unit, value) for name, unit, value in zip(header, units, row)} for row in rest]
    if not kernels:
        raise SystemExit(f"{path}: no kernel profiled")
    return max(kernels, key=lambda k: float(k.get("gpu__time_duration.sum", ("", "0"))[1].replace(",", "") or 0))


def compare(paths: list[str]) -> None:
    kernels = [read_raw(p) for p in paths]
    names = [k.get("Kernel Name", ("", p))[1][:40] for k, p in zip(kernels, paths)]
    print(f"{'metric':72s} {'unit':10s} " + " ".join(f"{n:>22s}" for n in names))
    shown = set()
    for pattern in PATTERNS:
        for metric in sorted(set().union(*kernels)):
            if metric in shown or not re.search(pattern, metric):
                continue
            shown.add(metric)
            unit = next((k[metric][0] for k in kernels if metric in k), "")
            cells = " ".join(f"{k.get(metric, ('', '-'))[1]:>22s}" for k in kernels)
            print(f"{metric:72s} {unit:10s} {cells}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="three forward calls of one implementation (under ncu)")
    r.add_argument("impl", choices=("tileattn", "cudnn"))
    r.add_argument("--hdim", type=int, default=64)
    r.add_argument("--seqlen", type=int, default=2048)
    r.add_argument("--causal", action="store_true")
    r.add_argument("--group", type=int, default=1)
    c = sub.add_parser("compare", help="side-by-side metrics of ncu --page raw --csv files")
    c.add_argument("paths", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "compare":
        compare(args.paths)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("ncu_prefill.py run needs a CUDA GPU (and Nsight Compute around it)")
    call = make_call(args.impl, args.hdim, args.seqlen, args.causal, args.group)
    with torch.no_grad():
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    sys.exit(main())
