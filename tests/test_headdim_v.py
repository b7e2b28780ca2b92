"""A value head dim of its own (issue #18 item 2, dense path): v (.., headdim_v), output and dv too.

MLA trains with q/k of 192 and v of 128. The reference already takes any v width (out and dv
follow v); here the CPU tiles and the Triton kernels, forward and backward, against it by the
tolerance rule, with sinks and a loss on the LSE for good measure.

MLA decodes in absorbed form over one latent of 576 per token whose first 512 are the values:
the CPU tiles take it forward and backward; the Triton kernel forward (its wide tile: q/k as 512
+ a tail of 64, the key tile serving as the value tile), with a clear error before anything runs
when gradients may be needed. The last section tests that path in the interpreter, and at the
real shape on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tileattn
from tileattn import reference as R
from tolerance import GRAD_FACTOR, assert_within, plain_attention


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def np64(*tensors):
    return [t.detach().cpu().double().numpy() for t in tensors]


@pytest.mark.parametrize("dtype,headdim,headdim_v,sq,sk,causal", [
    (torch.float32, 24, 40, 19, 23, True), (torch.float16, 24, 40, 19, 23, True),
    (torch.float16, 64, 32, 37, 29, False), (torch.float32, 48, 16, 3, 45, True)])
def test_headdim_v_forward_and_backward(device, dtype, headdim, headdim_v, sq, sk, causal):
    gen = torch.Generator().manual_seed(headdim * 7 + headdim_v)
    q, k = rand(gen, 2, sq, 4, headdim, dtype=dtype), rand(gen, 2, sk, 2, headdim, dtype=dtype)
    v, dout = rand(gen, 2, sk, 2, headdim_v, dtype=dtype), rand(gen, 2, sq, 4, headdim_v, dtype=dtype)
    leaves = [t.clone().to(device).requires_grad_(True) for t in (q, k, v)]
    out, lse, _ = tileattn.flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
    assert out.shape == (2, sq, 4, headdim_v) and out.dtype == dtype
    out.backward(dout.to(device))
    ref_o, ref_lse = R.attention_naive(*np64(q, k, v), causal=causal)
    ref_g = R.attention_naive_grad(*np64(q, k, v, dout), causal=causal)
    plain_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    p_o, p_lse = plain_attention(*plain_leaves, causal=causal)
    p_o.backward(dout)
    assert_within("out", out, p_o, ref_o)
    assert_within("lse", lse, p_lse, ref_lse)
    for name, leaf, p, r in zip(("dq", "dk", "dv"), leaves, plain_leaves, ref_g):
        assert leaf.grad.shape == r.shape
        assert_within(name, leaf.grad, p.grad, r, factor=GRAD_FACTOR)


def test_headdim_v_with_sinks_and_lse_loss(device):
    gen = torch.Generator().manual_seed(3)
    q, k, v = rand(gen, 1, 21, 4, 32), rand(gen, 1, 26, 1, 32), rand(gen, 1, 26, 1, 16)
    dout, sink = rand(gen, 1, 21, 4, 16), rand(gen, 4)
    leaves = [t.clone().to(device).requires_grad_(True) for t in (q, k, v, sink)]
    out, lse, _ = tileattn.flash_attn_func(*leaves[:3], window_size=(7, 2), learnable_sink=leaves[3],
                                           return_attn_probs=True)
    ((out * dout.to(device)).sum() + (lse * lse).sum()).backward()
    _, ref_lse = R.attention_naive(*np64(q, k, v), window_size=(7, 2), learnable_sink=sink.numpy())
    ref = R.attention_naive_grad(*np64(q, k, v, dout), dlse=2 * ref_lse, window_size=(7, 2),
                                 learnable_sink=sink.numpy())
    for leaf, r in zip(leaves, ref):
        np.testing.assert_allclose(leaf.grad.cpu().numpy(), r, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("headdim", [64, 192, 576])
@pytest.mark.parametrize("headdim_v", [64, 128, 512])
def test_headdim_pairs_on_the_cpu(monkeypatch, headdim, headdim_v):
    """Issue #18's matrix, headdim_v in {64, 128, 512} x headdim in {64, 192, 576} (MLA training's
    192/128, the absorbed latent's 576/512), forward and backward on the CPU tiles."""
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(headdim + headdim_v)
    q, k = rand(gen, 1, 9, 2, headdim), rand(gen, 1, 12, 1, headdim)
    v, dout = rand(gen, 1, 12, 1, headdim_v), rand(gen, 1, 9, 2, headdim_v)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = tileattn.flash_attn_func(*leaves, causal=True)
    out.backward(dout)
    ref_o, _ = R.attention_naive(*np64(q, k, v), causal=True)
    np.testing.assert_allclose(out.detach().numpy(), ref_o, atol=1e-5)
    for leaf, r in zip(leaves, R.attention_naive_grad(*np64(q, k, v, dout), causal=True)):
        np.testing.assert_allclose(leaf.grad.numpy(), r, atol=1e-4)


def test_mla_absorbed_decoding_on_the_cpu(monkeypatch):
    """MLA's absorbed decoding: one paged latent cache of 576 per token, the values its first 512
    (a view, no copy), 16 query heads over 1 latent head, keys split in 3 ranges."""
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(23)
    latent = torch.full((7, 16, 1, 576), float("nan"))
    table = torch.tensor([[4, 0, 6], [2, 5, 1]], dtype=torch.int32)
    lengths = torch.tensor([40, 21], dtype=torch.int32)
    tokens = rand(gen, 2, 48, 1, 576)
    for b in range(2):
        for p in range(3):
            latent[table[b, p]] = tokens[b, 16 * p:16 * p + 16]
    q = rand(gen, 2, 1, 16, 576)
    out = tileattn.flash_attn_with_kvcache(q, latent, latent[..., :512], cache_seqlens=lengths, block_table=table,
                                           softmax_scale=0.05, num_splits=3)
    for b in range(2):
        n = int(lengths[b])
        ref, _ = R.attention_naive(*np64(q[b:b + 1], tokens[b:b + 1, :n], tokens[b:b + 1, :n, :, :512]),
                                   softmax_scale=0.05)
        np.testing.assert_allclose(out[b:b + 1].numpy(), ref, atol=1e-5)


@pytest.mark.gpu
def test_mla_training_shape_bf16_on_cuda():
    gen = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    q, k = rand(gen, 1, 300, 8, 192, dtype=dtype), rand(gen, 1, 300, 8, 192, dtype=dtype)
    v, dout = rand(gen, 1, 300, 8, 128, dtype=dtype), rand(gen, 1, 300, 8, 128, dtype=dtype)
    leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
    out = tileattn.flash_attn_func(*leaves, causal=True)
    out.backward(dout.cuda())
    plain_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    p_o, _ = plain_attention(*plain_leaves, causal=True)
    p_o.backward(dout)
    assert_within("out", out, p_o, R.attention_naive(*np64(q, k, v), causal=True)[0])
    for name, leaf, p, r in zip(("dq", "dk", "dv"), leaves, plain_leaves,
                                R.attention_naive_grad(*np64(q, k, v, dout), causal=True)):
        assert_within(name, leaf.grad, p.grad, r, factor=GRAD_FACTOR)


@pytest.mark.parametrize("width", [600, 0])
def test_bad_headdim_v_raises(width):
    with pytest.raises(ValueError, match="between 1 and 576"):
        tileattn.flash_attn_func(torch.zeros(1, 3, 2, 600), torch.zeros(1, 3, 2, 600), torch.zeros(1, 3, 2, 8))
    q, k = torch.zeros(1, 3, 2, 16), torch.zeros(1, 3, 2, 16)
    with pytest.raises(ValueError, match="between 1 and"):
        tileattn.flash_attn_func(q, k, torch.zeros(1, 3, 2, width))
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="between 1 and"):
        tileattn.flash_attn_varlen_func(q[0], k[0], torch.zeros(3, 2, width), cu, cu, 3, 3)
    with pytest.raises(ValueError, match="one shape"):  # the head count must still agree
        tileattn.flash_attn_func(q, k, torch.zeros(1, 3, 1, 8))


def test_varlen_with_headdim_v(device):
    gen = torch.Generator().manual_seed(22)
    lens_q, lens_k = [5, 0, 11], [9, 4, 11]
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q, k, v, dout = rand(gen, 16, 4, 24), rand(gen, 24, 2, 24), rand(gen, 24, 2, 40), rand(gen, 16, 4, 40)
    leaves = [t.clone().to(device).requires_grad_(True) for t in (q, k, v)]
    out = tileattn.flash_attn_varlen_func(*leaves, cu_q.to(device), cu_k.to(device), 11, 11, causal=True)
    out.backward(dout.to(device))
    assert out.shape == (16, 4, 40)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = (q[None, qs], k[None, ks], v[None, ks], dout[None, qs])
        ref_o, _ = R.attention_naive(*np64(*seq[:3]), causal=True)
        np.testing.assert_allclose(out[qs].detach().cpu().numpy(), ref_o[0], atol=2e-5)
        grads = R.attention_naive_grad(*np64(*seq), causal=True)
        for got, want in zip((leaves[0].grad[qs], leaves[1].grad[ks], leaves[2].grad[ks]), grads):
            np.testing.assert_allclose(got.cpu().numpy(), want[0], atol=5e-5)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_with_headdim_v(device, paged, num_splits):
    """Decoding with v of its own width, split or not, contiguous or paged, with an append."""
    gen = torch.Generator().manual_seed(20 + num_splits)
    batch, cap, d, dv = 2, 32, 24, 40
    q, k_new, v_new = rand(gen, batch, 2, 4, d), rand(gen, batch, 2, 2, d), rand(gen, batch, 2, 2, dv)
    k_full, v_full = rand(gen, batch, cap, 2, d), rand(gen, batch, cap, 2, dv)
    seqlens = torch.tensor([5, 20], dtype=torch.int32)
    if paged:
        table = torch.randperm(10, generator=gen)[:8].view(batch, 4).to(torch.int32)
        k_cache, v_cache = torch.full((10, 8, 2, d), float("nan")), torch.full((10, 8, 2, dv), float("nan"))
        for b in range(batch):
            for p in range(4):
                k_cache[table[b, p]], v_cache[table[b, p]] = k_full[b, 8 * p:8 * p + 8], v_full[b, 8 * p:8 * p + 8]
        table = table.to(device)
    else:
        k_cache, v_cache, table = k_full.clone(), v_full.clone(), None
    out = tileattn.flash_attn_with_kvcache(q.to(device), k_cache.to(device), v_cache.to(device), k=k_new.to(device),
                                           v=v_new.to(device), cache_seqlens=seqlens.to(device), block_table=table,
                                           causal=True, num_splits=num_splits)
    assert out.shape == (batch, 2, 4, dv)
    for b in range(batch):
        n = int(seqlens[b])
        keys = torch.cat([k_full[b:b + 1, :n], k_new[b:b + 1]], 1)
        values = torch.cat([v_full[b:b + 1, :n], v_new[b:b + 1]], 1)
        ref, _ = R.attention_naive(*np64(q[b:b + 1], keys, values), causal=True)
        np.testing.assert_allclose(out[b:b + 1].cpu().numpy(), ref, atol=2e-5)


def test_latent_cache_values_are_a_view_of_the_keys(device):
    """MLA's absorbed decoding: one latent cache, v_cache = k_cache[..., :dv] (shared storage); it is
    read in place (no copy) and the new latent is written once: half the cache writes of separate
    k and v caches (writes counted at the dispatcher, whichever append path runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountWrites(TorchDispatchMode):
        def __init__(self, storages):
            super().__init__()
            self.storages, self.writes = storages, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.index_put_.default, torch.ops.aten.copy_.default) and \
                    args[0].untyped_storage().data_ptr() in self.storages:
                self.writes += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(21)
    batch, cap, d, dv = 2, 24, 48, 32
    latent = rand(gen, batch, cap, 1, d).to(device)
    q, new = rand(gen, batch, 1, 4, d).to(device), rand(gen, batch, 1, 1, d).to(device)
    seqlens = torch.tensor([7, 15], dtype=torch.int32, device=device)
    k_sep, v_sep = latent.clone(), latent[..., :dv].clone()
    with CountWrites({k_sep.untyped_storage().data_ptr(), v_sep.untyped_storage().data_ptr()}) as separate:
        tileattn.flash_attn_with_kvcache(q, k_sep, v_sep, k=new, v=new[..., :dv].clone(), cache_seqlens=seqlens,
                                         causal=True, num_splits=2)
    k_cache, v_cache = latent, latent[..., :dv]
    with CountWrites({latent.untyped_storage().data_ptr()}) as shared:
        out = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new[..., :dv], cache_seqlens=seqlens,
                                               causal=True, num_splits=2)
    assert separate.writes > 0 and shared.writes * 2 == separate.writes
    assert v_cache.data_ptr() == latent.data_ptr()
    for b in range(batch):
        n = int(seqlens[b]) + 1
        assert torch.equal(latent[b, n - 1], new[b, 0])
        ref, _ = R.attention_naive(*np64(q[b:b + 1], latent[b:b + 1, :n], latent[b:b + 1, :n, :, :dv]), causal=True)
        np.testing.assert_allclose(out[b:b + 1].cpu().numpy(), ref, atol=2e-5)


# ------------------------------------------------------------ head dims above 256 on the Triton path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_path(monkeypatch):
    """The Triton kernels: on the GPU, or on CPU tensors in Triton's interpreter; the launcher's
    plans forgotten first, so that each test can read the plan its call made."""
    from tileattn.gpu import attention as launch

    if DEVICE == "cpu":
        monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    launch.clear_plans()
    return launch


def latent_pool(gen, lengths, page, width, dtype, spare=3):
    """Keys of width ``width`` for sequences of ``lengths`` in a pool of pages drawn from a random
    permutation, ``spare`` pages more than needed, every unused slot NaN; returns (pool, table,
    tokens (batch, longest, 1, width))."""
    pages = [-(-n // page) for n in lengths]
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    order = torch.randperm(sum(pages) + spare, generator=gen).tolist()
    pool = torch.full((sum(pages) + spare, page, 1, width), float("nan"))
    tokens = rand(gen, len(lengths), max(lengths), 1, width)
    for b, n in enumerate(lengths):
        for p in range(pages[b]):
            table[b, p] = block = order.pop()
            rows = slice(p * page, min(n, (p + 1) * page))
            pool[block, :rows.stop - rows.start] = tokens[b, rows]
    return pool.to(dtype), table, tokens.to(dtype)


def wide_flags(launch):
    """(HEAD_DIM, HEAD_DIM_TAIL, V_IS_K, SINGLE_LOOP, PACK_GQA, SPLIT_KV) of each plan made."""
    return [tuple(p.flags[f] for f in ("HEAD_DIM", "HEAD_DIM_TAIL", "V_IS_K", "SINGLE_LOOP", "PACK_GQA", "SPLIT_KV"))
            for p in launch._PLANS.values()]


def check_per_sequence(out, q, keys, values, lengths, causal=True, lse=None, softmax_scale=None):
    """Each sequence b of ``out`` (and ``lse``) against float64 attention over its first
    lengths[b] keys, with plain torch in q's dtype as the budget."""
    for b, n in enumerate(lengths):
        qb, kb, vb = q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n]
        ref_o, ref_lse = R.attention_naive(*np64(qb, kb, vb), causal=causal, softmax_scale=softmax_scale)
        plain_o, plain_lse = plain_attention(qb.cpu(), kb.cpu(), vb.cpu(), causal=causal, softmax_scale=softmax_scale)
        assert_within(f"out[{b}]", out[b:b + 1], plain_o, ref_o)
        if lse is not None:
            assert_within(f"lse[{b}]", lse[b:b + 1], plain_lse, ref_lse)


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("nheads,seqlen_q", [(16, 1), (128, 1), (16, 2)])
def test_mla_absorbed_decoding_on_the_triton_path(triton_path, paged, num_splits, nheads, seqlen_q):
    """MLA's absorbed decoding on the Triton kernel: one latent of 576 per token whose first 512
    are the values (v_cache a view of k_cache: the key tile serves as the value tile), bf16,
    paged (blocks of 64 from a permuted pool, unused slots NaN) or contiguous (NaN past each
    length), all heads over one latent head (PACK_GQA: 128 heads are two 64-row programs),
    split or not, causal with one query or two (speculative: bottom-right aligned)."""
    gen = torch.Generator().manual_seed(30 + nheads + num_splits + seqlen_q)
    lengths = [70, 3, 129]
    q = rand(gen, 3, seqlen_q, nheads, 576, dtype=torch.bfloat16)
    if paged:
        cache, table, tokens = latent_pool(gen, lengths, 64, 576, torch.bfloat16)
    else:
        tokens = rand(gen, 3, 130, 1, 576, dtype=torch.bfloat16)
        cache, table = tokens.clone(), None
        for b, n in enumerate(lengths):
            cache[b, n:] = float("nan")
    cache = cache.to(DEVICE)
    out, lse = tileattn.flash_attn_with_kvcache(
        q.to(DEVICE), cache, cache[..., :512], cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        block_table=None if table is None else table.to(DEVICE), causal=True, num_splits=num_splits,
        return_softmax_lse=True)
    assert out.shape == (3, seqlen_q, nheads, 512)
    assert wide_flags(triton_path) == [(512, 64, True, True, True, num_splits > 1)]
    check_per_sequence(out, q, tokens, tokens[..., :512], lengths, lse=lse)


@pytest.mark.parametrize("d,dv,share,dtype", [
    (576, 512, False, torch.float16),  # a v cache of its own: two tiles per key block
    (384, 256, True, torch.bfloat16),  # 256 + a tail of 128; v the main part of k
    (300, 40, False, torch.float32),  # 256 + a tail of 44 (padded to 64: the tail's columns masked)
    (64, 512, False, torch.bfloat16),  # only v wide
])
def test_wide_head_dims_decode_on_the_triton_path(triton_path, d, dv, share, dtype):
    """Other wide head dims: tails other than 64, a separate v, GQA 4 heads over 2 KV heads, three
    queries per sequence (causal), split keys, a contiguous cache with NaN past each length."""
    gen = torch.Generator().manual_seed(d + dv)
    lengths = [45, 7]
    q = rand(gen, 2, 3, 4, d, dtype=dtype)
    k = rand(gen, 2, 48, 2, d, dtype=dtype)
    v = k[..., :dv] if share else rand(gen, 2, 48, 2, dv, dtype=dtype)
    k_cache = k.clone().to(DEVICE)
    v_cache = k_cache[..., :dv] if share else v.clone().to(DEVICE)
    for b, n in enumerate(lengths):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    out = tileattn.flash_attn_with_kvcache(q.to(DEVICE), k_cache, v_cache, causal=True, num_splits=2,
                                           cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    main = {576: 512, 384: 256, 300: 256, 64: 64}[d]  # the largest power of two below, above 256
    assert wide_flags(triton_path) == [(main, d - main, share, True, True, True)]
    check_per_sequence(out, q, k, v, lengths)


@pytest.mark.parametrize("first_shared", [True, False])
@pytest.mark.parametrize("api", ["kvcache", "func"])
def test_latent_view_and_a_separate_v_of_one_shape_do_not_share_a_launch(triton_path, api, first_shared):
    """The launch a signature keeps (``ops._memo``) for a v that is a view of k[..., :dv] reads the
    value tile from the key tile; a later call whose v has the same shape and strides but is another
    tensor (or the other way round) must not take it. Before the memo keyed whether v starts where k
    does, the second call read k's leading columns as its values: silently wrong numbers."""
    from tileattn.ops import attention, kvcache

    attention._CHECKED.clear()  # no launch kept by an earlier test: the first call here makes it
    kvcache._CHECKED.clear()
    gen = torch.Generator().manual_seed(5 + first_shared)
    d, dv, lengths = 320, 256, [13, 5]
    q = rand(gen, 2, 1, 2, d)
    k = rand(gen, 2, 16, 1, d).to(DEVICE)
    other = rand(gen, 2, 16, 1, d).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    values = (k[..., :dv], other[..., :dv]) if first_shared else (other[..., :dv], k[..., :dv])
    assert values[0].stride() == values[1].stride()
    for v in values:
        if api == "kvcache":
            out = tileattn.flash_attn_with_kvcache(q.to(DEVICE), k, v, cache_seqlens=lens)
            check_per_sequence(out, q, k, v, lengths, causal=False)
        else:
            out = tileattn.flash_attn_func(q.to(DEVICE), k, v)
            check_per_sequence(out, q, k, v, [16, 16], causal=False)


@pytest.mark.parametrize("seqlen_q,seqlen_k,nheads", [(20, 45, 2), (70, 45, 2), (1, 33, 128)])
def test_wide_prefill_on_the_triton_path(triton_path, seqlen_q, seqlen_k, nheads):
    """The latent's 576/512 through flash_attn_func without gradients: queries packed per head group
    (20 x 2 rows) or not (70 queries, the first 25 of which see no key: out 0, lse -inf), causal."""
    gen = torch.Generator().manual_seed(seqlen_q + nheads)
    q = rand(gen, 2, seqlen_q, nheads, 576, dtype=torch.bfloat16)
    latent = rand(gen, 2, seqlen_k, 1, 576, dtype=torch.bfloat16)
    packed = latent.flatten(0, 1).to(DEVICE)  # once: v must be a view of k (on a GPU, .to copies)
    out, lse = tileattn.flash_attn_varlen_func(
        q.flatten(0, 1).to(DEVICE), packed, packed[..., :512],
        torch.tensor([0, seqlen_q, 2 * seqlen_q], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, seqlen_k, 2 * seqlen_k], dtype=torch.int32, device=DEVICE), seqlen_q, seqlen_k,
        softmax_scale=0.06, causal=True, return_softmax_lse=True)
    out, lse = out.view(2, seqlen_q, nheads, 512), lse.view(nheads, 2, seqlen_q).transpose(0, 1)
    (flags,) = wide_flags(triton_path)
    assert flags[:4] == (512, 64, True, True)
    check_per_sequence(out, q, latent, latent[..., :512], [seqlen_k] * 2, lse=lse, softmax_scale=0.06)
    if seqlen_q > seqlen_k:
        assert torch.isneginf(lse[:, :, :seqlen_q - seqlen_k]).all()


def test_mla_mixed_batch_on_the_triton_path(triton_path):
    """A serving step over the paged latent in one flash_attn_varlen_func call: decoding rows, a
    speculative row of 3 and a prefill chunk of 11 queries (8 heads over the latent: more than the
    decode tile's 64 rows), split; the chunk's rows are a second launch of the wide tile."""
    gen = torch.Generator().manual_seed(41)
    lens_q, lens_k = [1, 3, 11, 1], [60, 17, 75, 1]
    pool, table, tokens = latent_pool(gen, lens_k, 16, 576, torch.bfloat16)
    q = rand(gen, sum(lens_q), 8, 576, dtype=torch.bfloat16)
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    pool = pool.to(DEVICE)
    out = tileattn.flash_attn_varlen_func(q.to(DEVICE), pool, pool[..., :512], cu_q.to(DEVICE), None, max(lens_q),
                                          max(lens_k), causal=True, block_table=table.to(DEVICE), num_splits=3,
                                          seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE))
    plans = list(triton_path._PLANS.values())
    assert len(plans) == 1 and plans[0].long is not None and plans[0].flags["V_IS_K"]
    for b in range(len(lens_q)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        check_per_sequence(out[None, rows], q[None, rows], tokens[b:b + 1], tokens[b:b + 1, ..., :512], [lens_k[b]])


@pytest.mark.parametrize("needs_grad", ["q", "v", "sink", "varlen"])
def test_gradients_above_256_raise_before_any_kernel(triton_path, monkeypatch, needs_grad):
    """The Triton backward stops at head dim 256: a call that may need gradients with a wider q/k or
    v raises a clear NotImplementedError before any kernel runs; without gradients it computes."""
    import tileattn.gpu

    gen = torch.Generator().manual_seed(7)
    q, k, v = (rand(gen, 1, 5, 2, d).to(DEVICE) for d in (576, 576, 512))
    sink = rand(gen, 2).to(DEVICE)
    {"q": q, "v": v, "sink": sink, "varlen": k}[needs_grad].requires_grad_(True)
    ran = []
    with monkeypatch.context() as patch, pytest.raises(NotImplementedError, match="up to 256, got q/k 576 and v 512"):
        patch.setattr(tileattn.gpu, "attn_fwd", lambda *args, **kwargs: ran.append(1))
        if needs_grad == "varlen":
            cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
            tileattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5)
        else:
            tileattn.flash_attn_func(q, k, v, learnable_sink=sink)
    assert not ran
    with torch.no_grad():
        out = tileattn.flash_attn_func(q, k, v, learnable_sink=sink)
    plain_o, _ = plain_attention(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(),
                                 learnable_sink=sink.detach().cpu())
    ref_o, _ = R.attention_naive(*np64(q, k, v), learnable_sink=sink.detach().cpu().double().numpy())
    assert_within("no_grad out", out, plain_o, ref_o)


def test_head_dims_past_the_limits_still_raise_on_the_triton_path(triton_path):
    q = torch.zeros(1, 3, 2, 600, device=DEVICE)
    with pytest.raises(ValueError, match="between 1 and 576 on the triton path"):
        tileattn.flash_attn_func(q, q, q[..., :8])
    q, k = torch.zeros(1, 3, 2, 576, device=DEVICE), torch.zeros(1, 3, 1, 576, device=DEVICE)
    with pytest.raises(ValueError, match="between 1 and 512 on the triton path"):
        tileattn.flash_attn_with_kvcache(q, k, torch.zeros(1, 3, 1, 520, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_decoding_at_the_real_shape_on_cuda(fp8):
    """DeepSeek's absorbed decoding as serving runs it: batch 64, up to 8k keys of the 576 latent
    (lengths drawn, one full), 128 heads, bf16 queries, blocks of 64 from a permuted pool, the split
    count left to the launcher; v_cache = k_cache[..., :512]. Four sequences against float64 by the
    tolerance rule (an FP8 latent: against the dequantised latent); every output finite."""
    gen = torch.Generator().manual_seed(64)
    batch, nheads, page = 64, 128, 64
    lengths = torch.randint(1, 8193, (batch,), generator=gen)
    lengths[0], lengths[1] = 8192, 1
    pool, table, tokens = latent_pool(gen, lengths.tolist(), page, 576, torch.bfloat16, spare=16)
    kwargs = {}
    if fp8:  # one descale per sequence (keys and values alike: one latent), no saturation
        descale = tokens.float().nan_to_num().abs().amax(dim=(1, 2, 3)).view(batch, 1) / 400
        stored = torch.full(pool.shape, float("nan")).to(torch.float8_e4m3fn)
        for b in range(batch):
            blocks = table[b, :-(-int(lengths[b]) // page)].long()
            stored[blocks] = (pool[blocks].float() / descale[b]).to(torch.float8_e4m3fn)
        pool = stored
        kwargs = dict(k_descale=descale.cuda())
        kwargs["v_descale"] = kwargs["k_descale"]
    q = rand(gen, batch, 1, nheads, 576, dtype=torch.bfloat16)
    cache = pool.cuda()
    out = tileattn.flash_attn_with_kvcache(q.cuda(), cache, cache[..., :512], cache_seqlens=lengths.int().cuda(),
                                           block_table=table.cuda(), causal=True, **kwargs).cpu()
    assert torch.isfinite(out).all()
    for b in (0, 1, 17, 40):
        n = int(lengths[b])
        if fp8:
            blocks = table[b, :-(-n // page)].long()
            keys = stored[blocks].flatten(0, 1)[None, :n].double() * float(descale[b])
        else:
            keys = tokens[b:b + 1, :n].double()
        ref_o, _ = R.attention_naive(q[b:b + 1].double().numpy(), keys.numpy(), keys[..., :512].numpy())
        plain_o, _ = plain_attention(q[b:b + 1], keys.to(torch.bfloat16), keys[..., :512].to(torch.bfloat16))
        assert_within(f"seq {b} ({n} keys) out", out[b:b + 1], plain_o, ref_o)


# ------------------------------------------------------------ the serving entry points: DecodePlan, cascade

SERVING_CASES = {  # (headdim, headdim_v, latent: v_cache = k_cache[..., :headdim_v], nheads, nheads_k, dtype)
    "192/128": (192, 128, False, 4, 2, torch.float16),
    "MLA 576/512 latent": (576, 512, True, 4, 1, torch.bfloat16),
}


def serving_pool(gen, lengths, page, d, dv, latent, nheads_k, dtype, num_blocks, table=None):
    """A paged pool (a random permutation of ``num_blocks`` pages of ``page``, unused slots NaN) of
    keys (d) and values (dv, or the keys' first dv when ``latent``) for sequences of ``lengths``;
    returns (k_pool, v_pool, table (batch, max_pages), keys, values (batch, longest, nheads_k, .)).
    A ``table`` given is used (another layer of one decoding step)."""
    pages = max(-(-n // page) for n in lengths)
    if table is None:
        order = torch.randperm(num_blocks, generator=gen).tolist()
        table = torch.tensor([[order.pop() for _ in range(pages)] for _ in lengths], dtype=torch.int32)
    keys = rand(gen, len(lengths), pages * page, nheads_k, d, dtype=dtype)
    values = keys[..., :dv] if latent else rand(gen, len(lengths), pages * page, nheads_k, dv, dtype=dtype)
    k_pool = torch.full((num_blocks, page, nheads_k, d), float("nan"), dtype=dtype)
    v_pool = k_pool[..., :dv] if latent else torch.full((num_blocks, page, nheads_k, dv), float("nan"), dtype=dtype)
    for b, n in enumerate(lengths):
        for p in range(-(-n // page)):
            rows = slice(p * page, min(n, (p + 1) * page))
            k_pool[table[b, p], :rows.stop - rows.start] = keys[b, rows]
            if not latent:
                v_pool[table[b, p], :rows.stop - rows.start] = values[b, rows]
    return k_pool, v_pool, table, keys, values


@pytest.mark.parametrize("case", list(SERVING_CASES))
def test_decode_plan_with_headdim_v(device, case):
    """``DecodePlan`` with v of its own head dim: each layer's run (appending one token) equals
    ``flash_attn_with_kvcache`` bit for bit, out (.., headdim_v) is within the tolerance rule of
    float64 attention, and MLA's latent is written once, in place (the plan keeps the view)."""
    d, dv, latent, nheads, nheads_k, dtype = SERVING_CASES[case]
    gen = torch.Generator().manual_seed(d + dv + 1)
    lengths = [9, 22]  # after the append
    lens = torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device=device)
    layers, table = [], None
    for _ in range(2):
        k_pool, v_pool, table, keys, values = serving_pool(gen, [n - 1 for n in lengths], 8, d, dv, latent, nheads_k,
                                                           dtype, 9, table)
        for b, n in enumerate(lengths):  # the appended token: keys[b, n - 1] (NaN in the pool until then)
            keys[b, n - 1] = rand(gen, nheads_k, d, dtype=dtype)
            if not latent:
                values[b, n - 1] = rand(gen, nheads_k, dv, dtype=dtype)
        k_new = torch.stack([keys[b, n - 1:n] for b, n in enumerate(lengths)])
        v_new = k_new[..., :dv] if latent else torch.stack([values[b, n - 1:n] for b, n in enumerate(lengths)])
        k_pool = k_pool.to(device)
        v_pool = k_pool[..., :dv] if latent else v_pool.to(device)
        k_new = k_new.to(device)
        v_new = k_new[..., :dv] if latent else v_new.to(device)
        layers.append((rand(gen, 2, 1, nheads, d, dtype=dtype).to(device), k_pool, v_pool, k_new, v_new, keys, values))
    table = table.to(device)
    plan = tileattn.DecodePlan(*layers[0][:3], lens, table, seqlen_new=1, causal=True, num_splits=2,
                               return_softmax_lse=True)
    for q, k_pool, v_pool, k_new, v_new, keys, values in layers:
        k_ref = k_pool.clone()
        v_ref = k_ref[..., :dv] if latent else v_pool.clone()
        want = tileattn.flash_attn_with_kvcache(q, k_ref, v_ref, k_new, v_new, cache_seqlens=lens, block_table=table,
                                                causal=True, num_splits=2, return_softmax_lse=True)
        out, lse = plan.run(q, k_pool, v_pool, k=k_new, v=v_new)
        assert out.shape == (2, 1, nheads, dv)
        torch.testing.assert_close(out, want[0], rtol=0, atol=0)
        torch.testing.assert_close(lse, want[1], rtol=0, atol=0)
        torch.testing.assert_close(k_pool, k_ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_pool, v_ref, rtol=0, atol=0, equal_nan=True)
        check_per_sequence(out.cpu(), q.cpu(), keys, values, lengths, lse=lse.cpu())
    if latent:  # a layer whose v_cache is no view of its k_cache is not the planned layer
        q, k_pool, v_pool, k_new, v_new = layers[0][:5]
        with pytest.raises(ValueError, match="view of k_cache"):
            plan.run(q, k_pool, v_pool.clone(), k=k_new, v=v_new)
    with pytest.raises(ValueError, match="the plan appends v"):
        plan.run(*layers[0][:4], v=layers[0][3])


@pytest.mark.parametrize("case", list(SERVING_CASES))
def test_cascade_with_headdim_v(device, case):
    """``cascade_attn_with_kvcache`` with v of its own head dim: the prefix's and the suffixes'
    partial states and their merge have headdim_v; causal, one appended token per request (written
    once for the latent), against float64 attention over prefix ++ suffix by the tolerance rule."""
    d, dv, latent, nheads, nheads_k, dtype = SERVING_CASES[case]
    gen = torch.Generator().manual_seed(d + dv + 2)
    page, prefix_len, suffix = 8, 13, [4, 11, 1]  # suffix lengths after the append
    # one pool: the prefix as "sequence" 0, the requests' suffixes after it
    k_pool, v_pool, table, keys, values = serving_pool(gen, [prefix_len] + [n - 1 for n in suffix], page, d, dv,
                                                       latent, nheads_k, dtype, 16)
    for b, n in enumerate(suffix):
        keys[b + 1, n - 1] = rand(gen, nheads_k, d, dtype=dtype)
        if not latent:
            values[b + 1, n - 1] = rand(gen, nheads_k, dv, dtype=dtype)
    k_new = torch.stack([keys[b + 1, n - 1:n] for b, n in enumerate(suffix)]).to(device)
    v_new = k_new[..., :dv] if latent else torch.stack([values[b + 1, n - 1:n] for b, n in enumerate(suffix)]).to(
        device)
    k_pool = k_pool.to(device)
    v_pool = k_pool[..., :dv] if latent else v_pool.to(device)
    q = rand(gen, len(suffix), 1, nheads, d, dtype=dtype)
    lens = torch.tensor([n - 1 for n in suffix], dtype=torch.int32, device=device)
    out, lse = tileattn.cascade_attn_with_kvcache(
        q.to(device), k_pool, v_pool, table[0, :2].to(device), prefix_len, table[1:].to(device), lens, k=k_new,
        v=v_new, causal=True, num_splits=2, return_softmax_lse=True)
    assert out.shape == (len(suffix), 1, nheads, dv) and out.dtype == dtype
    for b, n in enumerate(suffix):
        kb = torch.cat([keys[0, :prefix_len], keys[b + 1, :n]])[None]
        vb = torch.cat([values[0, :prefix_len], values[b + 1, :n]])[None]
        check_per_sequence(out[b:b + 1].cpu(), q[b:b + 1], kb, vb, [prefix_len + n], lse=lse[b:b + 1].cpu())
