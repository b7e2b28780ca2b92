"""Decoding: one query token over a KV cache, µs and GB/s (K and V bytes read once).

GQA with 32 query heads and 8 KV heads, hdim 128, bf16; batch 1 / 16 / 64, kv length
1024 / 8192 / 32768 (every sequence full). tileattn.flash_attn_with_kvcache reads a
contiguous cache and paged caches (block_size 16 and 256, block table a random permutation
of a pool larger than needed, holding the same keys), each timed eagerly and replayed from
a CUDA graph (as serving loops do; eager calls include tileattn's input checks). Beside it,
SDPA flash and cuDNN on transposed views of the same contiguous cache, with
``enable_gqa=True`` (or K/V repeated per query head beforehand if a backend refuses it: the
note column says so). Every output is compared with an fp32 reference (``err``). Last, the
``read floor``: the same number of bytes read by the fastest plain streaming kernel
(``common.read_floor``, graph-replayed), the least time any decoding kernel could take here; and
``read floor·evict_first``, the same read with an L2 evict-first hint on its loads (how much of
do_bench's dirty-L2 write-back a hinted decoding kernel could avoid).

MLA (issue #18): DeepSeek's absorbed decoding, 128 query heads over one latent of 576 per token
whose first 512 are the values (``v_cache = k_cache[..., :512]``, one storage), bf16, paged in
FlashMLA's blocks of 64; batch 64 x 8k keys (and more without ``--quick``). µs, TB/s of latent
read once and TFLOP/s (2·b·h·n·(576 + 512) FLOPs: 146 GFLOP over 604 MB at 64 x 8k, compute-bound
on an H200). Beside it: the same attention in plain torch as an engine without a fused kernel
runs it (two batched matmuls over the contiguous latent, softmax in fp32 between), SDPA's
efficient and cuDNN backends on q (b, 128, 1, 576) against the latent and its first 512 columns
expanded over the heads (no copy; a backend that refuses a value head dim of its own or 576 gets
an n/a and its reason), and the latent's read floor.

With ``--l2 read`` every implementation is timed with the L2 cleared by a read instead of
do_bench's write of zeros (``common.bench``): the dirty lines the write leaves cost a
kernel that reads less than the L2 holds an extra write-back. The default is do_bench's, the
timing of the anchors in docs/benchmarks.md.

    python benchmarks/decode.py [--quick] [--out DIR] [--dry-run] [--smoke] [--l2 zero|read]
"""

from __future__ import annotations

import common

NHEADS, NHEADS_K, HDIM = 32, 8, 128
BLOCK_SIZES = (16, 256)
IMPLS = ("tileattn", "tileattn·graph", "paged16", "paged16·graph", "paged256", "paged256·graph",
         "sdpa flash", "sdpa cudnn", "read floor", "read floor·evict_first")


MLA_NHEADS, MLA_DIM, MLA_DIM_V, MLA_PAGE = 128, 576, 512, 64
MLA_SCALE = 192**-0.5  # DeepSeek-V3's: the un-absorbed q/k head dim (128 + 64)
MLA_IMPLS = ("mla paged64", "mla paged64·graph", "mla contiguous", "mla torch bmm", "mla sdpa efficient",
             "mla sdpa cudnn", "mla read floor")


def build_cases(args) -> list[dict]:
    if args.smoke:
        grid = [(b, n) for b in (1, 2) for n in (100, 300)]
    elif args.quick:
        grid = [(1, 8192), (1, 32768), (64, 8192), (64, 32768)]
    else:
        grid = [(b, n) for b in (1, 16, 64) for n in (1024, 8192, 32768)]
    return [dict(batch=b, kv_len=n, kv_bytes=2 * b * n * NHEADS_K * HDIM * 2) for b, n in grid]


def paged_copy(k_cache, v_cache, block_size: int):
    """The same keys in a shuffled block pool: (k_pool, v_pool, block_table int32); v_cache None
    for one pool alone (MLA's latent): (pool, block_table)."""
    import torch

    batch, n = k_cache.shape[:2]
    nblocks = -(-n // block_size)
    pool = batch * nblocks + batch * nblocks // 8 + 1  # more blocks than needed, like a real pool
    table = torch.randperm(pool, device=k_cache.device)[: batch * nblocks].view(batch, nblocks).to(torch.int32)
    pools = []
    for cache in (k_cache,) if v_cache is None else (k_cache, v_cache):
        p = torch.full((pool, block_size, *cache.shape[2:]), float("nan"), dtype=cache.dtype, device=cache.device)
        padded = torch.zeros((batch, nblocks * block_size, *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
        padded[:, :n] = cache
        p[table.long().flatten()] = padded.view(batch * nblocks, block_size, *cache.shape[2:])
        pools.append(p)
    return (*pools, table)


def reference(q, k_cache, v_cache):
    """fp32 softmax(q kᵀ/√d) v per sequence, query head h reading KV head h // 4."""
    import torch

    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = NHEADS // NHEADS_K
    for b in range(q.shape[0]):
        qb = q[b, 0].float().view(NHEADS_K, group, HDIM)  # [Hk, G, D]
        kb, vb = k_cache[b].float().transpose(0, 1), v_cache[b].float().transpose(0, 1)  # [Hk, N, D]
        p = torch.softmax(qb @ kb.transpose(1, 2) / HDIM**0.5, dim=-1)  # [Hk, G, N]
        out[b, 0] = (p @ vb).reshape(NHEADS, HDIM)
    return out


def sdpa_fn(backend_name: str, q, k_cache, v_cache):
    """(fn, note): SDPA decoding on (B, H, S, D) views; GQA natively or with K/V repeated."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)

    def native():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

    _, err = common.attempt(native)
    if not err:
        return native, "enable_gqa"
    kr = kt.repeat_interleave(NHEADS // NHEADS_K, dim=1)
    vr = vt.repeat_interleave(NHEADS // NHEADS_K, dim=1)

    def repeated():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kr, vr).transpose(1, 2)

    return repeated, f"K/V repeated ×{NHEADS // NHEADS_K} (enable_gqa failed: {err[:60]})"


def build_mla_cases(args) -> list[dict]:
    if args.smoke:
        grid = [(1, 100), (2, 300)]
    elif args.quick:
        grid = [(64, 8192)]
    else:
        grid = [(1, 32768), (16, 8192), (64, 8192)]
    return [dict(batch=b, kv_len=n, kv_bytes=b * n * MLA_DIM * 2,
                 flops=2.0 * b * MLA_NHEADS * n * (MLA_DIM + MLA_DIM_V)) for b, n in grid]


def mla_reference(q, latent):
    """fp32 softmax(scale q latentᵀ) latent[..., :512] per sequence: q (b, 1, 128, 576), latent (b, n, 1, 576)."""
    import torch

    out = torch.empty(q.shape[:-1] + (MLA_DIM_V,), dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        kb = latent[b, :, 0].float()  # [N, 576]
        p = torch.softmax(q[b, 0].float() @ kb.T * MLA_SCALE, dim=-1)  # [H, N]
        out[b, 0] = p @ kb[:, :MLA_DIM_V]
    return out


def mla_bmm(q, latent):
    """Absorbed MLA in plain torch: scores = q latentᵀ as one batched matmul, fp32 softmax, times the
    latent's first 512 columns (q's dtype for both products)."""
    import torch

    qb, kb = q[:, 0], latent[:, :, 0]  # [B, H, 576], [B, N, 576]
    p = torch.softmax(torch.bmm(qb, kb.transpose(1, 2)).float() * MLA_SCALE, dim=-1).to(q.dtype)
    return torch.bmm(p, kb[..., :MLA_DIM_V])[:, None]


def mla_sdpa(backend_name: str, q, latent):
    """SDPA on q (B, 128, 1, 576) against the latent expanded over the heads (stride 0, no copy)
    and its first 512 columns as the values."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    qt = q.transpose(1, 2)
    kt = latent.transpose(1, 2).expand(-1, MLA_NHEADS, -1, -1)
    vt = kt[..., :MLA_DIM_V]

    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, scale=MLA_SCALE).transpose(1, 2)

    return run


def timed_row(case: dict, args, ref, name: str, fn, note: str = "", captured=None) -> dict:
    """Time ``fn`` (None: it could not be built, ``note`` says why) and check its output against
    ``ref`` (a graph replay returns nothing: ``captured`` is the output tensor it writes): one row."""
    out, err, ms = None, note, None
    if fn is not None:
        out, err = common.attempt(fn)
        out = captured if captured is not None else out
    if out is not None:
        ms, err = common.attempt(lambda: common.bench(fn, args.device, cpu_reps=3, l2=args.l2))
    bw = common.gbs(case["kv_bytes"], ms)
    diff = None if out is None else (out.float() - ref).abs().max().item()
    if diff is not None and not diff < float("inf"):
        err = f"WRONG OUTPUT: NaN or inf (max |out - ref| = {diff}); {err or note}"
    return dict(batch=case["batch"], kv_len=case["kv_len"], kv_mb=case["kv_bytes"] / 2**20, impl=name, l2=args.l2,
                us=ms and ms * 1e3, gbs=bw, pct_hbm=bw and 100 * bw / common.HBM_PEAK_GBS,
                tflops=common.tflops(case["flops"], ms) if "flops" in case else None, err=diff, note=err or note)


def run_mla_case(case: dict, args, dtype) -> list[dict]:
    import torch

    import tileattn

    dev, (b, n) = args.device, (case["batch"], case["kv_len"])
    g = torch.Generator(device=dev).manual_seed(b * 7919 + n)
    q = torch.randn(b, 1, MLA_NHEADS, MLA_DIM, device=dev, dtype=dtype, generator=g)
    latent = torch.randn(b, n, 1, MLA_DIM, device=dev, dtype=dtype, generator=g)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
    ref = mla_reference(q, latent)
    rows = []

    def record(name, fn, note="", captured=None):
        rows.append(timed_row(case, args, ref, name, fn, note, captured))

    def tile(cache, table):
        return lambda: tileattn.flash_attn_with_kvcache(q, cache, cache[..., :MLA_DIM_V], cache_seqlens=seqlens,
                                                        block_table=table, softmax_scale=MLA_SCALE, causal=True)

    pool, table = paged_copy(latent, None, MLA_PAGE)
    fn = tile(pool, table)
    record("mla paged64", fn)
    graph, err = common.attempt(lambda: common.cuda_graph(fn))
    replay, captured = graph if graph is not None else (None, None)
    record("mla paged64·graph", replay, err, captured)
    del pool, table, fn, graph, replay, captured
    common.free_cuda()
    record("mla contiguous", tile(latent, None))
    record("mla torch bmm", lambda: mla_bmm(q, latent))
    for backend in ("efficient", "cudnn"):
        record(f"mla sdpa {backend}", mla_sdpa(backend, q, latent))
    floor, err = common.attempt(lambda: common.read_floor(case["kv_bytes"], dev, args.l2))
    if floor is not None:
        bw = common.gbs(case["kv_bytes"], floor)
        rows.append(dict(batch=b, kv_len=n, kv_mb=case["kv_bytes"] / 2**20, impl="mla read floor", l2=args.l2,
                         us=floor * 1e3, gbs=bw, pct_hbm=100 * bw / common.HBM_PEAK_GBS,
                         tflops=common.tflops(case["flops"], floor), err=None, note=err))
    common.free_cuda()
    return rows


def mla_tables(cases, rows) -> None:
    by = {(r["batch"], r["kv_len"], r["impl"]): r for r in rows}
    body = []
    for c in cases:
        key = [c["batch"], c["kv_len"], common.fmt(c["kv_bytes"] / 2**20), common.fmt(c["flops"] / 1e9)]
        cells = [by.get((c["batch"], c["kv_len"], name)) for name in MLA_IMPLS]
        body.append(key + [f"{common.fmt(r['us'])} ({common.fmt(r['gbs'] and r['gbs'] / 1000)}; "
                           f"{common.fmt(r['tflops'])})" if r and r["us"] else "–" for r in cells])
    common.print_table("MLA absorbed decoding, 128 heads over the 576 latent (v = its first 512): "
                       "µs (TB/s of latent read once; TFLOP/s)",
                       ["batch", "kv len", "latent MB", "GFLOP", *MLA_IMPLS], body)


def run_case(case: dict, args, dtype) -> list[dict]:
    import torch

    dev, (b, n) = args.device, (case["batch"], case["kv_len"])
    g = torch.Generator(device=dev).manual_seed(b * 100003 + n)
    q = torch.randn(b, 1, NHEADS, HDIM, device=dev, dtype=dtype, generator=g)
    k_cache, v_cache = (torch.randn(b, n, NHEADS_K, HDIM, device=dev, dtype=dtype, generator=g) for _ in range(2))
    seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
    ref = reference(q, k_cache, v_cache)
    rows = []

    def record(name, fn, note="", captured=None):
        rows.append(timed_row(case, args, ref, name, fn, note, captured))

    def tile(kc, vc, table):
        import tileattn

        return lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)

    def layouts():
        yield "tileattn", k_cache, v_cache, None
        for bs in BLOCK_SIZES:
            yield (f"paged{bs}", *paged_copy(k_cache, v_cache, bs))

    for name, kc, vc, table in layouts():
        fn = tile(kc, vc, table)
        record(name, fn)
        graph, err = common.attempt(lambda: common.cuda_graph(fn))
        replay, captured = graph if graph is not None else (None, None)
        record(f"{name}·graph", replay, err, captured)
        del kc, vc, table, fn, graph, replay, captured
        common.free_cuda()
    floor, err = common.attempt(lambda: common.read_floor(case["kv_bytes"], dev, args.l2))
    if floor is not None:  # no output to check: the read floor is a ceiling, not an attention
        bw = common.gbs(case["kv_bytes"], floor)
        rows.append(dict(batch=b, kv_len=n, kv_mb=case["kv_bytes"] / 2**20, impl="read floor", l2=args.l2,
                         us=floor * 1e3, gbs=bw, pct_hbm=100 * bw / common.HBM_PEAK_GBS, err=None, note=err))
    # the same read with L2 evict-first loads: what a decoding kernel whose K/V loads carry the hint
    # could reach after do_bench's flush (docs/perf-notes.md, "Batch-1 decoding toward the read floor")
    floor, err = common.attempt(lambda: common.read_floor(case["kv_bytes"], dev, args.l2, evict="evict_first"))
    if floor is not None:
        bw = common.gbs(case["kv_bytes"], floor)
        rows.append(dict(batch=b, kv_len=n, kv_mb=case["kv_bytes"] / 2**20, impl="read floor·evict_first",
                         l2=args.l2, us=floor * 1e3, gbs=bw, pct_hbm=100 * bw / common.HBM_PEAK_GBS, err=None,
                         note=err))
    for backend in ("flash", "cudnn"):
        made, err = common.attempt(lambda: sdpa_fn(backend, q, k_cache, v_cache))
        fn, note = made if made is not None else (None, err)
        record(f"sdpa {backend}", fn, note)
    common.free_cuda()
    return rows


def tables(cases, rows) -> None:
    by = {(r["batch"], r["kv_len"], r["impl"]): r for r in rows}
    body_us, body_pct = [], []
    for c in cases:
        key = [c["batch"], c["kv_len"], common.fmt(c["kv_bytes"] / 2**20)]
        cells = [by.get((c["batch"], c["kv_len"], name)) for name in IMPLS]
        body_us.append(key + [f"{common.fmt(r['us'])} ({common.fmt(r['gbs'], 0)})" if r else "–" for r in cells])
        body_pct.append(key + [common.fmt(r["pct_hbm"], 0) if r else "–" for r in cells])
    header = ["batch", "kv len", "K+V MB", *IMPLS]
    flush = "by a read" if rows and rows[0]["l2"] == "read" else "by writing zeros (do_bench)"
    common.print_table(f"Decoding: µs (GB/s), K+V bytes read once; L2 cleared {flush}", header, body_us)
    common.print_table(f"Decoding: % of {common.HBM_PEAK_GBS / 1000:.1f} TB/s", header, body_pct)
    worst = max((r["err"] for r in rows if r["err"] is not None and r["err"] < float("inf")), default=None)
    print(f"largest finite |out − fp32 reference| over all outputs: {common.fmt(worst, 4)}")
    common.print_notes(rows)


def plot(cases, rows, path, env) -> None:
    fig, axes = common.new_figure(1, 1, width=12, height=4)
    ax = axes[0][0]
    width = 0.8 / len(IMPLS)
    for i, name in enumerate(IMPLS):
        ys = [common.nan(next((r["gbs"] for r in rows if r["impl"] == name and r["batch"] == c["batch"]
                               and r["kv_len"] == c["kv_len"]), None)) for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=name)
    ax.axhline(common.HBM_PEAK_GBS, color="k", ls="--", lw=1, label="HBM datasheet")
    if env.get("copy_gbs"):
        ax.axhline(env["copy_gbs"], color="gray", ls=":", lw=1, label="measured copy")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"b{c['batch']}\n{c['kv_len']}" for c in cases], fontsize=8)
    ax.set_ylabel("GB/s (K+V once)")
    ax.legend(fontsize=7, ncol=3)
    common.save_figure(fig, path, f"decode GQA 32/8 hdim 128 · {env['device']} · torch {env['torch']} · triton {env['triton']}")


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--l2", choices=("zero", "read"), default="zero", help="how the L2 is cleared before each repetition"))
    cases = build_cases(args)
    if args.dry_run:
        common.print_table("decode cases", ["batch", "kv len", "K+V MB", "µs at 4.8 TB/s"],
                           [[c["batch"], c["kv_len"], common.fmt(c["kv_bytes"] / 2**20),
                             common.fmt(c["kv_bytes"] / (common.HBM_PEAK_GBS * 1e3))] for c in cases])
        common.print_table("MLA decode cases", ["batch", "kv len", "latent MB", "GFLOP", "µs at 4.8 TB/s",
                                                "µs at 989 TFLOP/s"],
                           [[c["batch"], c["kv_len"], common.fmt(c["kv_bytes"] / 2**20), common.fmt(c["flops"] / 1e9),
                             common.fmt(c["kv_bytes"] / (common.HBM_PEAK_GBS * 1e3)),
                             common.fmt(c["flops"] / 989e6)] for c in build_mla_cases(args)])
        return
    import torch

    dtype, env = common.start_run(args.device)
    torch.manual_seed(0)  # the block-table permutations
    rows = []
    for c in cases:
        rows += run_case(c, args, dtype)
        print(f"  batch {c['batch']} kv {c['kv_len']}: " + ", ".join(
            f"{r['impl']} {common.fmt(r['us'])}µs" for r in rows[-len(IMPLS):]), flush=True)
        common.write_csv(f"{args.out}/decode.csv", rows, env, quiet=True)
    tables(cases, rows)
    mla_cases = build_mla_cases(args)
    mla_rows = []
    for c in mla_cases:
        case_rows = run_mla_case(c, args, dtype)
        mla_rows += case_rows
        print(f"  MLA batch {c['batch']} kv {c['kv_len']}: " + ", ".join(
            f"{r['impl']} {common.fmt(r['us'])}µs" for r in case_rows), flush=True)
        common.write_csv(f"{args.out}/decode.csv", rows + mla_rows, env, quiet=True)
    mla_tables(mla_cases, mla_rows)
    common.print_notes(mla_rows)
    rows += mla_rows
    launch = common.read_floor(4096, args.device, args.l2)
    if launch is not None:
        print(f"launch floor: a one-kernel CUDA graph reading 4 KB, timed the same way: {common.fmt(launch * 1e3)} µs")
    common.write_csv(f"{args.out}/decode.csv", rows, env)
    plot(cases, rows, f"{args.out}/decode.png", env)


if __name__ == "__main__":
    main()
