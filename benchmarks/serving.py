"""Serving: a mixed batch in one call, an FP8 KV cache, a shared prefix; µs beside their baselines.

GQA 32/8, hdim 128, bf16 queries, paged caches (block 16, tables a random permutation of a pool
larger than needed). Every tileattn call is timed eagerly and replayed from a CUDA graph.

* **mixed**: 48 decoding rows + 8 rows of 4 speculative tokens + 2 prefill chunks of 512, each
  sequence with 8k-32k cached keys, in one ``flash_attn_varlen_func`` call (vLLM's form), against
  the three separate calls (decode, speculative, prefill) and the ideal: the decode and
  speculative rows' K/V bytes at the read floor (``common.read_floor``) plus the prefill chunks
  alone (their call's time). Target: one call <= 1.1 x ideal.
* **fp8**: decoding batch 64 x 32k keys from a paged cache in bf16 and in float8_e4m3fn (with
  k/v descales), against SDPA cuDNN on the same keys in bf16 (contiguous). Target: fp8 <= 0.55 x
  cuDNN.
* **prefix**: 64 requests x (16k shared + 1k own) keys, one decoding token each:
  ``cascade_attn_with_kvcache`` against the plain paged call over each request's whole table
  (prefix blocks then its own). Target: cascade >= 5 x faster.

Each output is compared with its baseline's (``err``: max |difference|; the fp8 row with the
bf16 call on the dequantised cache).

* **splits** (only with ``--only splits``): decoding batches, ragged (48 x 8k-32k keys) and uniform
  (64 x 8k), with the split count forced to 1, 4, 8, 16 beside the rule's: the trade-off of the
  split rule for per-call lengths (docs/perf-notes.md).
* **prefix-launch**: the cascade's prefix call alone (64 packed rows x 32 heads over the 16k
  shared keys), from a contiguous cache and from 16- and 256-key pages; on Hopper also the
  cascade's own route there (the Gluon kernel's split partial states, merged by one launch).

    python benchmarks/serving.py [--quick] [--out DIR] [--dry-run] [--smoke]
                                 [--only mixed,fp8,prefix,prefix-launch,splits]
"""

from __future__ import annotations

import common

NHEADS, NHEADS_K, HDIM, BLOCK = 32, 8, 128, 16


def shapes(args) -> dict:
    if args.smoke:
        return dict(decode=3, spec=(2, 2), chunks=(2, 16), keys=(40, 90), fp8=(2, 200), prefix=(4, 64, 16))
    return dict(decode=48, spec=(8, 4), chunks=(2, 512), keys=(8192, 32768), fp8=(64, 32768), prefix=(64, 16384, 1024))


def pool_for(lengths, dev, dtype, gen, extra=1.125):
    """A NaN-free random pool and a permuted block table with room for ``lengths`` keys each."""
    import torch

    pages = [-(-n // BLOCK) for n in lengths]
    total = int(sum(pages) * extra) + 1
    k = torch.randn(total, BLOCK, NHEADS_K, HDIM, device=dev, generator=gen).to(dtype)
    v = torch.randn(total, BLOCK, NHEADS_K, HDIM, device=dev, generator=gen).to(dtype)
    perm = torch.randperm(total, device=dev, generator=gen).to(torch.int32)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32, device=dev)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used:used + p]
        used += p
    return k, v, table


class Rows:
    """Times callables eagerly and graph-replayed, checks outputs, collects CSV rows."""

    def __init__(self, args):
        self.args, self.rows = args, []

    def time(self, scenario, name, fn, expect=None, graph=True, extra=None):
        out, note = common.attempt(fn)
        ms, err_ms = None, note
        if out is not None:
            ms, err_ms = common.attempt(lambda: common.bench(fn, self.args.device, cpu_reps=1))
        diff = None
        if out is not None and expect is not None:
            diff = (out.float() - expect.float()).abs().max().item()
        self.rows.append(dict(scenario=scenario, impl=name, us=ms and ms * 1e3, err=diff, note=note or err_ms or "",
                              **(extra or {})))
        if graph and self.args.device.startswith("cuda") and out is not None:
            made, gnote = common.attempt(lambda: common.cuda_graph(fn))
            replay, captured = made if made is not None else (None, None)
            gms = None if replay is None else common.bench(replay, self.args.device)
            gdiff = None
            if captured is not None and expect is not None:
                gdiff = (captured.float() - expect.float()).abs().max().item()
            self.rows.append(dict(scenario=scenario, impl=f"{name}·graph", us=gms and gms * 1e3, err=gdiff,
                                  note=gnote, **(extra or {})))
        return out

    def us(self, scenario, impl):
        return next((r["us"] for r in self.rows if r["scenario"] == scenario and r["impl"] == impl), None)

    def add(self, scenario, impl, us, note=""):
        self.rows.append(dict(scenario=scenario, impl=impl, us=us, err=None, note=note))


def mixed(args, rows: Rows, dtype):
    """One call over a mixed batch vs the separate calls and the ideal."""
    import torch

    import tileattn

    s, dev = shapes(args), args.device
    gen = torch.Generator(device=dev).manual_seed(1)
    n_spec, spec_len = s["spec"]
    n_chunks, chunk = s["chunks"]
    lens_q = [1] * s["decode"] + [spec_len] * n_spec + [chunk] * n_chunks
    lo, hi = s["keys"]
    used = torch.randint(lo, hi + 1, (len(lens_q),), generator=torch.Generator().manual_seed(2)).tolist()
    k, v, table = pool_for(used, dev, dtype, gen)
    q = torch.randn(sum(lens_q), NHEADS, HDIM, device=dev, generator=gen).to(dtype)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    seqused = torch.tensor(used, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    nd, ns = s["decode"], n_spec

    def one_call():
        return tileattn.flash_attn_varlen_func(q, k, v, cu_q, None, max(lens_q), hi, seqused_k=seqused,
                                               block_table=table, causal=True, out=out)

    def part(first, count, length):
        rows_q = q[int(cu_q[first]):int(cu_q[first + count])].view(count, length, NHEADS, HDIM)
        return lambda: tileattn.flash_attn_with_kvcache(rows_q, k, v, cache_seqlens=seqused[first:first + count],
                                                        block_table=table[first:first + count], causal=True)

    calls = [("decode rows", part(0, nd, 1)), ("speculative rows", part(nd, ns, spec_len)),
             ("prefill chunks", part(nd + ns, n_chunks, chunk))]

    def separate():
        return [fn() for _, fn in calls]

    expect = torch.cat([o.flatten(0, 1) for o in separate()])
    flops = sum(common.attn_flops(1, NHEADS, chunk, n, HDIM) for n in used[nd + ns:])  # chunk rows ~ full rows
    rows.time("mixed", "one call", one_call, expect)
    rows.time("mixed", "separate calls", lambda: separate()[-1])
    for name, fn in calls:
        rows.time("mixed", name, fn, graph=True)
    small_bytes = 2 * sum(used[:nd + ns]) * NHEADS_K * HDIM * q.element_size()
    floor, note = common.attempt(lambda: common.read_floor(small_bytes, dev))
    prefill = rows.us("mixed", "prefill chunks·graph") or rows.us("mixed", "prefill chunks")
    rows.add("mixed", "read floor (decode+spec K/V)", floor and floor * 1e3, note)
    if floor is not None and prefill is not None:
        rows.add("mixed", "ideal (floor + prefill chunks)", floor * 1e3 + prefill,
                 f"prefill chunks {common.fmt(common.tflops(flops, prefill / 1e3))} TFLOP/s")


def fp8(args, rows: Rows, dtype):
    """Decoding from an FP8 paged cache vs bf16 paged and SDPA cuDNN (bf16, contiguous)."""
    import torch
    import torch.nn.functional as F

    import tileattn
    from tileattn.ops.fp8 import FP8_DTYPE, quantize

    dev = args.device
    batch, n = shapes(args)["fp8"]
    qdtype = torch.bfloat16  # an FP8 cache needs bf16/fp16 queries, on the CPU too
    gen = torch.Generator(device=dev).manual_seed(3)
    k, v, table = pool_for([n] * batch, dev, qdtype, gen, extra=1.0)
    q = torch.randn(batch, 1, NHEADS, HDIM, device=dev, generator=gen).to(qdtype)
    lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
    k_descale = torch.full((batch, NHEADS_K), 4.0 / 448, device=dev)  # randn stays within +-4 here
    v_descale = torch.full((batch, NHEADS_K), 4.0 / 448, device=dev)
    # every sequence reads its own blocks: quantise the pool per sequence (one scale per head here)
    k8 = quantize(k.flatten(0, 1)[None], k_descale[:1])[0].view(k.shape)
    v8 = quantize(v.flatten(0, 1)[None], v_descale[:1])[0].view(v.shape)
    assert k8.dtype == FP8_DTYPE
    k_deq = (k8.float() * k_descale[0, 0]).to(qdtype)
    v_deq = (v8.float() * v_descale[0, 0]).to(qdtype)

    def paged(kc, vc, **kw):
        return lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, **kw)

    expect = paged(k_deq, v_deq)()
    rows.time("fp8", "paged bf16", paged(k, v), graph=True)
    rows.time("fp8", "paged fp8", paged(k8, v8, k_descale=k_descale, v_descale=v_descale), expect)
    if dev.startswith("cuda"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        rows_k = k[table.long()].flatten(1, 2).transpose(1, 2)  # (B, Hk, N, D), contiguous copy
        rows_v = v[table.long()].flatten(1, 2).transpose(1, 2)
        qt = q.transpose(1, 2)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, rows_k, rows_v, enable_gqa=True).transpose(1, 2)

        rows.time("fp8", "sdpa cudnn bf16", cudnn, graph=False)
    for impl, nbytes in (("read floor bf16", 2 * batch * n * NHEADS_K * HDIM * 2),
                         ("read floor fp8", 2 * batch * n * NHEADS_K * HDIM)):
        floor, note = common.attempt(lambda: common.read_floor(nbytes, dev))
        rows.add("fp8", impl, floor and floor * 1e3, note)


def prefix(args, rows: Rows, dtype):
    """Cascade over a shared prefix vs the plain paged call over the whole caches."""
    import torch

    import tileattn

    dev = args.device
    batch, shared, own = shapes(args)["prefix"]
    gen = torch.Generator(device=dev).manual_seed(4)
    k, v, table = pool_for([shared] + [own] * batch, dev, dtype, gen)
    prefix_table, own_table = table[0, :shared // BLOCK], table[1:, :-(-own // BLOCK)]
    q = torch.randn(batch, 1, NHEADS, HDIM, device=dev, generator=gen).to(dtype)
    own_lens = torch.full((batch,), own, dtype=torch.int32, device=dev)
    whole = torch.cat([prefix_table.expand(batch, -1), own_table], 1)

    def plain():
        return tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=own_lens + shared, block_table=whole,
                                                causal=True)

    def cascade():
        return tileattn.cascade_attn_with_kvcache(q, k, v, prefix_table, shared, own_table, own_lens, causal=True)

    expect = plain()
    rows.time("prefix", "plain paged", plain)
    rows.time("prefix", "cascade", cascade, expect)


def prefix_launch(args, rows: Rows, dtype):
    """The cascade's prefix call alone: every request's query row packed as the rows of one
    sequence (GQA 32/8: 4 x batch rows per KV head) over the shared keys, not causal, from a
    contiguous cache and from pools of 16- and 256-key pages (a random page order); TFLOP/s in
    the note. What the paged prefill tile costs beside the contiguous one."""
    import torch

    import tileattn

    dev = args.device
    batch, shared, _ = shapes(args)["prefix"]
    gen = torch.Generator(device=dev).manual_seed(5)
    q = torch.randn(1, batch, NHEADS, HDIM, device=dev, generator=gen).to(dtype)
    k = torch.randn(1, shared, NHEADS_K, HDIM, device=dev, generator=gen).to(dtype)
    v = torch.randn(1, shared, NHEADS_K, HDIM, device=dev, generator=gen).to(dtype)
    lens = torch.full((1,), shared, dtype=torch.int32, device=dev)
    flops = common.attn_flops(1, NHEADS, batch, shared, HDIM)

    def timed(name, fn, expect=None):
        rows.time("prefix launch", name, fn, expect)
        for row in rows.rows:  # the rate in the note of this call's rows (eager and graph-replayed)
            if row["scenario"] == "prefix launch" and row["impl"] in (name, f"{name}·graph") and row["us"]:
                row["note"] = f"{common.fmt(common.tflops(flops, row['us'] / 1e3))} TFLOP/s"

    expect = tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    timed("contiguous", lambda: tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens))
    for page in (BLOCK, 256):
        pages = -(-shared // page)
        perm = torch.randperm(2 * pages, device=dev, generator=gen)[:pages]
        kp = torch.zeros(2 * pages, page, NHEADS_K, HDIM, device=dev, dtype=dtype)
        vp = torch.zeros_like(kp)
        padded = pages * page - shared
        kp[perm] = torch.nn.functional.pad(k[0], (0, 0, 0, 0, 0, padded)).view(pages, page, NHEADS_K, HDIM)
        vp[perm] = torch.nn.functional.pad(v[0], (0, 0, 0, 0, 0, padded)).view(pages, page, NHEADS_K, HDIM)
        table = perm.to(torch.int32)[None]
        timed(f"paged {page}", lambda: tileattn.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                                          block_table=table), expect)
        gluon = gluon_partials(q, kp, vp, lens, table)
        if gluon is not None:
            timed(f"gluon partials + merge, paged {page}", gluon, expect)


def gluon_partials(q, k_pool, v_pool, lens, table):
    """The cascade's prefix route on Hopper, alone: the Gluon kernel's split partial states over the
    pool, merged by one launch (the cascade merges them with the suffix's); None where the rule
    sends the call elsewhere."""
    import torch

    from tileattn.contract import AttnParams
    from tileattn.gpu import merge_parts, plan_partials
    from tileattn.gpu.hopper import HopperPartials

    if q.device.type != "cuda":
        return None
    params = AttnParams(q.shape[-1] ** -0.5)
    plan = plan_partials(q, k_pool, v_pool, params=params, max_seqlen_q=q.shape[1],
                         max_seqlen_k=table.shape[1] * k_pool.shape[1], seqused_k=lens, block_table=table, num_splits=0)
    if not isinstance(plan, HopperPartials):
        return None
    o_parts = torch.empty((plan.num_splits, *q.shape), device=q.device)
    lse_parts = torch.empty((plan.num_splits, 1, q.shape[2], q.shape[1]), device=q.device)
    out, lse = torch.empty_like(q), torch.empty((1, q.shape[2], q.shape[1]), device=q.device)

    def run():
        plan.run_partials(q, k_pool, v_pool, params, lens, table, o_parts, lse_parts)
        merge_parts(o_parts, lse_parts, out, lse)
        return out
    return run


def splits(args, rows: Rows, dtype):
    """The decoding split count (``num_splits``) forced against the rule's (0), on a ragged batch
    (48 sequences of 8k-32k keys, as the mixed batch's decoding rows) and on a uniform one (64 x
    8k), from 16-key pages: what the rule for per-call lengths (``RAGGED_WAVES``) gains on the
    first and costs on the second. The rule's count is in the note."""
    import torch

    import tileattn
    from tileattn.gpu import attention as A

    dev = args.device
    small = args.smoke
    cases = {"ragged": (3, 40, 90) if small else (48, 8192, 32768),
             "uniform": (4, 64, 64) if small else (64, 8192, 8192)}
    for kind, (batch, lo, hi) in cases.items():
        name = f"{kind} {batch} x {lo}-{hi} keys" if lo < hi else f"{kind} {batch} x {lo} keys"
        used = torch.randint(lo, hi + 1, (batch,), generator=torch.Generator().manual_seed(6)).tolist()
        gen = torch.Generator(device=dev).manual_seed(6)
        k, v, table = pool_for(used, dev, dtype, gen)
        q = torch.randn(batch, 1, NHEADS, HDIM, device=dev, generator=gen).to(dtype)
        lens = torch.tensor(used, dtype=torch.int32, device=dev)
        expect = None
        for count in (0, 1, 4, 8, 16):
            A.clear_plans()

            def call():
                return tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                                        num_splits=count)

            impl = f"{name}, splits {count or 'by the rule'}"
            out = rows.time("splits", impl, call, expect)
            chosen = [p.num_splits for p in A._PLANS.values()]  # the Triton backend's plans (none on the CPU)
            if count == 0:
                expect = out
                for row in rows.rows:
                    if row["impl"].startswith(impl) and chosen:
                        row["note"] = f"the rule's count: {chosen[0]}"
        nbytes = 2 * sum(used) * NHEADS_K * HDIM * q.element_size()
        floor, note = common.attempt(lambda: common.read_floor(nbytes, dev))
        rows.add("splits", f"{name}: read floor", floor and floor * 1e3, note)
        common.free_cuda()


SCENARIOS = {"mixed": mixed, "fp8": fp8, "prefix": prefix, "prefix-launch": prefix_launch, "splits": splits}


def summary(rows: Rows) -> None:
    def best(scenario, impl):
        got = [u for u in (rows.us(scenario, impl + "·graph"), rows.us(scenario, impl)) if u]
        return min(got) if got else None

    def ratio(a, b):
        return None if a is None or b is None else a / b

    checks = [
        ("mixed: one call / ideal",
         ratio(best("mixed", "one call"), rows.us("mixed", "ideal (floor + prefill chunks)")), "<= 1.1"),
        ("mixed: one call / separate calls", ratio(best("mixed", "one call"), best("mixed", "separate calls")), "< 1"),
        ("fp8: paged fp8 / cuDNN bf16", ratio(best("fp8", "paged fp8"), rows.us("fp8", "sdpa cudnn bf16")), "<= 0.55"),
        ("fp8: paged fp8 / paged bf16", ratio(best("fp8", "paged fp8"), best("fp8", "paged bf16")), "~0.5"),
        ("prefix: plain / cascade", ratio(best("prefix", "plain paged"), best("prefix", "cascade")), ">= 5"),
    ]
    common.print_table("Serving targets (best of eager and graph-replayed)", ["ratio", "value", "target"],
                       [[name, common.fmt(value, 3), target] for name, value, target in checks])


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--only", default="mixed,fp8,prefix,prefix-launch",
        help="comma-separated scenarios: mixed, fp8, prefix, prefix-launch, splits (not in the default run)"))
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    for s in chosen:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}: choose from {', '.join(SCENARIOS)}")
    if args.dry_run:
        print(shapes(args))
        return
    dtype, env = common.start_run(args.device)
    rows = Rows(args)
    for s in chosen:
        SCENARIOS[s](args, rows, dtype)
        common.write_csv(f"{args.out}/serving.csv", rows.rows, env, quiet=True)
        common.free_cuda()
    common.print_table("Serving: µs per call (err: max |out − baseline|)",
                       ["scenario", "impl", "µs", "err", "note"],
                       [[r["scenario"], r["impl"], common.fmt(r["us"]), common.fmt(r["err"], 4), r["note"][:70]]
                        for r in rows.rows])
    summary(rows)
    common.write_csv(f"{args.out}/serving.csv", rows.rows, env)


if __name__ == "__main__":
    main()
