"""Shared-prefix (cascade) attention: equal to the plain call over each request's whole cache."""

import pytest
import torch

import tileattn
from tileattn import reference as R
from tileattn.ops.fp8 import quantize
from graphs import captured
from tolerance import assert_within, plain_attention


def pool_with(prefix, suffixes, block, num_blocks, gen):
    """A NaN pool holding the prefix's blocks once and each suffix's blocks, randomly placed.

    Returns (pool, prefix_table (prefix_blocks,), table (batch, max_blocks))."""
    hk, d = prefix.shape[1:]
    pool = torch.full((num_blocks, block, hk, d), float("nan"), dtype=prefix.dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()

    def place(x, width):
        row = torch.zeros(max(width, 1), dtype=torch.int32)
        for page in range(-(-x.shape[0] // block)):
            row[page] = blk = free.pop()
            chunk = x[page * block:(page + 1) * block]
            pool[blk, :chunk.shape[0]] = chunk
        return row

    width = max(-(-s.shape[0] // block) for s in suffixes)
    return pool, place(prefix, -(-prefix.shape[0] // block)), torch.stack([place(s, width) for s in suffixes])


CASES = {
    "decode GQA": dict(prefix=21, suffix=[1, 9, 16, 4], seqlen_q=1, nheads=(8, 2), causal=True, softcap=0.0),
    "speculative softcap": dict(prefix=40, suffix=[4, 12, 7], seqlen_q=4, nheads=(4, 4), causal=True, softcap=5.0),
    "noncausal empty prefix": dict(prefix=0, suffix=[3, 0, 5], seqlen_q=2, nheads=(4, 1), causal=False, softcap=0.0),
}


@pytest.mark.parametrize("num_splits", [0, 3], ids=["auto-splits", "3-splits"])
@pytest.mark.parametrize("name", list(CASES))
def test_cascade_equals_attention_over_the_whole_cache(device, name, num_splits):
    """3 splits: the prefix's split partial states go to the final merge unmerged (Triton path)."""
    c = CASES[name]
    gen = torch.Generator().manual_seed(197)
    dtype, d, block = torch.bfloat16, 32, 8
    nheads, nheads_k = c["nheads"]
    batch, sq = len(c["suffix"]), c["seqlen_q"]
    prefix_k = torch.randn(c["prefix"], nheads_k, d, generator=gen).to(dtype)
    prefix_v = torch.randn(c["prefix"], nheads_k, d, generator=gen).to(dtype)
    suf_k = [torch.randn(n, nheads_k, d, generator=gen).to(dtype) for n in c["suffix"]]
    suf_v = [torch.randn(n, nheads_k, d, generator=gen).to(dtype) for n in c["suffix"]]
    q = torch.randn(batch, sq, nheads, d, generator=gen).to(dtype)
    # the last sq suffix keys of each request are appended by the call (k=, v=) when there are that many
    append = c["causal"]
    new_k = torch.stack([s[-sq:] for s in suf_k]) if append else None
    new_v = torch.stack([s[-sq:] for s in suf_v]) if append else None
    stored_k = [s[:-sq] if append else s for s in suf_k]
    kv, prefix_table, table = pool_with(torch.cat([prefix_k, prefix_v], -1),
                                        [torch.cat([a, b], -1) for a, b in zip(suf_k, suf_v)], block, 64, gen)
    k_pool, v_pool = kv[..., :d].contiguous(), kv[..., d:].contiguous()
    if append:  # the slots of the appended tokens hold NaN before the call
        for b, n in enumerate(c["suffix"]):
            for p in range(n - sq, n):
                k_pool[table[b, p // block], p % block] = float("nan")
                v_pool[table[b, p // block], p % block] = float("nan")
    lens = torch.tensor([s.shape[0] for s in stored_k], dtype=torch.int32)
    out, lse = tileattn.cascade_attn_with_kvcache(
        q.to(device), k_pool.to(device), v_pool.to(device), prefix_table.to(device),
        torch.tensor([c["prefix"]], dtype=torch.int32, device=device), table.to(device), lens.to(device),
        k=None if new_k is None else new_k.to(device), v=None if new_v is None else new_v.to(device),
        causal=c["causal"], softcap=c["softcap"], return_softmax_lse=True, num_splits=num_splits)
    for b in range(batch):
        keys, values = torch.cat([prefix_k, suf_k[b]])[None], torch.cat([prefix_v, suf_v[b]])[None]
        opts = dict(causal=c["causal"], softcap=c["softcap"])
        ref_o, ref_lse = R.attention_naive(q[b:b + 1].double().numpy(), keys.double().numpy(),
                                           values.double().numpy(), **opts)
        plain_o, plain_lse = plain_attention(q[b:b + 1], keys, values, **opts)
        assert_within(f"out[{b}]", out[b:b + 1].cpu(), plain_o, ref_o)
        assert_within(f"lse[{b}]", lse[b:b + 1].cpu(), plain_lse, ref_lse)


def test_cascade_equals_the_plain_paged_call(device):
    """A prefix of whole blocks: the plain call reads it through each request's table (prefix blocks,
    then its own); cascade gives the same output."""
    gen = torch.Generator().manual_seed(198)
    dtype, d, block, batch = torch.float16, 64, 16, 5
    prefix = torch.randn(48, 2, 2 * d, generator=gen).to(dtype)
    suffixes = [torch.randn(n, 2, 2 * d, generator=gen).to(dtype) for n in (1, 17, 30, 2, 9)]
    kv, prefix_table, table = pool_with(prefix, suffixes, block, 40, gen)
    k_pool, v_pool = (x.contiguous().to(device) for x in (kv[..., :d], kv[..., d:]))
    q = torch.randn(batch, 1, 8, d, generator=gen).to(dtype).to(device)
    lens = torch.tensor([s.shape[0] for s in suffixes], dtype=torch.int32)
    out = tileattn.cascade_attn_with_kvcache(q, k_pool, v_pool, prefix_table.to(device), 48, table.to(device),
                                             lens.to(device), causal=True)
    whole = torch.cat([prefix_table.expand(batch, -1), table], 1)
    plain = tileattn.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=(lens + 48).to(device),
                                             block_table=whole.to(device), causal=True)
    torch.testing.assert_close(out, plain, rtol=2e-3, atol=2e-3)


def test_cascade_over_an_fp8_pool(device):
    """An FP8 pool: prefix descales (1, Hk) and per-request descales (batch, Hk); the appended token is
    quantised; the result equals attention over the dequantised keys and values."""
    gen = torch.Generator().manual_seed(201)
    dtype, d, block, batch, hk = torch.bfloat16, 32, 8, 3, 2
    prefix = torch.randn(19, hk, 2 * d, generator=gen)
    suffixes = [torch.randn(n, hk, 2 * d, generator=gen) for n in (1, 10, 4)]
    kv, prefix_table, table = pool_with(prefix, suffixes, block, 20, gen)
    scale = (kv.nan_to_num().abs().amax(dim=(0, 1, 3)) / 448 * 1.5)  # (Hk,): no saturation
    k8 = quantize(kv[..., :d].flatten(0, 1)[None], scale[None])[0].view(20, block, hk, d)
    v8 = quantize(kv[..., d:].flatten(0, 1)[None], scale[None])[0].view(20, block, hk, d)
    lens = torch.tensor([s.shape[0] - 1 for s in suffixes], dtype=torch.int32)  # the last token is appended
    new_k = torch.stack([s[-1:, :, :d] for s in suffixes]).to(dtype)
    new_v = torch.stack([s[-1:, :, d:] for s in suffixes]).to(dtype)
    q = torch.randn(batch, 1, 8, d, generator=gen).to(dtype)
    desc = scale[None].expand(batch, hk).contiguous()
    k8d, v8d = k8.to(device), v8.to(device)
    out = tileattn.cascade_attn_with_kvcache(
        q.to(device), k8d, v8d, prefix_table.to(device), 19, table.to(device), lens.to(device), k=new_k.to(device),
        v=new_v.to(device), k_descale=desc.to(device), v_descale=desc.to(device),
        prefix_k_descale=scale[None].to(device), prefix_v_descale=scale[None].to(device))
    pool_k, pool_v = (x.cpu().double() * scale.double()[None, None, :, None] for x in (k8d, v8d))
    for b in range(batch):
        n = int(lens[b]) + 1
        rows = [prefix_table[p // block] * block + p % block for p in range(19)]
        rows += [table[b, p // block] * block + p % block for p in range(n)]
        idx = torch.stack(rows).long()
        keys, values = pool_k.flatten(0, 1)[idx][None], pool_v.flatten(0, 1)[idx][None]
        ref_o, _ = R.attention_naive(q[b:b + 1].double().numpy(), keys.numpy(), values.numpy(), causal=True)
        plain_o, _ = plain_attention(q[b:b + 1], keys.to(dtype), values.to(dtype), causal=True)
        assert_within(f"out[{b}]", out[b:b + 1].cpu(), plain_o, ref_o)


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "prefix_block_table": a["prefix_block_table"].long()}, TypeError, "prefix_block_table"),
    (lambda a: {**a, "prefix_len": torch.tensor([40], dtype=torch.int32)}, IndexError, "prefix_len has 40 keys"),
    (lambda a: {**a, "prefix_block_table": torch.tensor([0, 99], dtype=torch.int32)}, IndexError,
     "prefix_block_table entries in use must index the cache's 10 blocks"),  # blocks of the pool, not rows
    (lambda a: {**a, "cache_seqlens": torch.tensor([0, 3], dtype=torch.int32)}, ValueError, "suffix"),
    (lambda a: {**a, "prefix_block_table": torch.stack([a["prefix_block_table"]] * 2, -1)[..., 0]}, ValueError,
     "prefix_block_table must have a contiguous last dimension"),
    (lambda a: {**a, "k_cache": a["k_cache"].to(torch.float8_e4m3fn), "q": a["q"].bfloat16(),
                "v_cache": a["v_cache"].to(torch.float8_e4m3fn), "k_descale": torch.ones(2, 2),
                "v_descale": torch.ones(2, 2)}, ValueError, "needs prefix_k_descale"),
])
def test_cascade_bad_input_raises(change, error, words):
    args = dict(q=torch.randn(2, 1, 4, 16), k_cache=torch.randn(10, 8, 2, 16), v_cache=torch.randn(10, 8, 2, 16),
                prefix_block_table=torch.tensor([0, 1], dtype=torch.int32), prefix_len=12,
                block_table=torch.tensor([[2, 3], [4, 5]], dtype=torch.int32),
                cache_seqlens=torch.tensor([3, 9], dtype=torch.int32))
    with pytest.raises(error, match=words):
        tileattn.cascade_attn_with_kvcache(**change(args))


@pytest.mark.gpu
def test_cascade_replays_from_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(199)
    dev, dtype, batch = "cuda", torch.bfloat16, 16
    pool = torch.randn(512, 16, 8, 128, device=dev, generator=gen).to(dtype)
    pool_v = torch.randn(512, 16, 8, 128, device=dev, generator=gen).to(dtype)
    perm = torch.randperm(512, device=dev, generator=gen).to(torch.int32)
    prefix_table, table = perm[:64], perm[64:64 + batch * 16].view(batch, 16)
    prefix_len = torch.tensor([1000], dtype=torch.int32, device=dev)
    lens = torch.randint(1, 250, (batch,), dtype=torch.int32, device=dev, generator=gen)
    q = torch.randn(batch, 1, 32, 128, device=dev, dtype=dtype, generator=gen)

    def step():
        return tileattn.cascade_attn_with_kvcache(q, pool, pool_v, prefix_table, prefix_len, table, lens)

    graph, _, static_out = captured(step)
    prefix_len.fill_(777)
    lens.copy_(torch.randint(1, 250, (batch,), dtype=torch.int32, device=dev, generator=gen))
    q.copy_(torch.randn(q.shape, device=dev, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, step(), rtol=0, atol=0)
