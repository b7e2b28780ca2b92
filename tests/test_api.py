"""The public flash-attn-compatible functions: results, autograd, torch.compile, bad input.

Backend-level edges live in test_cpu_backend.py / test_triton_*.py; here every call goes
through ``tileattn.flash_attn_*`` as a user's would, on the CPU path and (small shapes) on
the Triton kernels in the interpreter.
"""

import numpy as np
import pytest
import torch

import tileattn
from tileattn import reference as R
from tolerance import GRAD_FACTOR, as_f64, assert_within, plain_attention

def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sq,sk,causal", [(17, 17, True), (5, 23, True), (23, 5, True), (33, 40, False)])
def test_flash_attn_func_matches_reference(device, dtype, sq, sk, causal):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q, k, v = rand(gen, 2, sq, 4, 40, dtype=dtype), rand(gen, 2, sk, 2, 40, dtype=dtype), rand(gen, 2, sk, 2, 40, dtype=dtype)
    out, lse, _ = tileattn.flash_attn_func(q.to(device), k.to(device), v.to(device), causal=causal,
                                           return_attn_probs=True)
    ref_o, ref_lse = R.attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=causal)
    plain_o, plain_lse = plain_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    assert_within("out", out, plain_o, ref_o)
    assert_within("lse", lse, plain_lse, ref_lse)


def test_packed_forms_equal_unpacked(device):
    gen = torch.Generator().manual_seed(1)
    qkv = rand(gen, 2, 19, 3, 4, 32).to(device)
    kv = qkv[:, :, 1:]
    base = tileattn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert torch.equal(tileattn.flash_attn_qkvpacked_func(qkv, causal=True), base)
    assert torch.equal(tileattn.flash_attn_kvpacked_func(qkv[:, :, 0], kv, causal=True), base)


def test_views_are_accepted(device):
    """Transposed and sliced inputs (last dim contiguous or not) give the contiguous answer."""
    gen = torch.Generator().manual_seed(2)
    big = rand(gen, 2, 4, 30, 64).to(device)  # (B, H, S, D) as SDPA users hold it
    q = big.transpose(1, 2)[:, :21, :, :48]  # strided view, last dim contiguous
    k = rand(gen, 2, 48, 21, 4).to(device).permute(0, 2, 3, 1)  # last dim NOT contiguous
    v = rand(gen, 2, 21, 4, 48).to(device)
    out = tileattn.flash_attn_func(q, k, v)
    expect = tileattn.flash_attn_func(q.contiguous(), k.contiguous(), v)
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-6)


def _last_stride_not_one(gen, case):
    """q, k, v whose last stride is not 1 although torch counts them contiguous (``.contiguous()``
    returns them as they are): no elements (a sliced sequence of length 0), or a head dim of 1
    reached by a transpose."""
    if case == "head dim 1":
        return (rand(gen, 2, 5, 1, 4).transpose(2, 3), rand(gen, 2, 7, 1, 2).transpose(2, 3),
                rand(gen, 2, 7, 1, 2).transpose(2, 3))
    sq, sk = (0, 6) if case == "no queries" else (6, 0)
    return (rand(gen, 2, sq, 4, 16)[..., ::2], rand(gen, 2, sk, 2, 16)[..., ::2], rand(gen, 2, sk, 2, 8))


@pytest.mark.parametrize("case", ["no keys", "no queries", "head dim 1"])
def test_views_that_torch_counts_contiguous_train(device, case):
    """The forward and backward take them and match the reference (the Triton backward stopped
    on a bare AssertionError: ``.contiguous()`` had left their last stride as it was)."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = _last_stride_not_one(gen, case)
    assert any(t.stride(-1) != 1 and t.is_contiguous() for t in (q, k, v))
    leaves = [t.to(device).detach().requires_grad_() for t in (q, k, v)]
    out = tileattn.flash_attn_func(*leaves, causal=True)
    dout = rand(gen, *out.shape)
    out.backward(dout.to(device))
    ref_o, _ = R.attention_naive(*(t.double().numpy() for t in (q, k, v)), causal=True)
    ref = R.attention_naive_grad(*(t.double().numpy() for t in (q, k, v, dout)), causal=True)
    for got, r in zip([out] + [t.grad for t in leaves], (ref_o, *ref)):
        assert got.shape == r.shape
        np.testing.assert_allclose(got.detach().cpu().double().numpy(), r, atol=1e-5)


def test_varlen_views_that_torch_counts_contiguous_train(device):
    """A packed batch of no query tokens, q sliced in its last dim: gradients (zero) come back."""
    gen = torch.Generator().manual_seed(13)
    q = rand(gen, 0, 4, 32)[..., ::2].to(device).requires_grad_()
    k, v = (rand(gen, 9, 2, 16).to(device).requires_grad_() for _ in range(2))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in ([0, 0, 0], [0, 4, 9]))
    out = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 5, causal=True)
    (out * 2).sum().backward()
    assert q.grad.shape == q.shape and not k.grad.any() and not v.grad.any()


def test_heads_two_gigaelements_apart_train(device):
    """q with its heads 2**30 + 64 elements apart (the head index x head stride passes 2**31): the
    Triton backward's int32 head offsets wrapped around (a segfault in the interpreter); twice, as
    the second call of a signature takes the prepared launch."""
    gen = torch.Generator().manual_seed(14)
    head_stride, (B, S, H, D) = 2**30 + 64, (1, 9, 3, 16)
    store = torch.empty((H - 1) * head_stride + S * D, device=device)
    q = store.as_strided((B, S, H, D), (S * D, D, head_stride, 1))
    q.copy_(rand(gen, B, S, H, D))
    k, v = rand(gen, B, S, H, D).to(device), rand(gen, B, S, H, D).to(device)
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        dout = rand(gen, B, S, H, D)
        tileattn.flash_attn_func(*leaves, causal=True).backward(dout.to(device))
        ref = R.attention_naive_grad(*(t.detach().cpu().double().numpy() for t in (q, k, v, dout)), causal=True)
        for got, r in zip((t.grad for t in leaves), ref):
            np.testing.assert_allclose(got.cpu().double().numpy(), r, atol=1e-5)


@pytest.mark.parametrize("causal,window,softcap,alibi", [(True, (-1, -1), 0.0, False), (False, (4, 2), 0.0, False),
                                                        (True, (-1, -1), 3.0, True)])
def test_gradients_match_reference(device, causal, window, softcap, alibi):
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16
    q, k, v = rand(gen, 1, 21, 4, 40, dtype=dtype), rand(gen, 1, 29, 2, 40, dtype=dtype), rand(gen, 1, 29, 2, 40, dtype=dtype)
    slopes = torch.rand(4, generator=gen) if alibi else None
    dout = rand(gen, 1, 21, 4, 40, dtype=dtype)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    qd, kd, vd = (t.clone().to(device).requires_grad_() for t in (q, k, v))
    out = tileattn.flash_attn_func(qd, kd, vd, alibi_slopes=None if slopes is None else slopes.to(device), **opts)
    out.backward(dout.to(device))
    ref = R.attention_naive_grad(*(t.double().numpy() for t in (q, k, v, dout)), **opts,
                                 alibi_slopes=None if slopes is None else slopes.double().numpy())
    qp, kp, vp = (t.clone().requires_grad_() for t in (q, k, v))
    plain_attention(qp, kp, vp, alibi_slopes=slopes, **opts)[0].backward(dout)
    for name, fast, plain, r in zip("qkv", (qd.grad, kd.grad, vd.grad), (qp.grad, kp.grad, vp.grad), ref):
        assert_within(f"d{name}", fast, plain, r, factor=GRAD_FACTOR)


def test_gradcheck_float64_cpu(monkeypatch):
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 5, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 7, 1, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 7, 1, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: tileattn.flash_attn_func(a, b, c, causal=True, softcap=2.0),
                                    (q, k, v))


def test_rows_without_keys_have_zero_output_and_gradient(device):
    """Causal with seqlen_q > seqlen_k: the first rows see no key (bottom-right alignment)."""
    gen = torch.Generator().manual_seed(5)
    q = rand(gen, 1, 9, 2, 16).to(device).requires_grad_()
    k = rand(gen, 1, 4, 2, 16).to(device).requires_grad_()
    v = rand(gen, 1, 4, 2, 16).to(device).requires_grad_()
    out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    out.sum().backward()
    assert torch.equal(q.grad[:, :5], torch.zeros_like(q.grad[:, :5]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_dropout_matches_reference_with_same_mask(device):
    gen = torch.Generator().manual_seed(6)
    q, k, v = rand(gen, 2, 13, 2, 16), rand(gen, 2, 17, 2, 16), rand(gen, 2, 17, 2, 16)
    torch.manual_seed(123)
    out, lse, probs = tileattn.flash_attn_func(q.to(device), k.to(device), v.to(device), dropout_p=0.25, causal=True,
                                               return_attn_probs=True)
    out, probs = out.cpu(), probs.cpu()
    torch.manual_seed(123)
    seed = tileattn.ops.attention.draw_dropout_seed(0.25, torch.device(device))  # the inputs' generator
    ref_o, _ = R.attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True,
                                 dropout_p=0.25, dropout_seed=seed)
    plain_o, _ = plain_attention(q, k, v, causal=True, dropout_p=0.25, dropout_seed=seed)
    assert_within("out", out, plain_o, ref_o)
    kept = (probs > 0).sum() / (probs != 0).sum()
    assert 0.6 < float(kept) < 0.9  # ~0.75 of the visible entries survive
    # the probabilities shown are the ones used: (kept P) / (1 - p) @ V reproduces out
    again = (probs.clamp(min=0) / 0.75) @ v.transpose(1, 2)
    torch.testing.assert_close(again.transpose(1, 2), out, rtol=1e-4, atol=1e-5)


def test_torch_compile_fullgraph_forward_and_backward(monkeypatch):
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(7)

    def block(x, w):
        qkv = (x @ w).view(x.shape[0], x.shape[1], 3, 2, 8)
        return tileattn.flash_attn_qkvpacked_func(qkv, causal=True).sum()

    x = torch.randn(2, 11, 16, generator=gen)
    w = torch.randn(16, 48, generator=gen, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss = compiled(x, w)
    loss.backward()
    w_grad, w.grad = w.grad.clone(), None
    block(x, w).backward()
    torch.testing.assert_close(loss, block(x, w))
    torch.testing.assert_close(w_grad, w.grad)


def test_merge_states_is_exact():
    gen = torch.Generator().manual_seed(8)
    q, k, v = rand(gen, 1, 6, 2, 8), rand(gen, 1, 20, 2, 8), rand(gen, 1, 20, 2, 8)
    full, lse = tileattn.flash_attn_with_kvcache(q, k, v, return_softmax_lse=True)
    a, lse_a = tileattn.flash_attn_with_kvcache(q, k[:, :7], v[:, :7], return_softmax_lse=True)
    b, lse_b = tileattn.flash_attn_with_kvcache(q, k[:, 7:], v[:, 7:], return_softmax_lse=True)
    o, l = tileattn.merge_states(a, lse_a, b, lse_b)
    torch.testing.assert_close(o, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l, lse, rtol=1e-5, atol=1e-6)
    empty = torch.full_like(lse_a, float("-inf"))  # a state that saw no key: (0, -inf)
    o2, l2 = tileattn.merge_states(a, lse_a, torch.zeros_like(a), empty)
    assert torch.equal(o2, a) and torch.equal(l2, lse_a)
    o3, l3 = tileattn.merge_states(torch.zeros_like(a), empty, torch.zeros_like(a), empty)
    assert torch.isneginf(l3).all() and torch.equal(o3, torch.zeros_like(a))


@pytest.mark.parametrize("merge", ["merge_states", "merge_many"])
def test_merge_gradients_of_rows_empty_in_every_part(merge):
    """A row that no part saw (lse -inf in each) has zero gradients, as the rows that some part saw
    have theirs (against the float64 gradient of the same merge written out per row): the
    log-sum-exp of -inf alone gave NaN to every part's lse, even from a loss on o alone."""
    gen = torch.Generator().manual_seed(9)
    o_a, o_b = rand(gen, 2, 3, 2, 4), rand(gen, 2, 3, 2, 4)
    lse_a, lse_b = rand(gen, 2, 2, 3), rand(gen, 2, 2, 3)
    lse_a[0, 1, 2] = lse_b[0, 1, 2] = float("-inf")  # empty in both: merged (0, -inf)
    lse_a[1, 0, 0] = float("-inf")  # empty in one part only
    o_a[0, 2, 1] = o_b[0, 2, 1] = 0.0
    dout, dlse = rand(gen, 2, 3, 2, 4), rand(gen, 2, 2, 3)
    leaves = [t.clone().requires_grad_(True) for t in (o_a, lse_a, o_b, lse_b)]
    if merge == "merge_states":
        o, lse = tileattn.merge_states(*leaves)
    else:
        o, lse = tileattn.merge_many(leaves[0::2], leaves[1::2])
    assert torch.isneginf(lse[0, 1, 2]) and torch.equal(o[0, 2, 1], torch.zeros(4))
    ((o * dout).sum() + torch.where(torch.isneginf(lse), 0.0, lse * dlse).sum()).backward()
    # float64: per row, lse = log(e^a + e^b) over the parts that saw a key, o their weighted sum
    ref = [t.double().clone().requires_grad_(True) for t in (o_a, lse_a, o_b, lse_b)]
    seen = ~(torch.isneginf(lse_a) & torch.isneginf(lse_b))
    parts = [torch.where(seen, ref[i], 0.0) for i in (1, 3)]  # the empty row left out of the graph
    lse_ref = torch.logaddexp(*parts)
    w_a, w_b = (torch.exp(p - lse_ref).where(seen, 0.0).transpose(1, 2)[..., None] for p in parts)
    o_ref = w_a * ref[0] + w_b * ref[2]
    ((o_ref * dout.double()).sum() + (lse_ref * dlse.double()).where(seen, 0.0).sum()).backward()
    for name, leaf, r in zip(("o_a", "lse_a", "o_b", "lse_b"), leaves, ref):
        assert torch.isfinite(leaf.grad).all(), f"{name}: gradient not finite"
        torch.testing.assert_close(leaf.grad.double(), r.grad, rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------ bad input


def _qkv(dtype=torch.float16, sq=8, sk=8, h=4, hk=2, d=32):
    return torch.randn(2, sq, h, d).to(dtype), torch.randn(2, sk, hk, d).to(dtype), torch.randn(2, sk, hk, d).to(dtype)


@pytest.mark.parametrize("make,error,words", [
    (lambda: (*_qkv()[:2], _qkv(torch.float32)[2]), TypeError, "share a dtype"),
    (lambda: tuple(t.to(torch.int32) for t in _qkv()), TypeError, "not supported"),
    (lambda: (_qkv()[0][0], *_qkv()[1:]), ValueError, "4-D"),
    (lambda: _qkv(h=3, hk=2), ValueError, "multiple"),
    (lambda: _qkv(d=600), ValueError, "headdim"),
    (lambda: (_qkv()[0], _qkv(sk=9)[1], _qkv()[2]), ValueError, "one shape"),
    (lambda: (_qkv()[0][:1], *_qkv()[1:]), ValueError, "batch"),
    (lambda: (_qkv()[0], "k", _qkv()[2]), TypeError, "torch.Tensor"),
])
def test_bad_tensors_raise(make, error, words):
    with pytest.raises(error, match=words):
        tileattn.flash_attn_func(*make())


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=4), TypeError, "window_size"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "float32"),
    (dict(softmax_scale=torch.tensor(0.1)), TypeError, "softmax_scale"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(deterministic="false"), TypeError, "deterministic must be a bool"),
    (dict(return_attn_probs=1), TypeError, "return_attn_probs must be a bool"),
])
def test_bad_options_raise(kwargs, error, words):
    with pytest.raises(error, match=words):
        tileattn.flash_attn_func(*_qkv(), **kwargs)


def test_misspelt_option_raises():
    with pytest.raises(TypeError):
        tileattn.flash_attn_func(*_qkv(), casual=True)


def test_bad_backend_variable_raises(monkeypatch):
    monkeypatch.setenv("TILEATTN_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="TILEATTN_BACKEND"):
        tileattn.flash_attn_func(*_qkv())


def test_float64_is_refused_on_the_triton_path(monkeypatch):
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    with pytest.raises(TypeError, match="not supported"):
        tileattn.flash_attn_func(*_qkv(torch.float64))


def test_reference_and_fast_agree_in_float64_on_cpu(monkeypatch):
    """float64 on the CPU path compares directly: within 1e-12 relative."""
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    q, k, v = _qkv(torch.float64, sq=31, sk=45)
    out = tileattn.flash_attn_func(q, k, v, causal=True, window_size=(9, -1))
    ref, _ = R.attention_naive(q.numpy(), k.numpy(), v.numpy(), causal=True, window_size=(9, -1))
    assert np.abs(out.numpy() - ref).max() <= 1e-12 * np.abs(ref).max()
    assert as_f64(out).shape == ref.shape


def test_backward_grid_limit_is_checked_before_the_forward():
    """Batch past 65535 (an axis of the backward's grid) is refused up front when a gradient may be
    asked for; without one the forward runs."""
    q = torch.randn(65536, 1, 1, 8)
    with pytest.raises(ValueError, match="batch 65536"):
        tileattn.flash_attn_func(q.clone().requires_grad_(), q, q)
    assert tileattn.flash_attn_func(q, q, q).shape == q.shape


@pytest.mark.parametrize("paged", [False, True])
def test_torch_compile_fullgraph_kvcache_append_and_varlen(monkeypatch, paged):
    """torch.compile(fullgraph=True) traces flash_attn_with_kvcache with an append (contiguous and
    paged, rotary, and MLA's latent view v_cache = k_cache[..., :dv]) and flash_attn_varlen_func
    without a graph break, with eager's outputs and cache writes."""
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(17)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    q, k, v = torch.randn(2, 3, 4, 24, generator=gen), torch.randn(2, 3, 2, 24, generator=gen), \
        torch.randn(2, 3, 2, 24, generator=gen)
    angles = torch.rand(32, 8, generator=gen) * 6.3
    table = torch.randperm(10, generator=gen)[:8].view(2, 4).to(torch.int32) if paged else None
    cache = torch.randn(*((10, 4) if paged else (2, 16)), 2, 24, generator=gen)

    def step(q, k_cache, v_cache, k, v):
        return tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, block_table=table,
                                                rotary_cos=angles.cos(), rotary_sin=angles.sin(), causal=True,
                                                return_softmax_lse=True)

    def latent(q, k_cache, k):  # v_cache and v: the keys' first 16 entries
        return tileattn.flash_attn_with_kvcache(q, k_cache, k_cache[..., :16], k=k, v=k[..., :16],
                                                cache_seqlens=lens, block_table=table, causal=True)

    caches = [(cache.clone(), cache.flip(0).clone()) for _ in range(2)]
    (eo, el), (co, cl) = step(q, *caches[0], k, v), torch.compile(step, fullgraph=True, backend="aot_eager")(
        q, *caches[1], k, v)
    torch.testing.assert_close(co, eo, rtol=0, atol=0)
    torch.testing.assert_close(cl, el, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(*caches)) and not torch.equal(caches[0][0], cache)
    kc_e, kc_c = cache.clone(), cache.clone()
    eo = latent(q, kc_e, k)
    co = torch.compile(latent, fullgraph=True, backend="aot_eager")(q, kc_c, k)
    torch.testing.assert_close(co, eo, rtol=0, atol=0)
    assert torch.equal(kc_c, kc_e) and not torch.equal(kc_e, cache)

    cu_q, cu_k = torch.tensor([0, 3, 3, 10], dtype=torch.int32), torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    qv = torch.randn(10, 4, 24, generator=gen, requires_grad=True)
    kv = torch.randn(12, 2, 24, generator=gen, requires_grad=True)
    vv = torch.randn(12, 2, 24, generator=gen, requires_grad=True)

    def varlen(q, k, v):
        return tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, causal=True)

    eo, co = varlen(qv, kv, vv), torch.compile(varlen, fullgraph=True, backend="aot_eager")(qv, kv, vv)
    torch.testing.assert_close(co, eo, rtol=0, atol=0)
    grad = torch.randn_like(eo)
    for a, b in zip(torch.autograd.grad(co, (qv, kv, vv), grad), torch.autograd.grad(eo, (qv, kv, vv), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
