"""A serving engine's attention calls: mixed batches over a paged cache in one call, FP8 caches.

Every fast path is compared with per-sequence float64 attention (``tileattn.reference``) under
the tolerance rule of tests/tolerance.py, on pools whose block tables are a random permutation
of a larger pool and whose unused slots are NaN.

FP8 budget: the kernels compute attention over the *dequantised* cache (stored e4m3 value x
descale, an exact product in float64), so they are held to the usual rule against the float64
reference on those values, with plain torch attention in q's dtype on the same values as the
budget. The quantisation itself (the append) is checked element-wise: a stored value
dequantised is within 2^-4 x |value| (half an e4m3 unit in the last place, 3 mantissa bits)
plus 2^-10 x descale (half the smallest e4m3 subnormal step) of the value written.
"""

import pytest
import torch

import tileattn
from tileattn import reference as R
from tileattn.contract import AttnParams
from tileattn.ops.fp8 import FP8_DTYPE, quantize
from graphs import captured
from tolerance import assert_within, plain_attention

FP8_REL, FP8_ABS = 2.0**-4, 2.0**-10  # the e4m3 rounding budget (relative; absolute x descale)


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def paged_pool(seqs, block, num_blocks, gen, dtype):
    """Scatter each sequence's (n, Hk, D) keys into a NaN pool through a permuted block table."""
    hk, d = seqs[0].shape[1:]
    pool = torch.full((num_blocks, block, hk, d), float("nan"), dtype=torch.float32)
    width = max(-(-x.shape[0] // block) for x in seqs)
    table = torch.zeros(len(seqs), max(width, 1), dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for b, x in enumerate(seqs):
        for page in range(-(-x.shape[0] // block)):
            table[b, page] = blk = free.pop()
            rows = x[page * block:(page + 1) * block]
            pool[blk, :rows.shape[0]] = rows
    return pool.to(dtype), table


def expected(q, keys, values, lens_q, opts, dtype):
    """Per-sequence dense attention: float64 reference and plain torch in ``dtype`` (the budget),
    each q row the last of its sequence's keys (bottom-right causal)."""
    offs = cu(lens_q).tolist()
    total, nheads, d = q.shape
    ref_o, plain_o = torch.zeros(total, nheads, d, dtype=torch.float64), torch.zeros(total, nheads, d, dtype=dtype)
    ref_l, plain_l = torch.full((nheads, total), float("-inf"), dtype=torch.float64), torch.full((nheads, total),
                                                                                               float("-inf"))
    for b, (s, e) in enumerate(zip(offs[:-1], offs[1:])):
        if e == s or keys[b].shape[0] == 0:
            continue
        o = {**opts, "alibi_slopes": None if opts.get("alibi_slopes") is None else opts["alibi_slopes"][b]}
        qb, kb, vb = q[None, s:e], keys[b][None], values[b][None]
        ro, rl = R.attention_naive(qb.double().numpy(), kb.double().numpy(), vb.double().numpy(), **o)
        po, pl = plain_attention(qb.to(dtype), kb.to(dtype), vb.to(dtype), **o)
        ref_o[s:e], ref_l[:, s:e] = torch.from_numpy(ro[0]), torch.from_numpy(rl[0])
        plain_o[s:e], plain_l[:, s:e] = po[0], pl[0]
    return ref_o, ref_l, plain_o, plain_l


# decode rows (1 new token), speculative rows (4), chunked-prefill rows, a zero-length row,
# and a row whose keys are all new (a first prefill chunk); with GQA 4 the chunk of 19 takes
# the prefill tile (19 x 4 rows > 64) and the other rows the decode tile: two launches
MIXED_Q = [1, 4, 0, 19, 1, 1, 6]
MIXED_K = [37, 21, 9, 50, 1, 64, 6]

OPTIONS = {
    "causal": dict(causal=True),
    "window softcap alibi": dict(causal=True, window_size=(11, 0), softcap=8.0, alibi=True),
    "noncausal": dict(causal=False),
    "sinks": dict(causal=True, sinks=True),
}


@pytest.mark.parametrize("name,num_splits", [("causal", None), ("causal", 1), ("causal", 3),
                                              ("window softcap alibi", None), ("window softcap alibi", 2),
                                              ("noncausal", None), ("sinks", 1), ("sinks", 3)])
def test_mixed_batch_in_one_call(device, name, num_splits):
    """flash_attn_varlen_func as vLLM calls it: cu_seqlens_k None, seqused_k, block_table, out=
    a strided view; each sequence equals its own dense attention."""
    gen = torch.Generator().manual_seed(191)
    dtype, nheads, nheads_k, d = torch.bfloat16, 4, 1, 32  # MQA, group 4
    opts = dict(OPTIONS[name])
    batch = len(MIXED_Q)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(batch, nheads, generator=gen) * 0.3
    sinks = torch.randn(nheads, generator=gen) if opts.pop("sinks", False) else None  # once per row, split or not
    q = torch.randn(sum(MIXED_Q), nheads, d, generator=gen).to(dtype)
    keys = [torch.randn(n, nheads_k, d, generator=gen).to(dtype) for n in MIXED_K]
    values = [torch.randn(n, nheads_k, d, generator=gen).to(dtype) for n in MIXED_K]
    kv_pool, table = paged_pool([torch.cat([k, v], -1) for k, v in zip(keys, values)], 8, 60, gen, dtype)
    k_pool, v_pool = kv_pool[..., :d], kv_pool[..., d:]  # strided pools: views of one allocation
    big = torch.full((sum(MIXED_Q), nheads, 2 * d), float("nan"), dtype=dtype, device=device)
    out = big[..., ::2]  # a non-contiguous view: written in place
    used = torch.tensor(MIXED_K, dtype=torch.int32)
    slopes = opts.pop("alibi_slopes", None)
    res, lse = tileattn.flash_attn_varlen_func(
        q.to(device), k_pool.to(device), v_pool.to(device), cu(MIXED_Q).to(device), None, max(MIXED_Q),
        max(MIXED_K), seqused_k=used.to(device), block_table=table.to(device), out=out,
        alibi_slopes=None if slopes is None else slopes.to(device), num_splits=num_splits,
        learnable_sink=None if sinks is None else sinks.to(device), return_softmax_lse=True, **opts)
    assert res is out and out.data_ptr() == big.data_ptr()
    assert torch.isnan(big[..., 1::2]).all(), "out= wrote outside its view"
    ref_o, ref_l, plain_o, plain_l = expected(q, keys, values, MIXED_Q,
                                              {**opts, "alibi_slopes": slopes, "learnable_sink": sinks}, dtype)
    assert_within("out", out.cpu(), plain_o, ref_o)
    assert_within("lse", lse.cpu(), plain_l, ref_l)


def test_mixed_batch_is_two_launches_and_splits_only_the_short_rows():
    """The plan of a mixed call: the decode tile for the short sequences (split, combined with
    the long sequences' rows skipped) and a plan of its own for the long ones, never split."""
    from tileattn.gpu import attention as A

    A.clear_plans()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(203)
    q = torch.randn(sum(MIXED_Q), 4, 16, generator=gen).to(dev)
    pool = torch.randn(60, 8, 1, 16, generator=gen).to(dev)
    table = torch.randperm(60, generator=gen)[:7 * 8].view(7, 8).to(torch.int32).to(dev)
    used = torch.tensor(MIXED_K, dtype=torch.int32, device=dev)
    lse = torch.empty(4, sum(MIXED_Q), device=dev)
    out = torch.empty_like(q)
    A.attn_fwd(q, pool, pool, out, lse, params=AttnParams(0.25, -1, 0), cu_seqlens_q=cu(MIXED_Q).to(dev),
               max_seqlen_q=max(MIXED_Q), max_seqlen_k=64, seqused_k=used, block_table=table, num_splits=3)
    (plan,) = A._PLANS.values()
    assert plan.num_splits == 3 and plan.marked and plan.flags["PACK_GQA"] and plan.combine is not None
    assert plan.long is not None and plan.long.num_splits == 1 and plan.long.combine is None
    assert plan.long.long is None and not plan.long.flags["SPLIT_KV"]


def test_mixed_batch_prefill_tile(device):
    """Chunks long enough (x GQA group) for the prefill tile path, with GQA group 4."""
    gen = torch.Generator().manual_seed(192)
    dtype, nheads, nheads_k, d = torch.float16, 8, 2, 40
    lens_q, lens_k = [1, 20, 3, 0], [45, 33, 3, 10]
    q = torch.randn(sum(lens_q), nheads, d, generator=gen).to(dtype)
    keys = [torch.randn(n, nheads_k, d, generator=gen).to(dtype) for n in lens_k]
    values = [torch.randn(n, nheads_k, d, generator=gen).to(dtype) for n in lens_k]
    kv_pool, table = paged_pool([torch.cat([k, v], -1) for k, v in zip(keys, values)], 16, 12, gen, dtype)
    k_pool, v_pool = kv_pool[..., :d].contiguous(), kv_pool[..., d:].contiguous()
    out = tileattn.flash_attn_varlen_func(q.to(device), k_pool.to(device), v_pool.to(device), cu(lens_q).to(device),
                                          None, max(lens_q), max(lens_k), causal=True, block_table=table.to(device),
                                          seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=device))
    ref_o, _, plain_o, _ = expected(q, keys, values, lens_q, dict(causal=True), dtype)
    assert_within("out", out.cpu(), plain_o, ref_o)


def test_seqused_k_limits_packed_keys(device):
    """Packed (not paged) keys with seqused_k: sequence b reads only its first seqused_k[b] keys."""
    gen = torch.Generator().manual_seed(193)
    lens_q, lens_k, used = [2, 3, 1], [9, 5, 7], [4, 5, 0]
    q = torch.randn(sum(lens_q), 4, 16, generator=gen)
    k, v = torch.randn(sum(lens_k), 2, 16, generator=gen), torch.randn(sum(lens_k), 2, 16, generator=gen)
    ck = cu(lens_k)
    out = tileattn.flash_attn_varlen_func(q.to(device), k.to(device), v.to(device), cu(lens_q).to(device),
                                          ck.to(device), 3, 9, causal=True,
                                          seqused_k=torch.tensor(used, dtype=torch.int32, device=device))
    keys = [k[ck[b]:ck[b] + used[b]] for b in range(3)]
    values = [v[ck[b]:ck[b] + used[b]] for b in range(3)]
    ref_o, _, _, _ = expected(q, keys, values, lens_q, dict(causal=True), torch.float32)
    torch.testing.assert_close(out.cpu().double(), ref_o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "seqused_k": None}, ValueError, "cu_seqlens_k"),
    (lambda a: {**a, "seqused_k": a["seqused_k"].long()}, TypeError, "seqused_k"),
    (lambda a: {**a, "seqused_k": torch.tensor([3, 99], dtype=torch.int32)}, IndexError, "seqused_k"),
    (lambda a: {**a, "seqused_k": torch.tensor([-1, 7], dtype=torch.int32)}, IndexError,
     r"seqused_k must be >= 0, found -1\.\.7"),
    (lambda a: {**a, "out": torch.empty(5, 4, 8)}, ValueError, "out must"),
    (lambda a: {**a, "out": torch.empty(4, 4, 16, dtype=torch.float64)}, ValueError, "out must"),
    (lambda a: {**a, "num_splits": -1}, ValueError, "num_splits"),
    (lambda a: {**a, "k_descale": torch.ones(2, 2)}, ValueError, "float8"),
])
def test_mixed_batch_bad_input_raises(change, error, words):
    args = dict(q=torch.randn(4, 4, 16), k=torch.randn(6, 4, 2, 16), v=torch.randn(6, 4, 2, 16),
                cu_seqlens_q=cu([1, 3]), cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=8,
                seqused_k=torch.tensor([3, 7], dtype=torch.int32), block_table=torch.tensor([[0, 1], [2, 3]],
                                                                                           dtype=torch.int32))
    with pytest.raises(error, match=words):
        tileattn.flash_attn_varlen_func(**change(args))


# ---------------------------------------------------------------------------- FP8 caches


def fp8_cache(batch, n, nheads_k, d, gen):
    """Real keys, their descales (batch, nheads_k) and the e4m3 values stored for them."""
    real = torch.randn(batch, n, nheads_k, d, generator=gen)
    descale = real.abs().amax(dim=(1, 3)) / 448 * (1 + torch.rand(batch, nheads_k, generator=gen))  # no saturation
    return real, descale, quantize(real, descale)


def test_quantize_rounds_to_nearest_and_saturates():
    descale = torch.tensor([[0.5, 2.0]])
    x = torch.tensor([1e4, -1e4, 1.0, 0.3, float("nan")]).view(1, 5, 1, 1).expand(1, 5, 2, 1)
    got = quantize(x, descale).float()[0, :, :, 0]  # stored values: x / descale, rounded
    want = torch.tensor([[448.0, 448.0], [-448.0, -448.0], [2.0, 0.5], [0.625, 0.15625], [float("nan")] * 2])
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("rotary", [False, True])
def test_fp8_append_kernel_stores_what_quantize_gives(rotary):
    """The append kernel's own rounding (to nearest, ties to even, subnormals, saturation) gives
    quantize's bytes exactly, rotated keys included; values on e4m3's grid, halfway between two
    of its points, below 2^-6 and past 448 among them."""
    from tileattn import gpu

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(202)
    batch, new, hk, d = 2, 3, 2, 16
    descale = torch.tensor([[0.5, 2.0], [0.01, 1.0]])
    grid = torch.tensor([1.0, 1.0625, 1.1875, 3.25, 2.0**-7 * 3, 2.0**-10, 2.0**-10 * 3, 450.0, 470.0, 500.0, 0.0,
                         -1.0625, -2.0**-10 * 5, -464.0, 17.0, 0.3])  # x / descale; ties between e4m3 neighbours
    signs = torch.randn(batch, new, hk, d, generator=gen).sign()
    k = (grid * descale[:, None, :, None] * signs).to(torch.bfloat16)  # exact where the descale is a power of 2
    v = torch.randn(batch, new, hk, d, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    caches = [torch.full((batch, 12, hk, d), float("nan")).to(FP8_DTYPE) for _ in range(2)]
    cos = sin = None
    if rotary:
        angles = torch.rand(12, 4, generator=gen) * 6
        cos, sin = angles.cos().to(dev), angles.sin().to(dev)
    k_cache, v_cache = (c.to(dev) for c in caches)
    gpu.append_kv(k_cache, v_cache, k.to(dev), v.to(dev), lens.to(dev), rotary_cos=cos, rotary_sin=sin,
                  k_descale=descale.to(dev), v_descale=descale.to(dev))
    if rotary:  # the keys the kernel rotates before quantising: those it writes to a bf16 cache
        plain = torch.zeros(batch, 12, hk, d, dtype=torch.bfloat16, device=dev)
        gpu.append_kv(plain, plain.clone(), k.to(dev), v.to(dev), lens.to(dev), rotary_cos=cos, rotary_sin=sin)
        k = torch.stack([plain.cpu()[b, int(lens[b]):int(lens[b]) + new] for b in range(batch)])
    for b in range(batch):
        n = int(lens[b])
        got_k, got_v = k_cache.cpu()[b:b + 1, n:n + new], v_cache.cpu()[b:b + 1, n:n + new]
        assert torch.equal(got_k.view(torch.uint8), quantize(k[b:b + 1], descale[b:b + 1]).view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), quantize(v[b:b + 1], descale[b:b + 1]).view(torch.uint8))
        assert torch.isnan(k_cache.cpu()[b, n + new:].float()).all(), "wrote past the new tokens"


@pytest.mark.gpu
def test_fp8_append_kernel_keeps_nan():
    """A NaN key is stored as e4m3's NaN, as quantize stores it, not saturated to +-448 (GPU only:
    the interpreter's fp8 conversion has no NaN)."""
    from tileattn import gpu

    k = torch.randn(1, 2, 1, 16, device="cuda").to(torch.bfloat16)
    k[0, 1, 0, 3] = float("nan")
    k_cache, v_cache = (torch.zeros(1, 4, 1, 16, device="cuda").to(FP8_DTYPE) for _ in range(2))
    descale = torch.full((1, 1), 0.01, device="cuda")
    gpu.append_kv(k_cache, v_cache, k, k, torch.zeros(1, dtype=torch.int32, device="cuda"), k_descale=descale,
                  v_descale=descale)
    stored = k_cache[0, :2].float()
    assert torch.isnan(stored[1, 0, 3]) and torch.isnan(stored).sum() == 1
    assert torch.isnan(quantize(k, descale).float()[0, 1, 0, 3])


def dequantised(stored, descale):
    return stored.double() * descale.double()[:, None, :, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache_decoding(device, paged, dtype):
    """Decoding and speculative rows over an FP8 cache equal attention over the dequantised cache;
    the append quantises new keys within the e4m3 budget."""
    gen = torch.Generator().manual_seed(194)
    batch, cap, nheads, nheads_k, d, sq = 3, 48, 8, 2, 64, 2
    lens = torch.tensor([1, 29, 46], dtype=torch.int32)
    q = torch.randn(batch, sq, nheads, d, generator=gen).to(dtype)
    k_real, k_descale, k_stored = fp8_cache(batch, cap, nheads_k, d, gen)
    v_real, v_descale, v_stored = fp8_cache(batch, cap, nheads_k, d, gen)
    k_new, v_new = k_real[:, :sq].to(dtype), v_real[:, :sq].to(dtype)
    if paged:
        table = torch.randperm(20, generator=gen)[:batch * 3].view(batch, 3).to(torch.int32)
        k_cache = torch.full((20, 16, nheads_k, d), float("nan")).to(FP8_DTYPE)
        v_cache = k_cache.clone()
        for b in range(batch):
            for p in range(3):
                k_cache[table[b, p]] = k_stored[b, p * 16:(p + 1) * 16]
                v_cache[table[b, p]] = v_stored[b, p * 16:(p + 1) * 16]
    else:
        table, k_cache, v_cache = None, k_stored.clone(), v_stored.clone()
    for b in range(batch):  # slots past the appended tokens are NaN: never read
        end = int(lens[b]) + sq
        if paged:
            for p in range(end, cap):
                k_cache[table[b, p // 16], p % 16] = float("nan")
        else:
            k_cache[b, end:] = float("nan")
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    out, lse = tileattn.flash_attn_with_kvcache(
        q.to(device), k_cache, v_cache, k=k_new.to(device), v=v_new.to(device), cache_seqlens=lens.to(device),
        block_table=None if table is None else table.to(device), causal=True, return_softmax_lse=True,
        k_descale=k_descale.to(device), v_descale=v_descale.to(device))
    for b in range(batch):
        n = int(lens[b]) + sq
        if paged:
            rows = [table[b, p // 16] * 16 + p % 16 for p in range(n)]
            k_b = k_cache.cpu().flatten(0, 1)[torch.stack(rows)][None]
            v_b = v_cache.cpu().flatten(0, 1)[torch.stack(rows)][None]
        else:
            k_b, v_b = k_cache.cpu()[b:b + 1, :n], v_cache.cpu()[b:b + 1, :n]
        # the append: the new tokens were quantised (round to nearest, saturating) with the descales
        for new, stored, descale in ((k_new, k_b, k_descale), (v_new, v_b, v_descale)):
            written = dequantised(stored[:, -sq:], descale[b:b + 1])
            real = new[b:b + 1].double()
            assert ((written - real).abs() <= FP8_REL * real.abs() + FP8_ABS * float(descale[b].max())).all()
            assert torch.equal(stored[:, -sq:].view(torch.uint8), quantize(new[b:b + 1], descale[b:b + 1]).view(
                torch.uint8))
        k_deq, v_deq = dequantised(k_b, k_descale[b:b + 1]), dequantised(v_b, v_descale[b:b + 1])
        ref_o, ref_lse = R.attention_naive(q[b:b + 1].double().numpy(), k_deq.numpy(), v_deq.numpy(), causal=True)
        plain_o, plain_lse = plain_attention(q[b:b + 1], k_deq.to(dtype), v_deq.to(dtype), causal=True)
        assert_within(f"out[{b}]", out[b:b + 1].cpu(), plain_o, ref_o)
        assert_within(f"lse[{b}]", lse[b:b + 1].cpu(), plain_lse, ref_lse)


@pytest.mark.parametrize("q_size", [4e4, 1e-6])
def test_fp8_cache_decoding_any_q_magnitude(device, q_size):
    """Over an FP8 cache the kernel multiplies in fp16: q (bf16) is scaled by a power of two into
    fp16's range first. Entries of 4e4 (past fp16's 65504 once multiplied out, and 6 bits of
    exponent above fp16's usual scores) and of 1e-6 (fp16 subnormals unscaled) give the
    dequantised cache's attention; softmax_scale keeps the scores O(1)."""
    gen = torch.Generator().manual_seed(196)
    batch, cap, nheads, nheads_k, d = 2, 40, 8, 2, 64
    lens = torch.tensor([7, 40], dtype=torch.int32)
    q = (torch.randn(batch, 1, nheads, d, generator=gen) * q_size).to(torch.bfloat16)
    q[0, 0, 0, :3] = torch.tensor([2 * q_size, -3 * q_size, 0.0])  # the largest entries, and an exact zero
    k_real, k_descale, k_stored = fp8_cache(batch, cap, nheads_k, d, gen)
    v_real, v_descale, v_stored = fp8_cache(batch, cap, nheads_k, d, gen)
    scale = d**-0.5 / q_size
    out, lse = tileattn.flash_attn_with_kvcache(
        q.to(device), k_stored.to(device), v_stored.to(device), cache_seqlens=lens.to(device), softmax_scale=scale,
        return_softmax_lse=True, k_descale=k_descale.to(device), v_descale=v_descale.to(device))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for b in range(batch):
        n = int(lens[b])
        k_deq, v_deq = dequantised(k_stored[b:b + 1, :n], k_descale[b:b + 1]), dequantised(v_stored[b:b + 1, :n],
                                                                                          v_descale[b:b + 1])
        ref_o, ref_lse = R.attention_naive(q[b:b + 1].double().numpy(), k_deq.numpy(), v_deq.numpy(),
                                           softmax_scale=scale)
        plain_o, plain_lse = plain_attention(q[b:b + 1], k_deq.to(torch.bfloat16), v_deq.to(torch.bfloat16),
                                             softmax_scale=scale)
        assert_within(f"out[{b}]", out[b:b + 1].cpu(), plain_o, ref_o)
        assert_within(f"lse[{b}]", lse[b:b + 1].cpu(), plain_lse, ref_lse)


def test_fp8_mixed_batch_and_paged_helper(device):
    """PagedKVCache in FP8: packed prompts written (quantised) per sequence, then one mixed call."""
    gen = torch.Generator().manual_seed(195)
    nheads, nheads_k, d, dtype = 4, 2, 32, torch.bfloat16
    cache = tileattn.PagedKVCache(1, 16, 8, nheads_k, d, dtype=FP8_DTYPE, device=device)
    prompts = [13, 1, 30]
    ids = [cache.allocate() for _ in prompts]
    cache.reserve(ids, max(prompts))
    k = torch.randn(sum(prompts), nheads_k, d, generator=gen).to(dtype)
    v = torch.randn(sum(prompts), nheads_k, d, generator=gen).to(dtype)
    k_descale = 0.01 + 0.02 * torch.rand(3, nheads_k, generator=gen)  # |k / descale| < 448 for these draws
    v_descale = 0.01 + 0.02 * torch.rand(3, nheads_k, generator=gen)
    cache.write_packed(0, ids, k.to(device), v.to(device), cu(prompts), k_descale=k_descale.to(device),
                       v_descale=v_descale.to(device))
    for i, n in zip(ids, prompts):
        cache.advance([i], n)
    lens_q = [2, 1, 5]
    q = torch.randn(sum(lens_q), nheads, d, generator=gen).to(dtype)
    out = tileattn.flash_attn_varlen_func(
        q.to(device), cache.k_cache[0], cache.v_cache[0], cu(lens_q).to(device), None, 5, 30, causal=True,
        seqused_k=cache.seqlens(ids), block_table=cache.block_table(ids), k_descale=k_descale.to(device),
        v_descale=v_descale.to(device))
    offs = cu(prompts).tolist()
    keys, values = [], []
    for b, i in enumerate(ids):
        table = cache.block_table([i]).cpu()[0].long()
        n = prompts[b]
        rows = table[torch.arange(n) // 8] * 8 + torch.arange(n) % 8
        keys.append(dequantised(cache.k_cache[0].cpu().flatten(0, 1)[rows][None], k_descale[b:b + 1])[0])
        values.append(dequantised(cache.v_cache[0].cpu().flatten(0, 1)[rows][None], v_descale[b:b + 1])[0])
        real = k[offs[b]:offs[b + 1]].double()
        assert ((keys[-1] - real).abs() <= FP8_REL * real.abs() + FP8_ABS * float(k_descale[b].max())).all()
    ref_o, _, plain_o, _ = expected(q, keys, values, lens_q, dict(causal=True), dtype)
    assert_within("out", out.cpu(), plain_o, ref_o)


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "k_descale": None}, ValueError, "needs k_descale"),
    (lambda a: {**a, "v_descale": torch.ones(2, 2, dtype=torch.float64)}, TypeError, "float32"),
    (lambda a: {**a, "k_descale": torch.ones(2, 4)}, ValueError, "shape"),
    (lambda a: {**a, "q": a["q"].float()}, TypeError, "float16 or bfloat16"),
    (lambda a: {**a, "v_cache": a["v_cache"].to(torch.bfloat16)}, TypeError, "float8_e4m3fn"),
    (lambda a: {**a, "k": torch.randn(2, 1, 2, 16).to(FP8_DTYPE), "v": torch.randn(2, 1, 2, 16).to(FP8_DTYPE)},
     TypeError, "new k"),
])
def test_fp8_bad_input_raises(change, error, words):
    args = dict(q=torch.randn(2, 1, 4, 16).to(torch.bfloat16), k_cache=torch.zeros(2, 8, 2, 16).to(FP8_DTYPE),
                v_cache=torch.zeros(2, 8, 2, 16).to(FP8_DTYPE), cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
                k_descale=torch.ones(2, 2), v_descale=torch.ones(2, 2))
    with pytest.raises(error, match=words):
        tileattn.flash_attn_with_kvcache(**change(args))


@pytest.mark.parametrize("d,dv", [(64, 32), (576, 512)])
def test_fp8_latent_cache_shares_the_key_descale(device, d, dv):
    """MLA's one latent cache in FP8: v_cache is k_cache[..., :dv], so the values are the keys'
    stored bytes at k_descale's scale. With v_descale=k_descale the output equals attention over
    the dequantised latent; a separate v_descale tensor is refused before anything runs (it
    would read every value at another scale). At 576/512 (the absorbed latent) the Triton path
    takes its wide tile: q/k's 512 + a tail of 64, the key tile serving as the value tile. q's
    largest entries (4e4) sit in its last columns, the tail at 576: the power of two that puts q
    into fp16's range must count them."""
    gen = torch.Generator().manual_seed(77 + d)
    batch, n, nheads = 2, 40, 4
    real, descale, stored = fp8_cache(batch, n, 1, d, gen)
    k_cache = stored.to(device)
    v_cache = k_cache[..., :dv]
    q = torch.randn(batch, 1, nheads, d, generator=gen).to(torch.bfloat16)
    q[:, 0, 1, -3:] = torch.tensor([3e4, -4e4, 0.0])
    lens = torch.tensor([n, 17], dtype=torch.int32)
    args = dict(cache_seqlens=lens.to(device), k_descale=descale.to(device), softmax_scale=d**-0.5 / 4e4)
    with pytest.raises(ValueError, match="shares k_cache's storage"):
        tileattn.flash_attn_with_kvcache(q.to(device), k_cache, v_cache, v_descale=descale.clone().to(device), **args)
    out = tileattn.flash_attn_with_kvcache(q.to(device), k_cache, v_cache, v_descale=args["k_descale"], **args).cpu()
    latent = dequantised(stored, descale)  # float64 (batch, n, 1, d)
    for b in range(batch):
        keys = latent[b:b + 1, :int(lens[b])]
        ref_o, _ = R.attention_naive(q[b:b + 1].double().numpy(), keys.numpy(), keys[..., :dv].numpy(),
                                     softmax_scale=args["softmax_scale"])
        plain_o, _ = plain_attention(q[b:b + 1], keys.to(torch.bfloat16), keys[..., :dv].to(torch.bfloat16),
                                     softmax_scale=args["softmax_scale"])
        assert_within(f"seq {b} out", out[b:b + 1], plain_o, ref_o)


# ----------------------------------------------------------------------- CUDA graphs (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 4])
def test_mixed_batch_at_serving_shapes(num_splits):
    """GQA 32/8, hdim 128, blocks of 16: decode, speculative and prefill-chunk rows (two launches,
    split or not) against float64 attention per sequence; the lengths up to 9k keys, so the
    automatic count splits the short rows (``RAGGED_WAVES``)."""
    from tileattn.gpu import attention as A

    gen = torch.Generator().manual_seed(200)
    dtype, nheads, nheads_k, d = torch.bfloat16, 32, 8, 128
    lens_q, lens_k = [1, 1, 4, 300, 0, 1, 4, 77], [1500, 2, 9000, 1200, 64, 5047, 4, 77]
    q = torch.randn(sum(lens_q), nheads, d, generator=gen).to(dtype)
    keys = [torch.randn(n, nheads_k, d, generator=gen).to(dtype) for n in lens_k]
    values = [torch.randn(n, nheads_k, d, generator=gen).to(dtype) for n in lens_k]
    kv_pool, table = paged_pool([torch.cat([k, v], -1) for k, v in zip(keys, values)], 16, 1300, gen, dtype)
    k_pool, v_pool = kv_pool[..., :d].cuda(), kv_pool[..., d:].cuda()
    A.clear_plans()
    out = tileattn.flash_attn_varlen_func(q.cuda(), k_pool, v_pool, cu(lens_q).cuda(), None, max(lens_q),
                                          max(lens_k), seqused_k=torch.tensor(lens_k, dtype=torch.int32).cuda(),
                                          block_table=table.cuda(), causal=True, num_splits=num_splits)
    (plan,) = A._PLANS.values()
    assert plan.num_splits == (num_splits or plan.num_splits) > 1 and plan.long.num_splits == 1
    ref_o, _, plain_o, _ = expected(q, keys, values, lens_q, dict(causal=True), dtype)
    assert_within("out", out.cpu(), plain_o, ref_o)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_mixed_batch_replays_from_a_cuda_graph(fp8):
    """Fixed buffer sizes, varying contents: capture the one-call mixed batch, replay it after the
    lengths, queries and block table changed, and compare with an eager call on the new contents."""
    gen = torch.Generator(device="cuda").manual_seed(196)
    dev, dtype = "cuda", torch.bfloat16
    lens_q = [1] * 24 + [4] * 4 + [200, 0]
    batch, nheads, nheads_k, d, block = len(lens_q), 32, 8, 128, 16
    pool_dtype = FP8_DTYPE if fp8 else dtype
    k_pool = torch.randn(1024, block, nheads_k, d, device=dev, generator=gen).to(pool_dtype)
    v_pool = torch.randn(1024, block, nheads_k, d, device=dev, generator=gen).to(pool_dtype)
    descales = dict(k_descale=torch.rand(batch, nheads_k, device=dev, generator=gen),
                    v_descale=torch.rand(batch, nheads_k, device=dev, generator=gen)) if fp8 else {}
    q = torch.randn(sum(lens_q), nheads, d, device=dev, dtype=dtype, generator=gen)
    cq = cu(lens_q).to(dev)
    used = torch.randint(200, 480, (batch,), device=dev, dtype=torch.int32, generator=gen)
    table = torch.randperm(1024, device=dev, generator=gen)[:batch * 32].view(batch, 32).to(torch.int32)
    out = torch.empty_like(q)

    def step():
        return tileattn.flash_attn_varlen_func(q, k_pool, v_pool, cq, None, max(lens_q), 512, seqused_k=used,
                                               block_table=table, causal=True, out=out, **descales)

    graph, _, _ = captured(step)
    for _ in range(2):  # new contents in the same buffers
        q.copy_(torch.randn(q.shape, device=dev, generator=gen))
        used.copy_(torch.randint(1, 512, (batch,), device=dev, dtype=torch.int32, generator=gen).clamp_min(200))
        table.copy_(torch.randperm(1024, device=dev, generator=gen)[:batch * 32].view(batch, 32))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager = tileattn.flash_attn_varlen_func(q, k_pool, v_pool, cq, None, max(lens_q), 512, seqused_k=used,
                                                block_table=table, causal=True, **descales)
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
