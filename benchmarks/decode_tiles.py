"""Decode tile sweep: which key block, warps, stages and split count a decoding step should use.

The decode launch (``tileattn.gpu.attention``) uses one fixed tile, ``DECODE_BLOCK_N`` keys
(``DECODE_BLOCK_N_WHOLE_PAGES`` when pages hold whole tiles) by ``DECODE_NUM_WARPS`` warps with
up to ``DECODE_MAX_STAGES`` pipeline stages, and splits the keys by ``_auto_splits``. This script sets those constants to each candidate in turn and times
``flash_attn_with_kvcache`` replayed from a CUDA graph (GQA 32/8, hdim 128, bf16, one query
token), on the cases the targets of issue #5 name:

* batch 1 with 8k and 32k keys, contiguous, each split count (0 = the heuristic);
* batch 1 and 16 with 32k keys in paged caches (blocks of 16 and 256), each split count;
* batch 64 with 32k keys, contiguous and paged with blocks of 16 and 256 (no split: 512
  programs fill the GPU).

Every output is compared with the fp32 reference of ``decode.py``. The table lists the best
few per case beside the current default. ``--fp8`` stores the caches in float8_e4m3fn (descales
per sequence and KV head; the reference reads the dequantised values; GB/s counts the fp8 bytes).

    python benchmarks/decode_tiles.py [--out DIR] [--smoke] [--only SUBSTRING ...] [--tiles 128x4x3 ...] [--l2 zero|read]
                                      [--fp8]
"""

from __future__ import annotations

import itertools

import common
import decode

TILES = [(n, w, s) for n, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4))]
SPLITS = (0, 8, 16, 24, 32, 48, 64)


def cases(smoke: bool):
    """(name, batch, kv_len, block size or None, split counts)."""
    if smoke:
        return [("b1 300", 1, 300, None, (0, 2)), ("b2 300 paged16", 2, 300, 16, (0,))]
    return [("b1 8k", 1, 8192, None, SPLITS), ("b1 32k", 1, 32768, None, SPLITS),
            ("b1 32k paged16", 1, 32768, 16, SPLITS), ("b1 32k paged256", 1, 32768, 256, SPLITS),
            ("b16 32k paged16", 16, 32768, 16, (0, 2, 4)), ("b16 32k paged256", 16, 32768, 256, (0, 2, 4)),
            ("b64 32k", 64, 32768, None, (0,)), ("b64 32k paged16", 64, 32768, 16, (0,)),
            ("b64 32k paged256", 64, 32768, 256, (0,))]


def run(args) -> list[dict]:
    import torch

    import tileattn
    import tileattn.gpu.attention as launch

    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" or args.fp8 else torch.float32  # an FP8 cache takes a 16-bit q
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles] or (TILES[:2] if args.smoke else TILES)
    names = ("DECODE_BLOCK_N", "DECODE_BLOCK_N_WHOLE_PAGES", "DECODE_NUM_WARPS", "DECODE_MAX_STAGES")
    saved = {name: getattr(launch, name) for name in names}
    rows = []
    for name, b, n, block, splits in cases(args.smoke):
        if args.only and not any(part in name for part in args.only):
            continue
        g = torch.Generator(device=dev).manual_seed(n + b)
        q = torch.randn(b, 1, decode.NHEADS, decode.HDIM, device=dev, dtype=dtype, generator=g)
        kc, vc = (torch.randn(b, n, decode.NHEADS_K, decode.HDIM, device=dev, dtype=dtype, generator=g)
                  for _ in range(2))
        descales = {}
        if args.fp8:  # the stored values and what they stand for
            from tileattn.ops.fp8 import quantize

            k_descale, v_descale = (c.abs().amax(dim=(1, 3)).float() / 448 for c in (kc, vc))
            kc, vc = quantize(kc, k_descale), quantize(vc, v_descale)
            descales = dict(k_descale=k_descale, v_descale=v_descale)
            ref = decode.reference(q, kc.float() * k_descale[:, None, :, None], vc.float() * v_descale[:, None, :, None])
        else:
            ref = decode.reference(q, kc, vc)
        table = None
        if block is not None:
            kc, vc, table = decode.paged_copy(kc, vc, block)
        seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
        kv_bytes = 2 * b * n * decode.NHEADS_K * decode.HDIM * kc.element_size()
        default = (launch._decode_tile(16, block or 0, decode.HDIM, q.element_size())[0],
                   saved["DECODE_NUM_WARPS"], saved["DECODE_MAX_STAGES"])
        for (bn, warps, stages), split in itertools.product(tiles, splits):
            for const, value in zip(names, (bn, bn, warps, stages)):
                setattr(launch, const, value)
            launch.clear_plans()  # the plans were made with the previous constants

            def step(split=split):
                return tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                        num_splits=split, **descales)

            ms, note, err = None, "", None
            if dev == "cuda":
                graph, note = common.attempt(lambda: common.cuda_graph(step))
                if graph is not None:
                    replay, out = graph
                    ms, note = common.attempt(lambda: common.bench(replay, dev, l2=args.l2))
            else:
                out, note = common.attempt(step)
                ms = None
            if not note:
                err = (out.float() - ref).abs().max().item()
            rows.append(dict(case=name, block_n=bn, warps=warps, stages=stages, splits=split,
                             default=(bn, warps, stages) == default and split == 0, us=ms and ms * 1e3,
                             gbs=common.gbs(kv_bytes, ms), err=err, note=note))
        for const, value in saved.items():
            setattr(launch, const, value)
        launch.clear_plans()
        del q, kc, vc, table, ref, descales
        common.free_cuda()
    return rows


def report(rows, top: int = 6) -> None:
    body = []
    for name in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == name]
        timed = sorted((r for r in mine if r["us"] is not None), key=lambda r: r["us"])
        shown = timed[:top] + [r for r in mine if r["default"] and r not in timed[:top]]
        for r in shown:
            body.append([name, f"{r['block_n']}×{r['warps']}w×{r['stages']}s", r["splits"] or "auto",
                         common.fmt(r["us"]), common.fmt(r["gbs"], 0), common.fmt(r["err"], 3),
                         "default" if r["default"] else r["note"][:40]])
    common.print_table("Decode tiles (CUDA-graph replay): fastest first, then the default",
                       ["case", "key block × warps × stages", "splits", "µs", "GB/s", "max err", "note"], body)
    bad = [r for r in rows if r["err"] is not None and not r["err"] < 0.05]
    print(f"variants whose output is off the fp32 reference by 0.05 or more: {len(bad)}")


def main() -> None:
    def extra(p):
        p.add_argument("--only", nargs="*", default=[], help="run the cases whose name contains one of these")
        p.add_argument("--tiles", nargs="*", default=[], help="tiles as KEYSxWARPSxSTAGES (default: all)")
        p.add_argument("--l2", choices=("zero", "read"), default="zero",
                       help="how the L2 is cleared before each repetition (decode.py's option)")
        p.add_argument("--fp8", action="store_true", help="caches in float8_e4m3fn with descales")

    args = common.parse_args(__doc__.splitlines()[0], extra)
    _, env = common.start_run(args.device)
    rows = run(args)
    common.write_csv(f"{args.out}/decode_tiles.csv", rows, env)
    report(rows)


if __name__ == "__main__":
    main()
