"""Learnable attention sinks (issue #18 item 1): the reference first, then every path.

A sink is one logit per query head that joins each row's softmax denominator without a value
row (gpt-oss, flash-attn 4's ``learnable_sink``). The float64 reference defines it; plain torch
attention with the sink as an extra softmax column (as transformers' gpt-oss eager attention)
is an independent check of the reference and, in the inputs' dtype, the error budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tileattn
from tileattn import reference as R
from tolerance import GRAD_FACTOR, as_f64, assert_within, plain_attention


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def sinks(gen, nheads, spread=2.0):
    """Sink logits of both signs, large enough to take a real share of each row."""
    return (torch.randn(nheads, generator=gen) * spread + 1.0).float()


def np64(*tensors):
    return [None if t is None else t.detach().cpu().double().numpy() for t in tensors]


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("sq,sk,causal,window", [(7, 19, True, (-1, -1)), (19, 7, True, (-1, -1)),
                                                 (13, 13, False, (3, 2)), (9, 30, False, (-1, -1))])
def test_reference_algorithms_agree_with_sinks(sq, sk, causal, window):
    """naive, tiled, split (3 splits), paged, varlen and plain float64 torch give one answer."""
    gen = torch.Generator().manual_seed(sq * 31 + sk)
    q, k, v = rand(gen, 2, sq, 4, 8), rand(gen, 2, sk, 2, 8), rand(gen, 2, sk, 2, 8)
    sink = sinks(gen, 4)
    opts = dict(causal=causal, window_size=window, learnable_sink=sink.numpy())
    qn, kn, vn = np64(q, k, v)
    out, lse = R.attention_naive(qn, kn, vn, **opts)
    p_out, p_lse = plain_attention(q.double(), k.double(), v.double(), causal=causal, window_size=window,
                                   learnable_sink=sink.double())
    np.testing.assert_allclose(out, p_out.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, p_lse.numpy(), rtol=1e-12, atol=1e-12)
    for other in (R.attention_tiled(qn, kn, vn, block_m=4, block_n=5, **opts),
                  R.attention_split(qn, kn, vn, num_splits=3, block_n=4, **opts)):
        np.testing.assert_allclose(other[0], out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(other[1], lse, rtol=1e-12, atol=1e-12)
    table = np.arange(2 * 6).reshape(2, 6)[:, ::-1].copy()  # pages of 5 keys, reversed order
    pools = [np.full((12, 5, 2, 8), np.nan) for _ in range(2)]
    for pool, x in zip(pools, (kn, vn)):
        for b in range(2):
            for page in range(-(-sk // 5)):
                rows = x[b, page * 5:(page + 1) * 5]
                pool[table[b, page], :len(rows)] = rows
    paged = R.attention_paged(qn, *pools, table, np.array([sk, sk]), **opts)
    np.testing.assert_allclose(paged[0], out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(paged[1], lse, rtol=1e-12, atol=1e-12)
    cu_q, cu_k = np.array([0, sq, 2 * sq]), np.array([0, sk, 2 * sk])
    v_out, v_lse = R.attention_varlen(qn.reshape(-1, 4, 8), kn.reshape(-1, 2, 8), vn.reshape(-1, 2, 8), cu_q, cu_k,
                                      **opts)
    np.testing.assert_allclose(v_out.reshape(out.shape), out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(v_lse.reshape(4, 2, sq).transpose(1, 0, 2), lse, rtol=1e-12, atol=1e-12)


def test_reference_fully_masked_rows_give_all_probability_to_the_sink():
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = rand(gen, 1, 9, 2, 8), rand(gen, 1, 4, 2, 8), rand(gen, 1, 4, 2, 8), rand(gen, 1, 9, 2, 8)
    sink = sinks(gen, 2).numpy()
    out, lse = R.attention_naive(*np64(q, k, v), causal=True, learnable_sink=sink)
    masked = slice(0, 5)  # rows 0..4 of 9 see none of the 4 keys (bottom-right causal)
    assert np.all(out[:, masked] == 0.0)
    assert np.all(lse[:, :, masked] == sink[None, :, None])
    grads = R.attention_naive_grad(*np64(q, k, v, dout), causal=True, learnable_sink=sink)
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(grads[0][:, masked] == 0.0)
    empty, _ = R.attention_varlen(*np64(q[0], k[0, :0], v[0, :0]), np.array([0, 9]), np.array([0, 0]),
                                  learnable_sink=sink)
    assert np.all(empty == 0.0) and np.all(_ == sink[:, None])


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (2, 1), 3.0)])
def test_reference_gradients_by_finite_differences(causal, window, softcap):
    """dq, dk, dv, dsink of sum(out * dout) + sum(lse * dlse) against central differences in float64,
    with rows that see no key (seqlen_q > seqlen_k, causal)."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 6, 4, 5)), rng.standard_normal((1, 4, 2, 5)), rng.standard_normal((1, 4, 2, 5))
    dout, dlse, sink = rng.standard_normal((1, 6, 4, 5)), rng.standard_normal((1, 4, 6)), rng.standard_normal(4)
    opts = dict(causal=causal, window_size=window, softcap=softcap)

    def loss(q_, k_, v_, s_):
        out, lse = R.attention_naive(q_, k_, v_, learnable_sink=s_, **opts)
        return (out * dout).sum() + (lse * dlse).sum()

    grads = R.attention_naive_grad(q, k, v, dout, dlse=dlse, learnable_sink=sink, **opts)
    inputs = [q, k, v, sink]
    eps = 1e-6
    for which, grad in enumerate(grads):
        x = inputs[which]
        for idx in list(np.ndindex(x.shape))[::7] + [np.unravel_index(np.abs(grad).argmax(), x.shape)]:
            plus, minus = [a.copy() for a in inputs], [a.copy() for a in inputs]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert abs(fd - grad[idx]) <= 1e-7 * max(1.0, abs(fd)), (which, idx, fd, grad[idx])


def test_reference_gradients_equal_float64_autograd():
    """The same gradients from torch float64 autograd of plain attention with the sink column."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = rand(gen, 2, 11, 4, 8).double(), rand(gen, 2, 7, 2, 8).double(), rand(gen, 2, 7, 2, 8).double()
    dout, dlse, sink = rand(gen, 2, 11, 4, 8).double(), rand(gen, 2, 4, 11).double(), sinks(gen, 4).double()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    out, lse = plain_attention(*leaves[:3], causal=True, window_size=(4, -1), learnable_sink=leaves[3])
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    ref = R.attention_naive_grad(*np64(q, k, v, dout), dlse=dlse.numpy(), causal=True, window_size=(4, -1),
                                 learnable_sink=sink.numpy())
    for r, leaf in zip(ref, leaves):
        np.testing.assert_allclose(r, leaf.grad.numpy(), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------- the public functions


def _check_grads(fast, plain, ref, names):
    for name, f, p, r in zip(names, fast, plain, ref):
        assert_within(name, f, p, r, factor=GRAD_FACTOR)


# float16, not bfloat16: Triton 3.6's interpreter truncates fp32 -> bf16 stores (round toward zero), which
# doubles the output's rounding error, and d sink, a sum over every row of rowsum(dO * O), inherits it.
@pytest.mark.parametrize("dtype,sq,sk,causal,window", [
    (torch.float32, 37, 21, True, (-1, -1)), (torch.float16, 37, 21, True, (-1, -1)),
    (torch.float16, 29, 45, False, (8, 0)), (torch.float32, 33, 33, True, (5, -1))])
def test_flash_attn_func_with_sinks(device, dtype, sq, sk, causal, window):
    """Forward and backward (dq, dk, dv, dsink), sinks with a window and GQA (4 over 2 heads);
    (37, 21) causal has rows that see no key: out 0, lse = sink, finite gradients."""
    gen = torch.Generator().manual_seed(sq + 7 * sk)
    q, k, v = rand(gen, 2, sq, 4, 40, dtype=dtype), rand(gen, 2, sk, 2, 40, dtype=dtype), rand(gen, 2, sk, 2, 40, dtype=dtype)
    dout, sink = rand(gen, 2, sq, 4, 40, dtype=dtype), sinks(gen, 4)
    opts = dict(causal=causal, window_size=window)
    leaves = [t.clone().to(device).requires_grad_(True) for t in (q, k, v, sink)]
    out, lse, _ = tileattn.flash_attn_func(*leaves[:3], learnable_sink=leaves[3], return_attn_probs=True, **opts)
    out.backward(dout.to(device))
    ref_o, ref_lse = R.attention_naive(*np64(q, k, v), learnable_sink=sink.numpy(), **opts)
    ref_g = R.attention_naive_grad(*np64(q, k, v, dout), learnable_sink=sink.numpy(), **opts)
    plain_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    p_o, p_lse = plain_attention(*plain_leaves[:3], learnable_sink=plain_leaves[3], **opts)
    p_o.backward(dout)
    assert_within("out", out, p_o, ref_o)
    assert_within("lse", lse, p_lse, ref_lse)
    _check_grads([t.grad for t in leaves], [t.grad for t in plain_leaves], ref_g, ("dq", "dk", "dv", "dsink"))
    if causal and sq > sk:
        assert torch.all(out[:, :sq - sk].cpu() == 0)
        torch.testing.assert_close(lse[:, :, 0].detach().cpu(), sink.expand(2, 4), rtol=1e-6, atol=1e-6)


def test_varlen_with_sinks(device):
    """Packed sequences, one of them with no key at all, forward and backward."""
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k = [7, 5, 19], [13, 0, 11]
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q, k, v = rand(gen, 31, 4, 16), rand(gen, 24, 2, 16), rand(gen, 24, 2, 16)
    dout, sink = rand(gen, 31, 4, 16), sinks(gen, 4)
    leaves = [t.clone().to(device).requires_grad_(True) for t in (q, k, v, sink)]
    out, lse, _ = tileattn.flash_attn_varlen_func(*leaves[:3], cu_q.to(device), cu_k.to(device), 19, 13, causal=True,
                                                  learnable_sink=leaves[3], return_attn_probs=True)
    out.backward(dout.to(device))
    ref_o, ref_lse = R.attention_varlen(*np64(q, k, v), cu_q.numpy(), cu_k.numpy(), causal=True,
                                        learnable_sink=sink.numpy())
    np.testing.assert_allclose(out.detach().cpu().numpy(), ref_o, atol=2e-5)
    np.testing.assert_allclose(lse.detach().cpu().numpy(), ref_lse, atol=2e-5)
    dsink = np.zeros(4)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        g = R.attention_naive_grad(*np64(q[None, qs], k[None, ks], v[None, ks], dout[None, qs]), causal=True,
                                   learnable_sink=sink.numpy())
        for got, want in zip((leaves[0].grad[qs], leaves[1].grad[ks], leaves[2].grad[ks]), g[:3]):
            np.testing.assert_allclose(got.cpu().numpy(), want[0], atol=5e-5)
        dsink += g[3]
    np.testing.assert_allclose(leaves[3].grad.cpu().numpy(), dsink, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_with_sinks_enters_once_per_row(device, paged, num_splits):
    """Decoding with sinks, the keys split in 1 or 3 ranges: the sink joins each row once (in the
    combine), so any split count gives the reference; a sequence with an empty cache gets lse = sink."""
    gen = torch.Generator().manual_seed(6 + num_splits)
    batch, cap, hk, d = 3, 40, 2, 32
    q = rand(gen, batch, 2, 4, d)
    k_full, v_full = rand(gen, batch, cap, hk, d), rand(gen, batch, cap, hk, d)
    seqlens = torch.tensor([0, 17, 40], dtype=torch.int32)
    sink = sinks(gen, 4)
    if paged:
        block = 8
        table = torch.randperm(batch * cap // block + 3, generator=gen)[:batch * cap // block].view(batch, -1)
        k_cache = torch.full((batch * cap // block + 3, block, hk, d), float("nan"))
        v_cache = k_cache.clone()
        for b in range(batch):
            for p in range(cap // block):
                k_cache[table[b, p]] = k_full[b, p * block:(p + 1) * block]
                v_cache[table[b, p]] = v_full[b, p * block:(p + 1) * block]
        table = table.to(torch.int32).to(device)
    else:
        k_cache, v_cache, table = k_full.clone(), v_full.clone(), None
    out, lse = tileattn.flash_attn_with_kvcache(q.to(device), k_cache.to(device), v_cache.to(device),
                                                cache_seqlens=seqlens.to(device), block_table=table, causal=True,
                                                num_splits=num_splits, learnable_sink=sink.to(device),
                                                return_softmax_lse=True)
    for b in range(batch):
        n = int(seqlens[b])
        ref_o, ref_lse = R.attention_naive(*np64(q[b:b + 1], k_full[b:b + 1, :n], v_full[b:b + 1, :n]), causal=True,
                                           learnable_sink=sink.numpy())
        np.testing.assert_allclose(out[b].cpu().numpy(), ref_o[0], atol=2e-5)
        np.testing.assert_allclose(lse[b].cpu().numpy(), ref_lse[0], atol=2e-5)
    torch.testing.assert_close(lse[0].cpu(), sink[:, None].expand(4, 2), rtol=1e-6, atol=1e-6)
    assert torch.all(out[0].cpu() == 0)


@pytest.mark.parametrize("bad,error,words", [
    (lambda q: torch.zeros(3), ValueError, "shape (4,)"),
    (lambda q: torch.zeros(4, dtype=torch.float16), TypeError, "float32"),
    (lambda q: [0.0] * 4, TypeError, "torch.Tensor"),
])
def test_bad_sinks_raise_before_the_cache_changes(bad, error, words):
    gen = torch.Generator().manual_seed(8)
    q, k_cache, v_cache = rand(gen, 1, 1, 4, 16), rand(gen, 1, 10, 2, 16), rand(gen, 1, 10, 2, 16)
    before = k_cache.clone()
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=rand(gen, 1, 1, 2, 16), v=rand(gen, 1, 1, 2, 16),
                                         cache_seqlens=3, learnable_sink=bad(q))
    assert torch.equal(k_cache, before)
    with pytest.raises(error):
        tileattn.flash_attn_func(q, k_cache, v_cache, learnable_sink=bad(q))


def test_merge_sink_after_merging_partial_states():
    """Partial attentions over disjoint keys, merged, then the sink merged once: the attention with
    the sink, values and gradients (d sink included)."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = rand(gen, 1, 6, 2, 16), rand(gen, 1, 30, 2, 16), rand(gen, 1, 30, 2, 16), rand(gen, 1, 6, 2, 16)
    sink = sinks(gen, 2)
    whole = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    out, lse, _ = tileattn.flash_attn_func(*whole[:3], learnable_sink=whole[3], return_attn_probs=True)
    ((out * dout).sum() + lse.sum()).backward()
    parts = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    states = [tileattn.flash_attn_func(parts[0], parts[1][:, a:b], parts[2][:, a:b], return_attn_probs=True)[:2]
              for a, b in ((0, 11), (11, 30))]
    o_m, lse_m = tileattn.merge_sink(*tileattn.merge_many([s[0] for s in states], [s[1] for s in states]), parts[3])
    ((o_m * dout).sum() + lse_m.sum()).backward()
    torch.testing.assert_close(o_m, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_m, lse, rtol=1e-5, atol=1e-6)
    for a, b in zip(parts, whole):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("backend", ["cpu", "triton"])  # tileattn.cpu, tileattn.gpu (the interpreter without a GPU)
def test_backends_with_sinks_dropout_and_dlse(backend):
    """The backend contract directly (explicit dropout seed): dropout, sinks and a gradient on the LSE
    together, forward and backward, outputs poisoned with NaN, against the reference."""
    import importlib

    from tileattn.contract import AttnParams

    mod = importlib.import_module("tileattn.cpu" if backend == "cpu" else "tileattn.gpu")
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(10)
    q, k, v, dout = rand(gen, 1, 21, 2, 16), rand(gen, 1, 19, 1, 16), rand(gen, 1, 19, 1, 16), rand(gen, 1, 21, 2, 16)
    dlse, sink = rand(gen, 1, 2, 21), sinks(gen, 2)
    params = AttnParams(16**-0.5, -1, 0, 0.0, 0.3, 1234)
    opts = dict(causal=True, dropout_p=0.3, dropout_seed=1234, learnable_sink=sink.numpy())
    ref_o, ref_lse = R.attention_naive(*np64(q, k, v), **opts)
    ref_g = R.attention_naive_grad(*np64(q, k, v, dout), dlse=dlse.numpy(), **opts)
    q, k, v, dout, dlse, sink = (t.to(dev) for t in (q, k, v, dout, dlse, sink))
    out, lse = torch.full_like(q, float("nan")), torch.full((1, 2, 21), float("nan"), device=dev)
    mod.attn_fwd(q, k, v, out, lse, params=params, learnable_sink=sink)
    np.testing.assert_allclose(out.cpu().numpy(), ref_o, atol=2e-6)
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=2e-6)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v, sink)]
    mod.attn_bwd(dout, q, k, v, out, lse, *grads[:3], params=params, dlse=dlse, learnable_sink=sink, dsink=grads[3])
    for got, want in zip(grads, ref_g):
        np.testing.assert_allclose(got.cpu().numpy(), want, atol=5e-6)
