"""Decoding from a KV cache: ``flash_attn_with_kvcache`` (contiguous and paged), ``PagedKVCache``."""

import pytest
import torch

import tileattn
from tileattn import reference as R
from graphs import captured
from tolerance import assert_within, plain_attention


def random_table(batch, seqlen, block_size, num_blocks, gen):
    """A block table drawn from a random permutation of a pool larger than needed."""
    per_seq = -(-seqlen // block_size)
    return torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)


def paged_copy(x, table, block_size, num_blocks):
    """Scatter dense x (B, S, Hk, D) into a NaN-filled pool through ``table``."""
    pool = torch.full((num_blocks, block_size) + x.shape[2:], float("nan"), dtype=x.dtype)
    for b in range(x.shape[0]):
        for p in range(x.shape[1]):
            pool[table[b, p // block_size], p % block_size] = x[b, p]
    return pool


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_matches_reference(device, paged, num_splits):
    gen = torch.Generator().manual_seed(21)
    dtype = torch.float16
    batch, cap, lens = 3, 48, torch.tensor([1, 37, 48], dtype=torch.int32)
    q = torch.randn(batch, 1, 8, 64, generator=gen).to(dtype)
    k = torch.randn(batch, cap, 2, 64, generator=gen).to(dtype)
    v = torch.randn(batch, cap, 2, 64, generator=gen).to(dtype)
    for b in range(batch):  # slots past each sequence's length are garbage that must not be read
        k[b, lens[b]:] = float("nan")
        v[b, lens[b]:] = float("nan")
    if paged:
        table = random_table(batch, cap, 16, 20, gen)
        k_cache, v_cache = paged_copy(k, table, 16, 20), paged_copy(v, table, 16, 20)
    else:
        k_cache, v_cache, table = k, v, None
    out, lse = tileattn.flash_attn_with_kvcache(
        q.to(device), k_cache.to(device), v_cache.to(device), cache_seqlens=lens.to(device),
        block_table=None if table is None else table.to(device), num_splits=num_splits, return_softmax_lse=True)
    for b in range(batch):
        n = int(lens[b])
        ref_o, ref_lse = R.attention_naive(q[b:b + 1].double().numpy(), k[b:b + 1, :n].double().numpy(),
                                           v[b:b + 1, :n].double().numpy())
        plain_o, plain_lse = plain_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        assert_within(f"out[{b}]", out[b:b + 1], plain_o, ref_o)
        assert_within(f"lse[{b}]", lse[b:b + 1], plain_lse, ref_lse)


@pytest.mark.parametrize("paged", [False, True])
def test_decoding_token_by_token_equals_prefill_rows(device, paged):
    """Append one token at a time (in place) with causal attention: row t of the full causal
    prefill, for every t; the cache ends up holding exactly the keys and values."""
    gen = torch.Generator().manual_seed(22)
    batch, steps, dtype = 2, 19, torch.float32
    q = torch.randn(batch, steps, 4, 32, generator=gen).to(device)
    k = torch.randn(batch, steps, 2, 32, generator=gen).to(device)
    v = torch.randn(batch, steps, 2, 32, generator=gen).to(device)
    full = tileattn.flash_attn_func(q, k, v, causal=True)
    if paged:
        k_cache = torch.full((12, 4, 2, 32), float("nan"), dtype=dtype, device=device)
        v_cache = torch.full((12, 4, 2, 32), float("nan"), dtype=dtype, device=device)
        table = torch.randperm(12, generator=gen)[:10].view(2, 5).to(torch.int32).to(device)
    else:
        k_cache = torch.full((batch, 24, 2, 32), float("nan"), dtype=dtype, device=device)
        v_cache = torch.full((batch, 24, 2, 32), float("nan"), dtype=dtype, device=device)
        table = None
    lens = torch.zeros(batch, dtype=torch.int32, device=device)
    for t in range(steps):
        step = tileattn.flash_attn_with_kvcache(q[:, t:t + 1], k_cache, v_cache, k=k[:, t:t + 1], v=v[:, t:t + 1],
                                                cache_seqlens=lens, block_table=table, causal=True)
        torch.testing.assert_close(step[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
        lens += 1
    if not paged:
        torch.testing.assert_close(k_cache[:, :steps], k, rtol=0, atol=0)


def test_chunked_prefill_with_causal_alignment(device):
    """A chunk of 5 new tokens after 11 cached ones attends bottom-right aligned."""
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(1, 16, 2, 16, generator=gen).to(device)
    k = torch.randn(1, 16, 2, 16, generator=gen).to(device)
    v = torch.randn(1, 16, 2, 16, generator=gen).to(device)
    full = tileattn.flash_attn_func(q, k, v, causal=True)
    k_cache, v_cache = torch.zeros(1, 20, 2, 16, device=device), torch.zeros(1, 20, 2, 16, device=device)
    k_cache[:, :11], v_cache[:, :11] = k[:, :11], v[:, :11]
    out = tileattn.flash_attn_with_kvcache(q[:, 11:], k_cache, v_cache, k=k[:, 11:], v=v[:, 11:],
                                           cache_seqlens=torch.tensor([11], dtype=torch.int32, device=device),
                                           causal=True)
    torch.testing.assert_close(out, full[:, 11:], rtol=1e-5, atol=1e-5)


def test_paged_kv_cache_under_inference_mode(device):
    """Under torch.inference_mode the cache's tensors (no version counter to vouch by) are checked
    like any others: a decoding step runs, and a block table that names a block past the pool
    still raises."""
    gen = torch.Generator().manual_seed(25)
    cache = tileattn.PagedKVCache(1, num_blocks=4, block_size=4, nheads_k=1, headdim=16, dtype=torch.float32,
                                  device=device)
    q = torch.randn(1, 1, 2, 16, generator=gen).to(device)
    with torch.inference_mode():
        seq = cache.allocate()
        cache.reserve([seq], 6)
        cache.advance([seq], 5)
        table, lens = cache.block_table([seq]), cache.seqlens([seq])
        out = tileattn.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0], cache_seqlens=lens,
                                               block_table=table, causal=True)
        keys = cache.k_cache[0][table[0].long()].flatten(0, 1)[None, :5]
        values = cache.v_cache[0][table[0].long()].flatten(0, 1)[None, :5]
        torch.testing.assert_close(out, tileattn.flash_attn_func(q, keys, values), rtol=1e-5, atol=1e-5)
        table[0, 1] = 9
        with pytest.raises(IndexError, match="block_table"):
            tileattn.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0], cache_seqlens=lens,
                                             block_table=table, causal=True)


def test_paged_kv_cache_helper(device):
    """Prefill packed prompts into PagedKVCache, decode with it, free and reuse blocks."""
    gen = torch.Generator().manual_seed(24)
    cache = tileattn.PagedKVCache(1, num_blocks=10, block_size=4, nheads_k=2, headdim=16, dtype=torch.float32,
                                  device=device)
    a, b = cache.allocate(), cache.allocate()
    lens = [6, 3]
    k = torch.randn(sum(lens), 2, 16, generator=gen).to(device)
    v = torch.randn(sum(lens), 2, 16, generator=gen).to(device)
    cu = torch.tensor([0, 6, 9], dtype=torch.int32)
    cache.reserve([a, b], 0)
    cache.reserve([a], 6)
    cache.reserve([b], 3)
    cache.write_packed(0, [a, b], k, v, cu)
    cache.advance([a], 6)
    cache.advance([b], 3)
    assert cache.seqlens([a, b]).tolist() == [6, 3]
    q = torch.randn(2, 1, 4, 16, generator=gen).to(device)
    k_new, v_new = torch.randn(2, 1, 2, 16, generator=gen).to(device), torch.randn(2, 1, 2, 16, generator=gen).to(device)
    cache.reserve([a, b], 1)
    out = tileattn.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0], k=k_new, v=v_new,
                                           cache_seqlens=cache.seqlens([a, b]), block_table=cache.block_table([a, b]),
                                           causal=True)
    cache.advance([a, b], 1)
    for i, (s, e) in enumerate(((0, 6), (6, 9))):
        keys = torch.cat([k[s:e], k_new[i]])[None]
        values = torch.cat([v[s:e], v_new[i]])[None]
        torch.testing.assert_close(out[i:i + 1], tileattn.flash_attn_func(q[i:i + 1], keys, values), rtol=1e-5,
                                   atol=1e-5)
    used = cache.free_blocks
    cache.free(a)
    assert cache.free_blocks == used + 2
    with pytest.raises(MemoryError):
        cache.reserve([b], 1000)
    with pytest.raises(KeyError):
        cache.seqlens([a])


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "v": a["v"].double()}, TypeError, "v must have the pool's dtype torch.float32"),
    (lambda a: {**a, "k": a["k"][:, :1], "v": a["v"][:, :1]}, ValueError, r"k must be packed \(total, 2, 16\)"),
    (lambda a: {**a, "v": a["v"][..., :1]}, ValueError, r"v must be packed \(total, 2, 16\)"),
    (lambda a: {**a, "v": a["v"][:7]}, ValueError, "one number of tokens"),
    (lambda a: {**a, "cu_seqlens": [1, 6, 9]}, ValueError, "cu_seqlens must start at 0"),
    (lambda a: {**a, "cu_seqlens": [0, 6, 8]}, ValueError, r"end at the number of packed tokens \(9\)"),
    (lambda a: {**a, "cu_seqlens": torch.tensor([0, 6.0, 9.0])}, TypeError, "cu_seqlens must hold integers"),
    (lambda a: {**a, "layer": 1}, IndexError, r"layer must be an int in 0..0"),
    (lambda a: {**a, "layer": -1}, IndexError, r"layer must be an int in 0..0"),
])
def test_paged_kv_cache_write_refuses_before_writing(change, error, words):
    """write_packed checks the tokens against the pool before writing: v in another dtype used to
    fail after k was written (a half-written layer), and a single head or feature was broadcast
    to every head by index_put without a word; offsets past 0 failed inside torch."""
    gen = torch.Generator().manual_seed(25)
    cache = tileattn.PagedKVCache(1, num_blocks=10, block_size=4, nheads_k=2, headdim=16, dtype=torch.float32)
    a, b = cache.allocate(), cache.allocate()
    cache.reserve([a], 6)
    cache.reserve([b], 3)
    args = change(dict(layer=0, seq_ids=[a, b], k=torch.randn(9, 2, 16, generator=gen),
                       v=torch.randn(9, 2, 16, generator=gen), cu_seqlens=[0, 6, 9]))
    with pytest.raises(error, match=words):
        cache.write_packed(**args)
    assert not cache.k_cache[0].any() and not cache.v_cache[0].any()  # nothing written


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "cache_seqlens": torch.tensor([3, 9], dtype=torch.int32)}, IndexError, "capacity"),
    (lambda a: {**a, "cache_seqlens": torch.tensor([3, 7], dtype=torch.int32), "k": a["k_new"], "v": a["k_new"]},
     IndexError, "room"),
    (lambda a: {**a, "cache_seqlens": torch.tensor([3, 2])}, TypeError, "int32"),
    (lambda a: {**a, "block_table": torch.tensor([[0, 1], [2, 5]], dtype=torch.int32),
                "k_cache": a["k_cache"].view(4, 4, 2, 16), "v_cache": a["v_cache"].view(4, 4, 2, 16)},
     IndexError, "block_table"),
    (lambda a: {**a, "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                "k_cache": a["k_cache"].view(4, 4, 2, 16), "v_cache": a["v_cache"].view(4, 4, 2, 16),
                "cache_seqlens": None}, ValueError, "cache_seqlens"),
    (lambda a: {**a, "cache_leftpad": torch.tensor([0, 9], dtype=torch.int32)}, IndexError, "cache_leftpad"),
    (lambda a: {**a, "cache_leftpad": torch.tensor([-1, 0], dtype=torch.int32)}, IndexError, "cache_leftpad"),
    (lambda a: {**a, "cache_leftpad": torch.zeros(2, dtype=torch.int64)}, TypeError, "cache_leftpad must be int32"),
    (lambda a: {**a, "cache_leftpad": torch.zeros(2, dtype=torch.int32), "block_table": torch.tensor(
        [[0, 1], [2, 3]], dtype=torch.int32), "k_cache": a["k_cache"].view(4, 4, 2, 16),
                "v_cache": a["v_cache"].view(4, 4, 2, 16)}, NotImplementedError, "cache_leftpad with a paged"),
    (lambda a: {**a, "cache_batch_idx": torch.arange(2)}, TypeError, "cache_batch_idx must be int32"),
    # strided views of the right values (the kernels read a contiguous last dimension)
    (lambda a: {**a, "cache_seqlens": torch.stack([a["cache_seqlens"]] * 2, -1)[..., 0]}, ValueError,
     r"cache_seqlens must have a contiguous last dimension \(stride 1\), got stride 2"),
    (lambda a: {**a, "block_table": torch.stack([torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)] * 2, -1)[..., 0],
                "k_cache": a["k_cache"].view(4, 4, 2, 16), "v_cache": a["v_cache"].view(4, 4, 2, 16)}, ValueError,
     "block_table must have a contiguous last dimension"),
    (lambda a: {**a, "cache_leftpad": torch.zeros(2, 2, dtype=torch.int32)[:, 0]}, ValueError,
     "cache_leftpad must have a contiguous last dimension"),
    (lambda a: {**a, "num_splits": -1}, ValueError, "num_splits"),
    (lambda a: {**a, "k": a["k_new"]}, ValueError, "both k and v"),
    (lambda a: {**a, "return_softmax_lse": "yes"}, TypeError, "return_softmax_lse must be a bool"),
    (lambda a: {**a, "k_cache": a["k_cache"][0], "v_cache": a["v_cache"][0]}, ValueError,
     r"cache must be 4-D: \(batch, seqlen_cache"),
])
def test_kvcache_bad_input_raises(change, error, words):
    args = dict(q=torch.randn(2, 1, 4, 16), k_cache=torch.randn(2, 8, 2, 16), v_cache=torch.randn(2, 8, 2, 16),
                cache_seqlens=torch.tensor([3, 8], dtype=torch.int32), k_new=torch.randn(2, 2, 2, 16))
    args = change(args)
    args.pop("k_new")
    with pytest.raises(error, match=words):
        tileattn.flash_attn_with_kvcache(**args)


@pytest.mark.gpu
def test_decode_step_replays_from_a_cuda_graph():
    """No host-device sync inside a decoding step: capture it in a CUDA graph and replay."""
    gen = torch.Generator(device="cuda").manual_seed(25)
    dev, dtype = "cuda", torch.bfloat16
    q = torch.randn(4, 1, 32, 128, device=dev, dtype=dtype, generator=gen)
    k_cache = torch.randn(256, 16, 8, 128, device=dev, dtype=dtype, generator=gen)
    v_cache = torch.randn(256, 16, 8, 128, device=dev, dtype=dtype, generator=gen)
    table = torch.randperm(256, device=dev, generator=gen)[:4 * 60].view(4, 60).to(torch.int32)
    lens = torch.tensor([1, 100, 500, 950], dtype=torch.int32, device=dev)
    k_new = torch.randn(4, 1, 8, 128, device=dev, dtype=dtype, generator=gen)

    def step():
        return tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=k_new, cache_seqlens=lens,
                                                block_table=table, causal=True)

    graph, eager, static_out = captured(step)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, eager, rtol=0, atol=0)
    lens += 7  # the graph reads the new lengths on replay
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, step(), rtol=0, atol=0)


def test_a_block_table_view_with_a_row_stride_of_its_own(device):
    """A block table whose rows are a slice of a wider table (row stride 8, last dimension contiguous):
    read through its row stride, with and without an append, as the contiguous copy is."""
    gen = torch.Generator().manual_seed(27)
    q, k_new = torch.randn(2, 1, 4, 16, generator=gen).to(device), torch.randn(2, 1, 2, 16, generator=gen).to(device)
    pool = torch.randn(8, 8, 2, 16, generator=gen).to(device)
    wide = torch.tensor([[3, 1, 0, 2, -1, -1, -1, -1], [7, 6, 5, 4, -1, -1, -1, -1]], dtype=torch.int32).to(device)
    lens = torch.tensor([5, 20], dtype=torch.int32, device=device)
    results = []
    for table in (wide[:, :4], wide[:, :4].contiguous()):
        k_pool, v_pool = pool.clone(), pool.flip(0).clone()
        out = tileattn.flash_attn_with_kvcache(q, k_pool, v_pool, k=k_new, v=k_new, cache_seqlens=lens,
                                               block_table=table, causal=True)
        results.append((out, k_pool, v_pool))
    assert wide[:, :4].stride() == (8, 1)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_unused_block_table_entries_may_hold_anything(device):
    """Entries past a sequence's last page (here -1 and out-of-pool ids) are never read or checked."""
    gen = torch.Generator().manual_seed(26)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    k = torch.randn(2, 6, 2, 16, generator=gen)
    v = torch.randn(2, 6, 2, 16, generator=gen)
    table = torch.tensor([[3, 0, -1, 99], [1, 2, 77, -1]], dtype=torch.int32)
    k_pool = torch.full((4, 4, 2, 16), float("nan"))
    v_pool = torch.full((4, 4, 2, 16), float("nan"))
    for b in range(2):
        for p in range(6):
            k_pool[table[b, p // 4], p % 4] = k[b, p]
            v_pool[table[b, p // 4], p % 4] = v[b, p]
    lens = torch.tensor([6, 5], dtype=torch.int32)
    q, k, v = q.to(device), k.to(device), v.to(device)
    out = tileattn.flash_attn_with_kvcache(q, k_pool.to(device), v_pool.to(device), cache_seqlens=lens.to(device),
                                           block_table=table.to(device))
    for b in range(2):
        n = int(lens[b])
        torch.testing.assert_close(out[b:b + 1], tileattn.flash_attn_func(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 0, 3])
def test_cache_leftpad_reads_only_from_the_start(device, num_splits):
    """Left-padded rows of a contiguous cache (slots before cache_leftpad hold NaN, as do slots
    past the length): new keys appended, then causal attention over leftpad .. length + new."""
    gen = torch.Generator().manual_seed(28)
    dtype = torch.float16
    batch, slots, new = 3, 40, 2
    pads, lens = torch.tensor([0, 7, 30], dtype=torch.int32), torch.tensor([5, 33, 38], dtype=torch.int32)
    q = torch.randn(batch, new, 8, 64, generator=gen).to(dtype)
    k_new = torch.randn(batch, new, 2, 64, generator=gen).to(dtype)
    v_new = torch.randn(batch, new, 2, 64, generator=gen).to(dtype)
    k = torch.randn(batch, slots, 2, 64, generator=gen).to(dtype)
    v = torch.randn(batch, slots, 2, 64, generator=gen).to(dtype)
    for b in range(batch):
        for t in (k, v):
            t[b, :pads[b]] = float("nan")
            t[b, lens[b]:] = float("nan")
    k_cache, v_cache = k.to(device), v.to(device)
    out, lse = tileattn.flash_attn_with_kvcache(
        q.to(device), k_cache, v_cache, k=k_new.to(device), v=v_new.to(device), cache_seqlens=lens.to(device),
        cache_leftpad=pads.to(device), causal=True, num_splits=num_splits, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, 8, new)
    for b in range(batch):
        lo, hi = int(pads[b]), int(lens[b])
        keys, values = torch.cat([k[b:b + 1, lo:hi], k_new[b:b + 1]], 1), torch.cat([v[b:b + 1, lo:hi], v_new[b:b + 1]], 1)
        assert torch.equal(k_cache[b, hi:hi + new].cpu(), k_new[b])  # appended in place at cache_seqlens
        ref_o, ref_lse = R.attention_naive(q[b:b + 1].double().numpy(), keys.double().numpy(), values.double().numpy(),
                                           causal=True)
        plain_o, plain_lse = plain_attention(q[b:b + 1], keys, values, causal=True)
        assert_within(f"out[{b}]", out[b:b + 1], plain_o, ref_o)
        assert_within(f"lse[{b}]", lse[b:b + 1], plain_lse, ref_lse)


CACHE_LAYOUTS = {  # how (batch, slots, nheads_k, headdim) caches lie in memory
    "contiguous": lambda t: t.contiguous(),
    "heads first": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),  # transformers' caches
    "k heads first, v contiguous": None,  # rows of k and v a different number of slots apart: copied
}


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize("batch_idx", [False, True])
def test_cache_leftpad_in_any_layout(device, layout, batch_idx):
    """cache_leftpad over caches in transformers' (batch, nheads_k, slots, headdim) order, read as
    packed keys in place (views of the caches' storage), or in two layouts whose rows cannot share
    one numbering (then copied): the same numbers as a contiguous cache, bit for bit, with the
    padding slots NaN; also rows picked from a larger cache by cache_batch_idx."""
    from tileattn.ops import kvcache

    gen = torch.Generator().manual_seed(30)
    rows, slots = 4, 24
    k, v = torch.randn(rows, slots, 2, 32, generator=gen), torch.randn(rows, slots, 2, 32, generator=gen)
    pads, lens = torch.tensor([0, 7, 20], dtype=torch.int32), torch.tensor([24, 19, 22], dtype=torch.int32)
    idx = torch.tensor([3, 0, 2], dtype=torch.int32) if batch_idx else None
    for b, r in enumerate(idx.tolist() if batch_idx else range(3)):
        k[r, :pads[b]], v[r, :pads[b]] = float("nan"), float("nan")
    if not batch_idx:
        k, v = k[:3], v[:3]
    q = torch.randn(3, 1, 8, 32, generator=gen)
    if layout == "k heads first, v contiguous":
        k_cache, v_cache = CACHE_LAYOUTS["heads first"](k), v.contiguous()
    else:
        k_cache, v_cache = CACHE_LAYOUTS[layout](k), CACHE_LAYOUTS[layout](v)
    opts = dict(cache_seqlens=lens.to(device), cache_leftpad=pads.to(device), causal=True, window_size=(9, 9),
                cache_batch_idx=None if idx is None else idx.to(device))
    got = tileattn.flash_attn_with_kvcache(q.to(device), k_cache.to(device), v_cache.to(device), **opts)
    want = tileattn.flash_attn_with_kvcache(q.to(device), k.to(device), v.to(device), **opts)
    assert torch.equal(got, want) and not got.isnan().any()
    k_tokens, v_tokens = kvcache.as_tokens(k_cache, v_cache, kvcache._token_pitch(k_cache, v_cache))
    shares = [a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
              for a, b in ((k_tokens, k_cache), (v_tokens, v_cache))]
    assert shares == ([False, True] if layout == "k heads first, v contiguous" else [True, True])  # k flattened: a copy


def test_cache_leftpad_at_the_length_leaves_no_key(device):
    """A sequence padded up to its length sees no key: output 0, LSE -inf, no NaN from the pad."""
    gen = torch.Generator().manual_seed(29)
    q = torch.randn(2, 1, 4, 16, generator=gen).to(device)
    k_cache = torch.full((2, 8, 2, 16), float("nan"), device=device)
    v_cache = torch.full((2, 8, 2, 16), float("nan"), device=device)
    k_cache[0, 2:5], v_cache[0, 2:5] = torch.randn(2, 3, 2, 16, generator=gen).to(device)
    out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                cache_seqlens=torch.tensor([5, 3], dtype=torch.int32, device=device),
                                                cache_leftpad=torch.tensor([2, 3], dtype=torch.int32, device=device),
                                                return_softmax_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    torch.testing.assert_close(out[:1], tileattn.flash_attn_func(q[:1], k_cache[:1, 2:5], v_cache[:1, 2:5]),
                               rtol=1e-5, atol=1e-5)


def test_cache_batch_idx_reads_and_appends_the_named_rows(device):
    """A contiguous cache of 5 rows serving a batch of 2 through cache_batch_idx."""
    gen = torch.Generator().manual_seed(27)
    q = torch.randn(2, 1, 4, 16, generator=gen).to(device)
    k_cache = torch.randn(5, 12, 2, 16, generator=gen).to(device)
    v_cache = torch.randn(5, 12, 2, 16, generator=gen).to(device)
    k_new, v_new = torch.randn(2, 1, 2, 16, generator=gen).to(device), torch.randn(2, 1, 2, 16, generator=gen).to(device)
    rows = torch.tensor([3, 1], dtype=torch.int32, device=device)
    lens = torch.tensor([4, 9], dtype=torch.int32, device=device)
    before = k_cache.clone()
    out = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens,
                                           cache_batch_idx=rows, causal=True)
    for b, (row, n) in enumerate(((3, 4), (1, 9))):
        assert torch.equal(k_cache[row, n], k_new[b, 0]) and torch.equal(v_cache[row, n], v_new[b, 0])
        expect = tileattn.flash_attn_func(q[b:b + 1], k_cache[row:row + 1, :n + 1], v_cache[row:row + 1, :n + 1])
        torch.testing.assert_close(out[b:b + 1], expect, rtol=1e-5, atol=1e-5)
    untouched = [r for r in range(5) if r not in (1, 3)]
    assert torch.equal(k_cache[untouched], before[untouched])
    with pytest.raises(IndexError, match="cache_batch_idx"):
        tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                         cache_batch_idx=torch.tensor([3, 5], dtype=torch.int32, device=device))


@pytest.mark.parametrize("layout", ["contiguous", "paged", "batch_idx"])
def test_append_on_the_host_equals_the_device_indexing(monkeypatch, layout):
    """CPU tensors of a small batch are appended slice by slice; the index_put path (CUDA, large
    batches) must write the same slots."""
    from tileattn.ops import kvcache

    gen = torch.Generator().manual_seed(30)
    lens = torch.tensor([0, 3, 6], dtype=torch.int32)
    k, v = torch.randn(3, 3, 2, 8, generator=gen), torch.randn(3, 3, 2, 8, generator=gen)
    if layout == "paged":
        table = torch.randperm(12, generator=gen)[:9].view(3, 3).to(torch.int32)
        shape = (12, 4, 2, 8)
    else:
        table = torch.tensor([[4], [0], [2]], dtype=torch.int32) if layout == "batch_idx" else None
        shape = (5 if table is not None else 3, 9, 2, 8)
    caches = []
    for limit in (16, 0):
        monkeypatch.setattr(kvcache, "_HOST_APPEND_MAX_BATCH", limit)
        kc, vc = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        kvcache.append_to_cache(kc, vc, k, v, lens, table)
        caches.append((kc, vc))
    for a, b in zip(*caches):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert (~caches[0][0].isnan()).sum() == k.numel()
