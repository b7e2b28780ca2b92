"""Decoding from a KV cache: ``flash_attn_with_kvcache`` (contiguous and paged), ``PagedKVCache``."""

import pytest
import torch

import tileattn
from tileattn import reference as R
from graphs import captured
from tolerance import assert_same_to_rounding, assert_within, plain_attention


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


# ------------------------------------------------------------------ the eager lane merges its splits in its launch


def _lane_device(monkeypatch) -> str:
    """The Triton kernels' device: CUDA where there is a GPU, else CPU tensors in the interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    return "cpu"


def _no_counter_left() -> bool:
    """Whether some (device, stream) has arrival counters and all of them are zero (after a sync)."""
    from tileattn.gpu import combine

    return bool(combine._COUNTERS) and not any(c.any() for c in combine._COUNTERS.values())


@pytest.mark.parametrize("num_splits", [3, 16])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_the_eager_lane_merges_the_splits_in_its_launch(monkeypatch, split_launches, paged, sink, num_splits):
    """A kept signature's split call (the ops layer's lane, ``PreparedFwd``) is one launch: its last
    split programs merge the splits (``MERGE_SPLITS``), the same bits call after call and what the first
    call's attention and combine launches gave to rounding (``assert_same_to_rounding``: bit for bit in
    the interpreter), within the tolerance rule of the float64 reference: sequences of 400, 130,
    2 and 0 keys over 4 key tiles (16 splits: 12 or more empty for every row; 3 splits: the 130 keys'
    third empty), 3 causal queries each (2 keys: the first query sees none; 0 keys: none does, out 0
    and lse -inf, or the sink's lse), GQA 4, head dim 40, a contiguous cache (slots past the lengths
    NaN) or a permuted pool of pages, sinks or not; outputs and workspace poisoned (conftest); the
    arrival counters all zero after each call."""
    dev = _lane_device(monkeypatch)
    gen = torch.Generator().manual_seed(40 + num_splits)
    lens, d, dtype = [400, 130, 2, 0], 40, torch.bfloat16
    q = torch.randn(4, 3, 8, d, generator=gen).to(dtype)
    k, v = (torch.randn(4, 400, 2, d, generator=gen).to(dtype) for _ in "kv")
    for b, n in enumerate(lens):
        k[b, n:], v[b, n:] = float("nan"), float("nan")
    table = random_table(4, 400, 16, 110, gen) if paged else None
    k_cache, v_cache = (paged_copy(x, table, 16, 110) for x in (k, v)) if paged else (k, v)
    sinks = torch.randn(8, generator=gen) * 2 if sink else None
    args = [None if x is None else x.to(dev) for x in (q, k_cache, v_cache, table, sinks,
                                                         torch.tensor(lens, dtype=torch.int32))]

    def call():
        return tileattn.flash_attn_with_kvcache(*args[:3], cache_seqlens=args[5], block_table=args[3], causal=True,
                                                num_splits=num_splits, learnable_sink=args[4], return_softmax_lse=True)

    two = call()  # the signature's first call: attention, then the combine
    assert split_launches == [False, False]
    merged = []
    for _ in range(2):  # the lane, twice on the same counters
        split_launches.clear()
        out, lse = call()
        assert split_launches == [True] and _no_counter_left()
        merged.append((out, lse))
    assert torch.equal(merged[0][0], out) and torch.equal(merged[0][1], lse)
    assert_same_to_rounding("out", out, two[0])
    assert_same_to_rounding("lse", lse, two[1])
    out, lse = out.cpu(), lse.cpu()
    for b, n in enumerate(lens):
        ref_o, ref_l = R.attention_naive(q[b:b + 1].double().numpy(), k[b:b + 1, :n].double().numpy(),
                                         v[b:b + 1, :n].double().numpy(), causal=True,
                                         learnable_sink=None if sinks is None else sinks.double().numpy())
        plain_o, plain_l = plain_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=True,
                                           learnable_sink=sinks)
        assert_within(f"sequence {b} out", out[b:b + 1], plain_o, ref_o)
        assert_within(f"sequence {b} lse", lse[b:b + 1], plain_l, ref_l)
    no_key = torch.cat([out[3], out[2, :1]])  # rows that see no key: out 0 (a sink has no value)
    assert torch.equal(no_key, torch.zeros_like(no_key))


def test_the_merge_reads_more_splits_than_one_block(monkeypatch, split_launches):
    """More splits than the merge reads at once (``COMBINE_MAX_BLOCK_S`` + 13, key tiles for 9 more):
    a later block raises the running maximum and the last 3 splits are empty; the lane's merged
    launch gives what the attention and combine launches gave, to rounding (``assert_same_to_rounding``)."""
    from tileattn.gpu import attention, combine

    dev = _lane_device(monkeypatch)
    gen = torch.Generator().manual_seed(45)
    splits, keys = combine.COMBINE_MAX_BLOCK_S + 13, (combine.COMBINE_MAX_BLOCK_S + 9) * attention.DECODE_BLOCK_N + 7
    q = torch.randn(1, 1, 4, 32, generator=gen)
    k_cache, v_cache = (torch.randn(1, keys, 2, 32, generator=gen) * 3 for _ in "kv")
    lens = torch.tensor([keys], dtype=torch.int32, device=dev)

    def call():
        return tileattn.flash_attn_with_kvcache(q.to(dev), k_cache.to(dev), v_cache.to(dev), cache_seqlens=lens,
                                                num_splits=splits, return_softmax_lse=True)

    two = call()
    split_launches.clear()
    one = call()
    assert split_launches == [True] and _no_counter_left()
    assert_same_to_rounding("out", one[0], two[0])
    assert_same_to_rounding("lse", one[1], two[1])
    ref_o, ref_l = R.attention_naive(q.double().numpy(), k_cache.double().numpy(), v_cache.double().numpy())
    assert_within("out", one[0].cpu(), plain_attention(q, k_cache, v_cache)[0], ref_o)


def _permute_program_order(monkeypatch, order: str) -> None:
    """Triton's interpreter runs a launch's programs one after another in grid order (axis 0 outer, axis 1
    inner), so a split program of the highest index always arrives last at its row block's counter. Here
    the programs of every launch run in another order instead: ``reversed`` (the last program first, so
    split 0 arrives last) or ``shuffled`` (a seeded random order of the whole grid)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_idx, orders = builder.set_grid_idx, {}

    def permuted(x, y, z):
        nx, ny, nz = builder.grid_dim
        n = nx * ny * nz
        if (n, order) not in orders:
            flat = list(range(n))[::-1] if order == "reversed" else torch.randperm(
                n, generator=torch.Generator().manual_seed(n)).tolist()
            orders[n, order] = flat
        f = orders[n, order][(x * ny + y) * nz + z]
        set_idx(f // (ny * nz), f // nz % ny, f % nz)

    monkeypatch.setattr(builder, "set_grid_idx", permuted)


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_the_merge_is_made_by_whichever_split_arrives_last(monkeypatch, split_launches, order):
    """The interpreter's programs in another order than the grid's (``_permute_program_order``), so that
    the split that arrives last at a row block's counter is not the one of the highest index: still one
    launch, its merged rows bit for bit the two launches' (attention, then the combine, in grid order),
    and every counter back at zero. The interpreter runs programs one at a time, so this tests which
    program merges and the counters' reset, not the memory order (the GPU tests do)."""
    from tileattn.gpu._tuning import interpreting

    if not interpreting():
        pytest.skip("Triton's interpreter only")
    dev = _lane_device(monkeypatch)
    gen = torch.Generator().manual_seed(47)
    lens, d = [300, 70, 0], 24
    q = torch.randn(3, 2, 4, d, generator=gen)
    k_cache, v_cache = (torch.randn(3, 300, 2, d, generator=gen) for _ in "kv")
    sinks = torch.randn(4, generator=gen)
    seqlens = torch.tensor(lens, dtype=torch.int32)

    def call():
        return tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                num_splits=5, learnable_sink=sinks, return_softmax_lse=True)

    assert dev == "cpu"
    two = call()  # grid order: attention, then the combine
    _permute_program_order(monkeypatch, order)
    split_launches.clear()
    one = call()
    assert split_launches == [True] and _no_counter_left()
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert not one[0].isnan().any()


def test_the_merge_rule(monkeypatch):
    """``gpu.combine.eager_counters``, the one rule: a cached zeroed buffer per (device, stream),
    grown when a grid outgrows it, another stream's its own; none while the stream captures a CUDA
    graph, none with ``EAGER_MERGE`` off or for a plan without a merged launch (two launches)."""
    from types import SimpleNamespace

    from tileattn.gpu import _launch, combine

    monkeypatch.setattr(combine, "_COUNTERS", {})
    stream, capturing = [7], [False]
    monkeypatch.setattr(_launch, "_current_stream", lambda index: stream[0])
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: capturing[0])
    plan = SimpleNamespace(merged=object(), device_index=0, device="cpu", grid=(5, 3, 1))
    first = combine.eager_counters(plan)
    assert first.dtype == torch.int32 and first.numel() >= 5 and not first.any()
    assert combine.eager_counters(plan) is first
    stream[0] = 8
    other = combine.eager_counters(plan)
    assert other is not first and other.data_ptr() != first.data_ptr()
    plan.grid = (40, 3, 1)
    assert combine.eager_counters(plan).numel() >= 40
    capturing[0] = True
    assert combine.eager_counters(plan) is None
    capturing[0] = False
    monkeypatch.setattr(combine, "EAGER_MERGE", False)
    assert combine.eager_counters(plan) is None
    monkeypatch.setattr(combine, "EAGER_MERGE", True)
    plan.merged = None
    assert combine.eager_counters(plan) is None


def test_no_merge_when_the_current_device_is_not_the_tensors(monkeypatch):
    """A launch goes to the current device's current stream (``_launch.Launch``), while the counters are
    keyed and zeroed by the tensors' device's current stream: where the two devices differ, a call on
    cuda:1 tensors from a thread whose current device is 0 would count on the buffer of cuda:1's stream
    (which a call made with cuda:1 current uses at the same time, unordered) and find it zeroed on another
    stream than its own. ``eager_counters`` gives none there (the forward and the combine, as main)."""
    from types import SimpleNamespace

    from tileattn.gpu import _launch, combine

    monkeypatch.setattr(combine, "_COUNTERS", {})
    current = [0]
    monkeypatch.setattr(_launch, "_current_device", lambda: current[0])
    monkeypatch.setattr(_launch, "_current_stream", lambda index: 100 + index)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
    plan = SimpleNamespace(merged=object(), device_index=1, device="cpu", grid=(5, 3, 1))
    assert combine.eager_counters(plan) is None
    current[0] = 1
    assert combine.eager_counters(plan) is combine._COUNTERS[1, 101]


def test_eager_merge_off_keeps_two_launches(monkeypatch, split_launches):
    """``EAGER_MERGE = False`` (the A/B switch): the lane split_launches attention and combine again."""
    from tileattn.gpu import combine

    dev = _lane_device(monkeypatch)
    monkeypatch.setattr(combine, "EAGER_MERGE", False)
    gen = torch.Generator().manual_seed(46)
    q, cache = torch.randn(1, 1, 4, 16, generator=gen).to(dev), torch.randn(1, 300, 2, 16, generator=gen).to(dev)
    for _ in range(2):
        tileattn.flash_attn_with_kvcache(q, cache, cache, num_splits=3,
                                         cache_seqlens=torch.tensor([300], dtype=torch.int32, device=dev))
    assert split_launches == [False] * 4


def _merged_launches() -> int:
    """Launches of a merging forward kernel (``MERGE_SPLITS``) so far through the fast path (a
    variant's first launch goes through Triton's path, which ``fast_calls`` does not count)."""
    from tileattn.gpu import _launch

    return sum(launch.fast_calls for launch in _launch._LAUNCHES.values() if launch.constexprs.get("MERGE_SPLITS"))


def _h200_step(gen, page: int, sink: bool):
    """q, k_cache, v_cache, block table, lengths and sinks of docs/perf-notes.md's decoding step:
    batch 1, GQA 32/8, hdim 128, bf16, 8k keys (8000 in use), contiguous or paged (a permuted pool)."""
    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    if page:
        blocks = 8192 // page
        k_cache, v_cache = rand(blocks + 7, page, 8, 128), rand(blocks + 7, page, 8, 128)
        table = torch.randperm(blocks + 7, device="cuda", generator=gen)[:blocks].view(1, blocks).to(torch.int32)
    else:
        k_cache, v_cache, table = rand(1, 8192, 8, 128), rand(1, 8192, 8, 128), None
    sinks = torch.randn(32, device="cuda", generator=gen) if sink else None
    return rand(1, 1, 32, 128), k_cache, v_cache, table, torch.tensor([8000], dtype=torch.int32, device="cuda"), sinks


_MERGE_LAYOUTS = {"contiguous": (0, False), "paged 16": (16, False), "paged 16, sinks": (16, True)}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(_MERGE_LAYOUTS))
def test_the_merged_eager_call_equals_the_captured_two_launches(layout):
    """The eager lane call of a split decoding step (one launch: the cache check folded in and the
    splits merged by the last split programs) against the same call captured in a CUDA graph (no
    merge while capturing: attention, then the combine) and replayed: the same to rounding
    (``assert_same_to_rounding``); 50 more eager calls give the first one's bits; the stream's
    arrival counters all zero after the eager calls."""
    q, k_cache, v_cache, table, lens, sinks = _h200_step(torch.Generator(device="cuda").manual_seed(95),
                                                        *_MERGE_LAYOUTS[layout])

    def call():
        return tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                learnable_sink=sinks, return_softmax_lse=True)

    call()  # the signature's first call: attention and combine
    call()  # the lane's first: its merged kernel compiled through Triton's path
    before = _merged_launches()
    eager = call()
    assert _merged_launches() == before + 1, "the eager split call did not merge in its launch"
    torch.cuda.synchronize()
    assert _no_counter_left()
    before = _merged_launches()
    graph, _, static = captured(call)  # the warm-up on a side stream merges (eager), the capture must not
    assert _merged_launches() == before + 1, "a captured call merged in its launch"
    for t in static:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_same_to_rounding("out", static[0], eager[0])
    assert_same_to_rounding("lse", static[1], eager[1])
    for i in range(50):  # more merged calls (each workspace poisoned first): a merge that read a partial
        again = call()   # before its split's stores were visible would give NaN or other bits, now and then
        assert torch.equal(again[0], eager[0]) and torch.equal(again[1], eager[1]), f"eager call {i}"
    torch.cuda.synchronize()
    assert _no_counter_left()


@pytest.mark.gpu
def test_merged_eager_calls_on_two_streams_at_once(monkeypatch):
    """Two streams making merged eager calls at once (four calls each per round, 100 rounds; a contiguous
    and a paged step): each stream counts on a buffer of its own, and every result has the bits of the
    same call made alone on the current stream, and agrees to rounding with its two launches
    (``EAGER_MERGE`` off: forward, then combine). Each round first queues a ~2 ms sleep on
    both streams, so that the calls (host-bound: one call's kernels end before the next call is issued)
    wait behind it and the two streams' kernels then run at the same time; all counters zero at the end."""
    from tileattn.gpu import combine

    gen = torch.Generator(device="cuda").manual_seed(96)
    steps = [_h200_step(gen, 0, False), _h200_step(gen, 16, True)]

    def call(q, k_cache, v_cache, table, lens, sinks):
        return tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                learnable_sink=sinks, return_softmax_lse=True)

    for step in steps:
        call(*step), call(*step)  # the signature's first call, then the lane's (merged) first: compiled
    with monkeypatch.context() as m:
        m.setattr(combine, "EAGER_MERGE", False)
        two = [call(*step) for step in steps]  # the lane's two launches
    alone = [call(*step) for step in steps]  # merged, one call at a time
    for (o2, l2), (o1, l1) in zip(two, alone):
        assert_same_to_rounding("out", o1, o2)
        assert_same_to_rounding("lse", l1, l2)
    main, streams = torch.cuda.current_stream(), [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(100):
        for stream in streams:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(4_000_000)  # ~2 ms at the H200's clock: the calls below queue behind it
        results = [[], []]
        for _ in range(4):
            for stream, step, got in zip(streams, steps, results):
                with torch.cuda.stream(stream):
                    got.append(call(*step))
        for stream in streams:
            main.wait_stream(stream)
        torch.cuda.synchronize()
        for got, (out, lse) in zip(results, alone):
            assert all(torch.equal(o, out) and torch.equal(l, lse) for o, l in got)
    raw = {stream.cuda_stream for stream in streams}
    assert len([key for key in combine._COUNTERS if isinstance(key, tuple) and key[1] in raw]) == 2
    assert _no_counter_left()
