"""Prefill (training-shape) attention: forward and forward+backward TFLOP/s, and extra memory.

Shapes as in the FlashAttention papers and the anchors of docs/benchmarks.md:
batch·seqlen = 16384 tokens, nheads·hdim = 2048, seqlen 512 / 2048 / 8192 / 16384,
hdim 64 and 128, causal and not, bf16. tileattn.flash_attn_func runs beside torch SDPA with each backend forced (flash, cuDNN,
efficient) and FlexAttention (torch.compile; causal through a block mask), on the same
tensors: SDPA and Flex take transposed (B, H, S, D) views of tileattn's (B, S, H, D) data.
"tileattn" is the default dispatch (the Gluon kernels for Hopper where they apply, forward and
backward: the printed path says which forward and backward ran), "tileattn tl" the portable Triton kernels
(``TILEATTN_HOPPER=0`` while its forward and its backward run).

FlexAttention compiles once per shape (tens of seconds each), so by default it runs only at
seqlen 8192 (``--flex-seqlens`` changes that; ``--quick`` skips it).

``--rounds N`` times every implementation of a shape N times, interleaved (round 1 runs each
once, then round 2, ...), and reports each one's median over the rounds, with the spread
((max - min) / median of the forward's milliseconds) in the CSV: one implementation's reading
that jumps in a single cell of a one-round table (cuDNN's did, by 6-10 %, in two runs of
2026-12-01) then moves the median less.

    python benchmarks/prefill.py [--quick] [--rounds N] [--out DIR] [--dry-run] [--smoke]
"""

from __future__ import annotations

import common

IMPLS = ("tileattn", "tileattn tl", "sdpa flash", "sdpa cudnn", "sdpa efficient", "flex")
TOKENS, WIDTH = 16384, 2048


def add_args(p) -> None:
    p.add_argument("--flex-seqlens", default="8192",
                   help="comma-separated seqlens at which FlexAttention runs ('' for none; default 8192)")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated implementations to run (of {', '.join(IMPLS)})")
    p.add_argument("--hdims", default="", help="comma-separated head dims (default: 128,64; --quick: 128)")
    p.add_argument("--seqlens", default="", help="comma-separated seqlens (default: 512,2048,8192,16384)")
    p.add_argument("--hdim-v", type=int, default=0,
                   help="v's head dim when it differs from q/k's (MLA training: --hdims 192 --hdim-v 128)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each shape's implementations this many times, interleaved; report the medians")


def build_cases(args) -> list[dict]:
    """One dict per shape: hdim, hdim_v, causal, seqlen, batch, nheads, fwd FLOPs (the two
    matmuls: q/k's head dim in one, v's in the other)."""
    if args.smoke:
        grid = [(64, c, s, 1, 2) for c in (False, True) for s in (128, 256)]
    else:
        hdims, seqlens = ((128,), (2048, 16384)) if args.quick else ((128, 64), (512, 2048, 8192, 16384))
        hdims = tuple(int(x) for x in args.hdims.split(",")) if args.hdims else hdims
        seqlens = tuple(int(x) for x in args.seqlens.split(",")) if args.seqlens else seqlens
        grid = [(d, c, s, TOKENS // s, WIDTH // d) for d in hdims for c in (False, True) for s in seqlens]
    dv = lambda d: args.hdim_v or d  # noqa: E731
    return [dict(hdim=d, hdim_v=dv(d), causal=c, seqlen=s, batch=b, nheads=h,
                 flops=common.attn_flops(b, h, s, s, (d + dv(d)) / 2, c)) for d, c, s, b, h in grid]


def make_impl(name: str, causal: bool, seqlen: int, device: str):
    """A function (q, k, v) -> out on (B, S, H, D) tensors, for implementation ``name``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "tileattn":
        import tileattn

        return lambda q, k, v: tileattn.flash_attn_func(q, k, v, causal=causal)
    if name == "tileattn tl":
        import os

        import tileattn

        class Switch(torch.autograd.Function):
            """Identity whose backward sets TILEATTN_HOPPER (to ``value``, or unset when None): "0"
            on the output (its backward runs just before the attention's), None on q (just after)."""

            @staticmethod
            def forward(ctx, x, value):
                ctx.value = value
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                if ctx.value is None:
                    os.environ.pop("TILEATTN_HOPPER", None)
                else:
                    os.environ["TILEATTN_HOPPER"] = ctx.value
                return grad, None

        def portable(q, k, v):
            os.environ["TILEATTN_HOPPER"] = "0"
            try:
                out = tileattn.flash_attn_func(Switch.apply(q, None), k, v, causal=causal)
            finally:
                del os.environ["TILEATTN_HOPPER"]
            return Switch.apply(out, "0")

        return portable
    if name.startswith("sdpa"):
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[name.split()[1]]

        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=causal)
            return o.transpose(1, 2)

        return sdpa
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        flex = common.compiled_flex()
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seqlen, seqlen, device=device)

        def run(q, k, v):
            return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask).transpose(1, 2)

        return run
    raise ValueError(name)


def inputs(case: dict, device: str, dtype):
    import torch

    g = torch.Generator(device=device).manual_seed(case["seqlen"] + case["hdim"])
    shape = (case["batch"], case["seqlen"], case["nheads"], case["hdim"])
    shape_v = shape[:-1] + (case["hdim_v"],)
    q, k, v, dout = (torch.randn(sh, device=device, dtype=dtype, generator=g) for sh in (shape, shape, shape_v, shape_v))
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, dout


def time_case(case: dict, name: str, args, dtype, ref: dict) -> dict:
    """Forward and forward+backward milliseconds of one implementation on one shape.

    ``ref`` caches the first output computed on this shape (same inputs for every
    implementation); ``err`` is each output's max |difference| from it, a sanity check.
    """
    row = {"table": "speed", **{k: case[k] for k in ("hdim", "causal", "seqlen", "batch", "nheads")}, "impl": name}
    q, k, v, dout = inputs(case, args.device, dtype)
    if name == "tileattn":
        row["path"] = dispatch_path(q, k, v, case["causal"])
    fn, note = common.attempt(lambda: make_impl(name, case["causal"], case["seqlen"], args.device))
    fwd = fwdbwd = None
    if fn is not None:
        out, note = common.attempt(lambda: fn(q, k, v).detach().float())
        if out is not None:
            ref.setdefault("out", (name, out))
            row["err"] = (out - ref["out"][1]).abs().max().item()
            row["err_vs"] = ref["out"][0]
            del out
    if fn is not None and not note:
        fwd, note = common.attempt(lambda: common.bench(lambda: fn(q, k, v), args.device, cpu_reps=2))
    if fwd is not None and not args.no_backward:
        fwdbwd, note = common.attempt(lambda: common.bench(lambda: fn(q, k, v).backward(dout), args.device,
                                                            grad_to_none=[q, k, v], cpu_reps=2))
    row.update(fwd_ms=fwd, fwd_tflops=common.tflops(case["flops"], fwd), fwdbwd_ms=fwdbwd,
               bwd_tflops=common.bwd_tflops(case["flops"], fwd, fwdbwd), note=note)
    del q, k, v, dout
    common.free_cuda()
    return row


def median_row(rounds: list[dict], case: dict) -> dict:
    """One implementation's rows of one shape over the rounds, as one row: the medians of the
    forward's and the forward+backward's milliseconds (rounds that failed left out), the TFLOP/s
    from them, and the forward's spread over the rounds."""
    import statistics

    row = dict(rounds[0])
    for key in ("fwd_ms", "fwdbwd_ms"):
        times = [r[key] for r in rounds if r[key] is not None]
        row[key] = statistics.median(times) if times else None
    fwd = [r["fwd_ms"] for r in rounds if r["fwd_ms"] is not None]
    row.update(fwd_tflops=common.tflops(case["flops"], row["fwd_ms"]),
               bwd_tflops=common.bwd_tflops(case["flops"], row["fwd_ms"], row["fwdbwd_ms"]),
               rounds=len(fwd), fwd_spread=(max(fwd) - min(fwd)) / row["fwd_ms"] if fwd else None,
               note=next((r["note"] for r in rounds if r["note"]), ""))
    return row


def dispatch_path(q, k, v, causal: bool) -> str:
    """Which forward and backward kernels tileattn's dispatch picks for these tensors, as
    'fwd hopper / bwd tl (why)': 'hopper' (Gluon) or 'tl (why not)' for each."""
    if not q.is_cuda:
        return "cpu"
    from tileattn.contract import AttnParams
    from tileattn.gpu.hopper import hopper_fwd_reason
    from tileattn.gpu.hopper_bwd import hopper_bwd_reason

    params = AttnParams(q.shape[-1] ** -0.5, -1, 0 if causal else -1)
    fwd = hopper_fwd_reason(q, k, v, params, alibi_slopes=None, varlen=False, paged=False, seqused_k=None,
                            num_splits=0)
    bwd = hopper_bwd_reason(q, q, k, v, q, k, v, params)
    return " / ".join(f"{part} {'hopper' if why is None else f'tl ({why})'}" for part, why in (("fwd", fwd),
                                                                                              ("bwd", bwd)))


def memory_case(case: dict, name: str, args, dtype) -> dict:
    """Peak GPU memory beyond q, k, v, dout, out (and dq, dk, dv after backward), in MB."""
    import torch

    row = {"table": "memory", **{k: case[k] for k in ("hdim", "causal", "seqlen", "batch", "nheads")}, "impl": name,
           "naive_scores_mb": case["batch"] * case["nheads"] * case["seqlen"] ** 2 * 4 / 2**20}

    def measure():
        q, k, v, dout = inputs(case, args.device, dtype)
        fn = make_impl(name, case["causal"], case["seqlen"], args.device)
        fn(q, k, v).backward(dout)  # warm-up: autotuning and workspace allocation happen here
        q.grad = k.grad = v.grad = None
        common.free_cuda()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(q, k, v)
        torch.cuda.synchronize()
        fwd_extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
        out.backward(dout)
        torch.cuda.synchronize()
        bwd_extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size() - 3 * q.numel() * q.element_size()
        return fwd_extra / 2**20, bwd_extra / 2**20

    res, note = common.attempt(measure)
    row.update(extra_fwd_mb=res and res[0], extra_fwdbwd_mb=res and res[1], note=note)
    common.free_cuda()
    return row


def speed_table(cases, rows, env) -> None:
    """The anchors' layout: one line per shape, 'fwd / bwd' TFLOP/s per implementation."""
    by = {(r["hdim"], r["causal"], r["seqlen"], r["impl"]): r for r in rows if r["table"] == "speed"}
    body = []
    for c in cases:
        cells = []
        for name in IMPLS:
            r = by.get((c["hdim"], c["causal"], c["seqlen"], name))
            cells.append("–" if r is None else f"{common.fmt(r['fwd_tflops'])} / {common.fmt(r['bwd_tflops'])}")
        hdim = c["hdim"] if c["hdim_v"] == c["hdim"] else f"{c['hdim']}/{c['hdim_v']}"
        body.append([hdim, "yes" if c["causal"] else "no", c["seqlen"], f"{c['batch']}×{c['nheads']}", *cells])
    cap = None if not env.get("matmul_tflops") else f"bf16 matmul ceiling {env['matmul_tflops']:.0f} TFLOP/s"
    common.print_table("Prefill TFLOP/s, forward / backward (backward = 2.5×fwd FLOPs / (fwd+bwd − fwd))",
                       ["hdim", "causal", "seqlen", "b×h", *IMPLS], body, caption=cap)


def memory_table(rows) -> None:
    mem = [r for r in rows if r["table"] == "memory"]
    if mem:
        common.print_table("Peak memory beyond inputs/outputs (MB)",
                           ["hdim", "seqlen", "impl", "fwd", "fwd+bwd", "naive fp32 scores"],
                           [[r["hdim"], r["seqlen"], r["impl"], common.fmt(r["extra_fwd_mb"], 1),
                             common.fmt(r["extra_fwdbwd_mb"], 1), common.fmt(r["naive_scores_mb"])] for r in mem])


def plot(cases, rows, path, env) -> None:
    keys = sorted({(c["hdim"], c["causal"]) for c in cases})
    fig, axes = common.new_figure(len(keys), 2)
    for j, (d, causal) in enumerate(keys):
        for i, (metric, label) in enumerate((("fwd_tflops", "forward"), ("bwd_tflops", "backward"))):
            ax = axes[i][j]
            for name in IMPLS:
                pts = sorted((r["seqlen"], common.nan(r[metric])) for r in rows
                             if r["table"] == "speed" and r["impl"] == name and r["hdim"] == d and r["causal"] == causal)
                if pts and any(y == y for _, y in pts):
                    ax.plot(*zip(*pts), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{label}, hdim {d}, {'causal' if causal else 'full'}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    common.save_figure(fig, path, f"prefill bf16 · {env['device']} · torch {env['torch']} · triton {env['triton']}")


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], add_args)
    cases = build_cases(args)
    flex_at = {int(s) for s in args.flex_seqlens.split(",") if s.strip()} if not args.quick else set()
    if args.smoke:
        flex_at = {256}
    if args.dry_run:
        common.print_table("prefill cases", ["hdim", "causal", "seqlen", "batch", "nheads", "fwd GFLOP", "flex"],
                           [[c["hdim"], c["causal"], c["seqlen"], c["batch"], c["nheads"], common.fmt(c["flops"] / 1e9),
                             c["seqlen"] in flex_at] for c in cases])
        return
    import torch

    dtype, env = common.start_run(args.device)
    impls = [name for name in IMPLS if name in args.impls.split(",")]
    rows = []
    for c in cases:
        ref: dict = {}
        names = [name for name in impls if name != "flex" or c["seqlen"] in flex_at]
        timed: dict = {name: [] for name in names}
        so_far: list = []
        for i in range(args.rounds):
            for name in names:
                timed[name].append(time_case(c, name, args, dtype, ref))
                r = timed[name][-1]
                print(f"  hdim {c['hdim']} causal {c['causal']} seqlen {c['seqlen']} {name}"
                      f"{f' (round {i + 1})' if args.rounds > 1 else ''}: "
                      f"{common.fmt(r['fwd_tflops'])} / {common.fmt(r['bwd_tflops'])} TFLOP/s"
                      f"{' [' + r['path'] + ']' if r.get('path') else ''}", flush=True)
                so_far = [median_row(timed[n], c) for n in names if timed[n]]  # a run cut short keeps these
                common.write_csv(f"{args.out}/prefill.csv", rows + so_far, env, quiet=True)
        rows += so_far
    if args.device.startswith("cuda"):
        longest = max(c["seqlen"] for c in cases)
        for c in cases:
            if c["seqlen"] == longest and not c["causal"]:
                rows += [memory_case(c, name, args, dtype) for name in ("tileattn", "sdpa flash") if name in impls]
    del ref
    common.free_cuda()
    speed_table(cases, rows, env)
    errs = [(r["err"], r["impl"]) for r in rows if r.get("err") is not None]
    if errs:
        worst = max(errs, key=lambda e: e[0] if e[0] == e[0] else float("inf"))  # NaN counts as the worst
        print(f"largest max |out − first implementation's out| on the same inputs: {worst[0]:.3g} ({worst[1]})")
    memory_table(rows)
    common.print_notes(rows)
    common.write_csv(f"{args.out}/prefill.csv", rows, env)
    plot(cases, rows, f"{args.out}/prefill.png", env)


if __name__ == "__main__":
    main()
