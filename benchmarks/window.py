"""Sliding-window (local) causal attention: the time should follow the window, not seqlen².

seqlen 16384, batch 1, 16 heads of hdim 128, bf16. Query i sees keys max(0, i − w) … i
(flash-attn ``window_size=(w, 0)``, ``causal=True``), i.e. min(i, w) + 1 keys, so the work
is proportional to the number of visible (query, key) pairs, counted exactly here:

    pairs(w) = Σ_i (min(i, w) + 1),   FLOPs = 4 · b · h · d · pairs(w)   (forward)

The table shows each window's time as a fraction of full causal beside its fraction of the
pairs: a kernel that skips the tiles outside the band has the two ratios close.
FlexAttention runs with a sliding-window block mask at the full and 1k windows (it compiles
once per mask, so ``--quick`` skips it).

    python benchmarks/window.py [--quick] [--out DIR] [--dry-run] [--smoke]
"""

from __future__ import annotations

import common
import prefill

FULL = None  # the window value meaning plain causal


def visible_pairs(seqlen: int, window: int | None) -> int:
    """Σ_i (min(i, w) + 1) over queries i < seqlen; w = None is full causal (seqlen(seqlen+1)/2)."""
    w = seqlen - 1 if window is None else min(window, seqlen - 1)
    return (w + 1) * (w + 2) // 2 + (seqlen - w - 1) * (w + 1)


def build_cases(args) -> list[dict]:
    if args.smoke:
        s, b, h, d, windows, flex = 512, 1, 2, 64, (FULL, 64), (FULL, 64)
    else:
        s, b, h, d = 16384, 1, 16, 128
        windows = (FULL, 1024) if args.quick else (FULL, 4096, 1024, 256)
        flex = () if args.quick else (FULL, 1024)
    full = visible_pairs(s, FULL)
    return [dict(seqlen=s, batch=b, nheads=h, hdim=d, hdim_v=d, causal=True, window=w,
                 pairs_ratio=visible_pairs(s, w) / full, flops=4.0 * b * h * d * visible_pairs(s, w), flex=w in flex)
            for w in windows]


def make_impl(name: str, case: dict, device: str):
    """A function (q, k, v) -> out on (B, S, H, D) tensors: tileattn or FlexAttention."""
    w = case["window"]
    if name == "tileattn":
        import tileattn

        size = (-1, -1) if w is None else (w, 0)
        return lambda q, k, v: tileattn.flash_attn_func(q, k, v, causal=True, window_size=size)
    from torch.nn.attention.flex_attention import create_block_mask

    def band(b, h, qi, ki):
        keep = qi >= ki
        return keep if w is None else keep & (qi - ki <= w)

    s = case["seqlen"]
    mask = create_block_mask(band, None, None, s, s, device=device)
    flex = common.compiled_flex()
    return lambda q, k, v: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                block_mask=mask).transpose(1, 2)


def run_case(case: dict, name: str, args, dtype) -> dict:
    q, k, v, dout = prefill.inputs(case, args.device, dtype)
    fn, note = common.attempt(lambda: make_impl(name, case, args.device))
    fwd = fwdbwd = None
    if fn is not None:
        fwd, note = common.attempt(lambda: common.bench(lambda: fn(q, k, v), args.device, cpu_reps=2))
    if fwd is not None:
        fwdbwd, note = common.attempt(lambda: common.bench(lambda: fn(q, k, v).backward(dout), args.device,
                                                            grad_to_none=[q, k, v], cpu_reps=2))
    del q, k, v, dout
    common.free_cuda()
    return dict(window="full" if case["window"] is None else case["window"], impl=name, seqlen=case["seqlen"],
                pairs_ratio=case["pairs_ratio"], fwd_ms=fwd, fwdbwd_ms=fwdbwd,
                fwd_tflops=common.tflops(case["flops"], fwd),
                bwd_tflops=common.bwd_tflops(case["flops"], fwd, fwdbwd), note=note)


def add_ratios(rows) -> None:
    """Each window's time over the full-causal time of the same implementation."""
    for r in rows:
        full = next((f for f in rows if f["impl"] == r["impl"] and f["window"] == "full"), None)
        for key in ("fwd_ms", "fwdbwd_ms"):
            ok = full is not None and r[key] is not None and full[key]
            r[key.replace("_ms", "_ratio")] = r[key] / full[key] if ok else None


def table(rows) -> None:
    common.print_table(
        "Sliding window vs full causal (ratio = time / full-causal time; pairs = visible (q, k) pairs / full)",
        ["impl", "window", "pairs", "fwd ms", "fwd ratio", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd ratio", "bwd TFLOP/s"],
        [[r["impl"], r["window"], common.fmt(r["pairs_ratio"], 3), common.fmt(r["fwd_ms"], 3),
          common.fmt(r["fwd_ratio"], 3), common.fmt(r["fwd_tflops"]), common.fmt(r["fwdbwd_ms"], 3),
          common.fmt(r["fwdbwd_ratio"], 3), common.fmt(r["bwd_tflops"])] for r in rows])


def plot(rows, path, env) -> None:
    fig, axes = common.new_figure(2, 1, width=5)
    for ax, key, label in ((axes[0][0], "fwd_ms", "forward"), (axes[0][1], "fwdbwd_ms", "forward+backward")):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["pairs_ratio"], common.nan(r[key])) for r in rows if r["impl"] == impl]
            ax.plot(*zip(*sorted(pts)), marker="o", label=impl)
        full = [r for r in rows if r["window"] == "full" and r[key] is not None]
        if full:
            ax.plot([0, 1], [0, full[0][key]], "k--", lw=1, label=f"∝ pairs ({full[0]['impl']})")
        ax.set_xlabel("visible pairs / full causal")
        ax.set_ylabel("ms")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    common.save_figure(fig, path, f"sliding window, seqlen {rows[0]['seqlen']} · {env['device']} · "
                                  f"torch {env['torch']} · triton {env['triton']}")


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    cases = build_cases(args)
    if args.dry_run:
        common.print_table("window cases", ["seqlen", "b×h×d", "window", "pairs / full", "fwd GFLOP", "flex"],
                           [[c["seqlen"], f"{c['batch']}×{c['nheads']}×{c['hdim']}", c["window"] or "full",
                             common.fmt(c["pairs_ratio"], 4), common.fmt(c["flops"] / 1e9), c["flex"]] for c in cases])
        return
    import torch

    dtype, env = common.start_run(args.device)
    rows = []
    for name, todo in (("tileattn", cases), ("flex", [c for c in cases if c["flex"]])):
        for c in todo:
            rows.append(run_case(c, name, args, dtype))
            add_ratios(rows)
            print(f"  window {rows[-1]['window']} {name}: {common.fmt(rows[-1]['fwd_ms'], 3)} ms fwd, "
                  f"{common.fmt(rows[-1]['fwdbwd_ms'], 3)} ms fwd+bwd", flush=True)
            common.write_csv(f"{args.out}/window.csv", rows, env, quiet=True)
    table(rows)
    common.print_notes(rows)
    common.write_csv(f"{args.out}/window.csv", rows, env)
    plot(rows, f"{args.out}/window.png", env)


if __name__ == "__main__":
    main()
