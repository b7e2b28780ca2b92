"""flash-attn's options combined: sliding window, softcap, ALiBi and dropout together with causal,
GQA, packed batches and the paged KV cache, through the public functions on both backends."""

import numpy as np
import pytest
import torch

import tileattn
from tileattn import reference as R
from tileattn.dropout_mask import GOLDEN, M32
from tolerance import GRAD_FACTOR, assert_within, plain_attention


def cu(lengths):
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


def per_sequence_plain(q, k, v, cq, ck, *, dropout_seed=0, **opts):
    """plain_attention (the error budget) run sequence by sequence of a packed batch.

    Dropout's head counter of sequence b is b * nheads + h; run alone, the sequence counts
    from 0, so its seed is advanced by b * nheads steps of the hash's head stride.
    """
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    slopes = opts.pop("alibi_slopes", None)
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qe > qs and ke > ks:
            seed_b = (dropout_seed + b * q.shape[1] * GOLDEN) & M32
            o_b, l_b = plain_attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], alibi_slopes=slopes,
                                       dropout_seed=seed_b, **opts)
            out[qs:qe], lse[:, qs:qe] = o_b[0], l_b[0]
    return out, lse


@pytest.mark.parametrize("window,softcap,alibi,dropout_p", [
    ((6, 0), 4.0, True, 0.0),
    ((-1, -1), 0.0, True, 0.2),
    ((3, 5), 2.5, False, 0.1),
])
def test_varlen_with_combined_options(device, window, softcap, alibi, dropout_p):
    """Packed batch (an empty sequence, sq > sk and sq < sk), GQA 4/2, causal, and the options."""
    gen = torch.Generator().manual_seed(51)
    lens_q, lens_k = [9, 0, 23, 4], [14, 5, 23, 2]
    dtype = torch.bfloat16
    q = torch.randn(sum(lens_q), 4, 40, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), 2, 40, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), 2, 40, generator=gen).to(dtype)
    slopes = torch.rand(4, generator=gen) if alibi else None
    cq, ck = cu(lens_q), cu(lens_k)
    opts = dict(causal=True, window_size=window, softcap=softcap)
    torch.manual_seed(7)
    seed = tileattn.ops.attention.draw_dropout_seed(dropout_p, torch.device(device))  # the inputs' generator
    torch.manual_seed(7)  # the call draws the same seed
    qd, kd, vd = (t.clone().to(device).requires_grad_() for t in (q, k, v))
    out, lse, _ = tileattn.flash_attn_varlen_func(
        qd, kd, vd, cq.to(device), ck.to(device), max(lens_q), max(lens_k), dropout_p=dropout_p,
        alibi_slopes=None if slopes is None else slopes.to(device), return_attn_probs=True, **opts)
    ref_o, ref_lse = R.attention_varlen(q.double().numpy(), k.double().numpy(), v.double().numpy(), cq.numpy(),
                                        ck.numpy(), alibi_slopes=None if slopes is None else slopes.double().numpy(),
                                        dropout_p=dropout_p, dropout_seed=seed, **opts)
    plain_o, plain_lse = per_sequence_plain(q, k, v, cq, ck, alibi_slopes=slopes, dropout_p=dropout_p,
                                            dropout_seed=seed, **opts)
    assert_within("out", out, plain_o, ref_o)
    assert_within("lse", lse, plain_lse, ref_lse)
    # gradients of a dense batch of one sequence (the reference's gradient is dense)
    if dropout_p == 0.0:
        dout = torch.randn(out.shape, generator=gen).to(dtype)
        out.backward(dout.to(device))
        qs, qe, ks, ke = int(cq[2]), int(cq[3]), int(ck[2]), int(ck[3])
        ref = R.attention_naive_grad(q[None, qs:qe].double().numpy(), k[None, ks:ke].double().numpy(),
                                     v[None, ks:ke].double().numpy(), dout[None, qs:qe].double().numpy(),
                                     alibi_slopes=None if slopes is None else slopes.double().numpy(), **opts)
        parts = [t[None, s:e].clone().requires_grad_() for t, s, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke))]
        plain_attention(*parts, alibi_slopes=slopes, **opts)[0].backward(dout[None, qs:qe])
        for name, fast, p, r in zip("qkv", (qd.grad[qs:qe], kd.grad[ks:ke], vd.grad[ks:ke]), parts, ref):
            assert_within(f"d{name}", fast[None], p.grad, r, factor=GRAD_FACTOR)


@pytest.mark.parametrize("window,softcap,alibi", [((20, 0), 0.0, True), ((-1, -1), 3.0, True), ((7, 0), 5.0, False)])
def test_paged_cache_with_combined_options(device, window, softcap, alibi):
    """Chunked prefill of 5 tokens over a paged cache (pool permuted, unused slots NaN) with the options."""
    gen = torch.Generator().manual_seed(52)
    dtype, block = torch.float16, 8
    lens = [3, 40]  # cached keys per sequence; 5 new tokens each
    new = 5
    q = torch.randn(2, new, 4, 64, generator=gen).to(dtype)
    k_all = [torch.randn(n + new, 1, 64, generator=gen).to(dtype) for n in lens]  # MQA: one key head
    v_all = [torch.randn(n + new, 1, 64, generator=gen).to(dtype) for n in lens]
    pool_k = torch.full((20, block, 1, 64), float("nan"), dtype=dtype)
    pool_v = torch.full((20, block, 1, 64), float("nan"), dtype=dtype)
    table = torch.randperm(20, generator=gen)[:14].view(2, 7).to(torch.int32)
    for b, n in enumerate(lens):
        for p in range(n):
            pool_k[table[b, p // block], p % block] = k_all[b][p]
            pool_v[table[b, p // block], p % block] = v_all[b][p]
    k_new = torch.stack([k[-new:] for k in k_all])
    v_new = torch.stack([v[-new:] for v in v_all])
    slopes = torch.rand(2, 4, generator=gen) if alibi else None  # per (batch, head)
    opts = dict(causal=True, window_size=window, softcap=softcap)
    pool_kd, pool_vd = pool_k.to(device), pool_v.to(device)
    out, lse = tileattn.flash_attn_with_kvcache(
        q.to(device), pool_kd, pool_vd, k=k_new.to(device), v=v_new.to(device),
        cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device), block_table=table.to(device),
        alibi_slopes=None if slopes is None else slopes.to(device), return_softmax_lse=True, **opts)
    for b, n in enumerate(lens):
        keys, values = k_all[b][None], v_all[b][None]
        slope_b = None if slopes is None else slopes[b]
        ref_o, ref_lse = R.attention_naive(q[b:b + 1].double().numpy(), keys.double().numpy(), values.double().numpy(),
                                           alibi_slopes=None if slope_b is None else slope_b.double().numpy(), **opts)
        plain_o, plain_lse = plain_attention(q[b:b + 1], keys, values, alibi_slopes=slope_b, **opts)
        assert_within(f"out[{b}]", out[b:b + 1], plain_o, ref_o)
        assert_within(f"lse[{b}]", lse[b:b + 1], plain_lse, ref_lse)
    # the new tokens landed in the pool
    for b, n in enumerate(lens):
        for p in range(n, n + new):
            assert torch.equal(pool_kd[table[b, p // block], p % block].cpu(), k_all[b][p])
