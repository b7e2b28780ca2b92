"""Packed variable-length batches through ``flash_attn_varlen_func``: equal to per-sequence dense."""

import pytest
import torch

import tileattn
from tileattn import reference as R
from tolerance import GRAD_FACTOR, assert_within, plain_attention


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_each_sequence_alone(device, causal):
    gen = torch.Generator().manual_seed(11)
    lens_q, lens_k = [5, 0, 17, 1, 9], [7, 3, 17, 4, 2]  # a zero-length query sequence, sq > sk and sq < sk
    dtype = torch.bfloat16
    q = torch.randn(sum(lens_q), 4, 40, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(sum(lens_k), 2, 40, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(sum(lens_k), 2, 40, generator=gen).to(dtype).requires_grad_()
    cq, ck = cu(lens_q), cu(lens_k)
    qd, kd, vd = (t.detach().to(device).requires_grad_() for t in (q, k, v))
    out, lse, _ = tileattn.flash_attn_varlen_func(qd, kd, vd, cq.to(device), ck.to(device), max(lens_q), max(lens_k),
                                                  causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    ref_o, ref_lse = R.attention_varlen(*(t.detach().double().numpy() for t in (q, k, v)), cq.numpy(), ck.numpy(),
                                        causal=causal)
    plain_o, plain_lse = torch.zeros(out.shape, dtype=dtype), torch.full(lse.shape, float("-inf"))
    for b in range(len(lens_q)):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qe > qs:
            o_b, l_b = plain_attention(q[None, qs:qe].detach(), k[None, ks:ke].detach(), v[None, ks:ke].detach(),
                                       causal=causal)
            plain_o[qs:qe], plain_lse[:, qs:qe] = o_b[0], l_b[0]
    assert_within("out", out, plain_o, ref_o)
    assert_within("lse", lse, plain_lse, ref_lse)

    # gradients: each sequence's own dense gradient
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(dout.to(device))
    grads_dense = [torch.zeros_like(t) for t in (q, k, v)]
    grads_ref = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for b in range(len(lens_q)):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qe == qs or ke == ks:
            continue
        parts = [t[None, s:e].detach().clone().requires_grad_() for t, s, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke))]
        plain_attention(*parts, causal=causal)[0].backward(dout[None, qs:qe])
        ref = R.attention_naive_grad(*(p.detach().double().numpy() for p in parts), dout[None, qs:qe].double().numpy(),
                                     causal=causal)
        for acc, acc_ref, p, r, (s, e) in zip(grads_dense, grads_ref, parts, ref, ((qs, qe), (ks, ke), (ks, ke))):
            acc[s:e] = p.grad[0]
            acc_ref[s:e] = torch.from_numpy(r[0])
    for name, fast, plain, r in zip("qkv", (qd.grad, kd.grad, vd.grad), grads_dense, grads_ref):
        assert_within(f"d{name}", fast, plain, r, factor=GRAD_FACTOR)


def test_varlen_packed_forms(device):
    gen = torch.Generator().manual_seed(12)
    lens = [3, 8, 5]
    qkv = torch.randn(sum(lens), 3, 2, 16, generator=gen).to(device)
    c = cu(lens).to(device)
    base = tileattn.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], c, c, 8, 8, causal=True)
    assert torch.equal(tileattn.flash_attn_varlen_qkvpacked_func(qkv, c, 8, causal=True), base)
    assert torch.equal(tileattn.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], c, c, 8, 8, causal=True), base)


def test_varlen_over_a_paged_pool(device):
    """Keys read through a block table: a random permutation of a larger pool, unused slots NaN."""
    gen = torch.Generator().manual_seed(13)
    lens_q, lens_k, block = [4, 1, 6], [9, 30, 6], 4
    q = torch.randn(sum(lens_q), 4, 32, generator=gen)
    pool_k = torch.full((40, block, 2, 32), float("nan"))
    pool_v = torch.full((40, block, 2, 32), float("nan"))
    blocks = torch.randperm(40, generator=gen)
    table = torch.zeros(3, 8, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, n in enumerate(lens_k):
        kb, vb = torch.randn(n, 2, 32, generator=gen), torch.randn(n, 2, 32, generator=gen)
        keys.append(kb)
        values.append(vb)
        for page in range(-(-n // block)):
            table[b, page] = blocks[used]
            chunk = slice(page * block, min(n, (page + 1) * block))
            pool_k[blocks[used], : chunk.stop - chunk.start] = kb[chunk]
            pool_v[blocks[used], : chunk.stop - chunk.start] = vb[chunk]
            used += 1
    q, pool_k, pool_v, table = q.to(device), pool_k.to(device), pool_v.to(device), table.to(device)
    cq, ck = cu(lens_q).to(device), cu(lens_k).to(device)
    out = tileattn.flash_attn_varlen_func(q, pool_k, pool_v, cq, ck, max(lens_q), max(lens_k), causal=True,
                                          block_table=table)
    expect = tileattn.flash_attn_varlen_func(q, torch.cat(keys).to(device), torch.cat(values).to(device), cq, ck,
                                             max(lens_q), max(lens_k), causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, TypeError, "int32"),
    (lambda a: {**a, "cu_seqlens_k": cu([4, 4])}, ValueError, "cu_seqlens_k"),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 6, 5, 8], dtype=torch.int32)}, ValueError, "non-decreasing"),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 3, 5, 9], dtype=torch.int32)}, ValueError, "end at"),
    (lambda a: {**a, "max_seqlen_q": 2}, ValueError, "max_seqlen"),
    (lambda a: {**a, "max_seqlen_k": 3.5}, TypeError, "max_seqlen_k"),
    (lambda a: {**a, "q": a["q"][None]}, ValueError, "3-D"),
    (lambda a: {**a, "cu_seqlens_k": torch.stack([a["cu_seqlens_k"]] * 2, -1)[..., 0]}, ValueError,
     "cu_seqlens_k must have a contiguous last dimension"),
    (lambda a: {**a, "seqused_k": torch.tensor([[3, 0], [2, 0], [3, 0]], dtype=torch.int32)[:, 0]}, ValueError,
     "seqused_k must have a contiguous last dimension"),
])
def test_varlen_bad_input_raises(change, error, words):
    lens = [3, 2, 3]
    args = dict(q=torch.randn(8, 2, 16), k=torch.randn(8, 2, 16), v=torch.randn(8, 2, 16), cu_seqlens_q=cu(lens),
                cu_seqlens_k=cu(lens), max_seqlen_q=3, max_seqlen_k=3)
    with pytest.raises(error, match=words):
        tileattn.flash_attn_varlen_func(**change(args))
