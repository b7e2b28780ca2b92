"""The CPU backend (tileattn.cpu): the tiled torch recurrence against the float64 reference.

Calls ``attn_fwd`` / ``attn_bwd`` directly with the contract's layouts (tileattn.contract),
outputs poisoned with NaN first. Low-precision dtypes follow the tolerance rule of
tests/tolerance.py; float64 inputs must match the reference to 1e-12 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tileattn import reference as R
from tileattn.cpu import attn_bwd, attn_fwd
from tileattn.contract import AttnParams

from tolerance import GRAD_FACTOR, assert_within, max_err, plain_attention

NAN = float("nan")


def rnd(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def params(d, causal=False, window=(-1, -1), softcap=0.0, dropout_p=0.0, seed=0):
    left, right = window
    return AttnParams(softmax_scale=d**-0.5, window_left=left, window_right=0 if causal else right,
                      softcap=softcap, dropout_p=dropout_p, dropout_seed=seed)


def ref_options(p: AttnParams, alibi=None):
    return dict(softmax_scale=p.softmax_scale, window_size=(p.window_left, p.window_right), softcap=p.softcap,
                alibi_slopes=None if alibi is None else alibi.double().numpy(), dropout_p=p.dropout_p,
                dropout_seed=p.dropout_seed)


def fwd(q, k, v, p, **kw):
    """attn_fwd into NaN-poisoned out (like q) and lse (B, H, Sq) or packed (H, Tq)."""
    out = torch.full(q.shape[:-1] + (v.shape[-1],), NAN, dtype=q.dtype)
    lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full(lse_shape, NAN, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    attn_fwd(q, k, v, out, lse, params=p, **kw)
    return out, lse


def bwd(dout, q, k, v, out, lse, p, **kw):
    dq, dk, dv = (torch.full_like(x, NAN) for x in (q, k, v))
    attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, params=p, **kw)
    return dq, dk, dv


def assert_close64(name, x, ref):
    """float64 paths: within 1e-12 of the reference, relative to its largest entry."""
    scale = max(1.0, float(np.nanmax(np.abs(np.where(np.isfinite(ref), ref, 0.0)))) if np.size(ref) else 1.0)
    err = max_err(x, ref)
    assert err <= 1e-12 * scale, f"{name}: err {err:.3e} > 1e-12 * {scale:.3g}"


def check_dense(q, k, v, p, alibi=None, grads=True, **kw):
    """Forward (and backward) of the backend against the reference, dtype-aware tolerance."""
    opts = ref_options(p, alibi)
    out, lse = fwd(q, k, v, p, alibi_slopes=alibi, **kw)
    ref_out, ref_lse = R.attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(), **opts)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64).to(q.dtype)
    if grads:
        dq, dk, dv = bwd(dout, q, k, v, out, lse, p, alibi_slopes=alibi, **{x: y for x, y in kw.items() if x != "num_splits"})
        ref_grads = R.attention_naive_grad(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                           dout.double().numpy(), **opts)
    if q.dtype == torch.float64:
        assert_close64("out", out, ref_out)
        assert_close64("lse", lse, ref_lse)
        if grads:
            for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
                assert_close64(name, g, r)
        return out, lse
    qp, kp, vp = (x.detach().clone().requires_grad_(grads) for x in (q, k, v))
    plain_out, plain_lse = plain_attention(qp, kp, vp, softmax_scale=p.softmax_scale, window_size=opts["window_size"],
                                           softcap=p.softcap, alibi_slopes=alibi, dropout_p=p.dropout_p,
                                           dropout_seed=p.dropout_seed)
    assert_within("out", out, plain_out, ref_out)
    assert_within("lse", lse, plain_lse, ref_lse)
    if grads:
        plain_grads = torch.autograd.grad(plain_out, (qp, kp, vp), dout)
        for name, g, pg, r in zip(("dq", "dk", "dv"), (dq, dk, dv), plain_grads, ref_grads):
            assert_within(name, g, pg, r, GRAD_FACTOR)
    return out, lse


# ------------------------------------------------------------------------ dense shapes

DENSE_CASES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
    (1, 1, 1, 1, 1, 40, False),
    (2, 2, 2, 4, 2, 80, True),
    (2, 17, 17, 4, 1, 96, True),  # MQA
    (1, 113, 203, 4, 4, 40, True),  # seqlen_q < seqlen_k
    (1, 203, 113, 8, 2, 64, True),  # seqlen_q > seqlen_k: rows with no key
    (2, 65, 33, 2, 2, 32, False),  # one past a 64-row block, one past a 32-key tile
    (1, 1, 203, 8, 2, 64, False),  # a decoding step
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: "x".join(map(str, c)))
def test_dense_against_reference(case, dtype):
    batch, sq, sk, h, hk, d, causal = case
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q, k, v = rnd(gen, batch, sq, h, d, dtype=dtype), rnd(gen, batch, sk, hk, d, dtype=dtype), rnd(gen, batch, sk, hk, d, dtype=dtype)
    check_dense(q, k, v, params(d, causal), block_m=64, block_n=32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    gen = torch.Generator().manual_seed(5)
    q, k, v = rnd(gen, 2, 97, 4, 64, dtype=dtype), rnd(gen, 2, 130, 2, 64, dtype=dtype), rnd(gen, 2, 130, 2, 64, dtype=dtype)
    out, _ = check_dense(q, k, v, params(64, causal=True), block_m=32, block_n=64)
    assert out.dtype == dtype


def test_long_sequence_default_tiles():
    gen = torch.Generator().manual_seed(1023)
    q, k, v = (rnd(gen, 1, 1023, 2, 64, dtype=torch.float32) for _ in range(3))
    check_dense(q, k, v, params(64, causal=True))


def test_rows_without_keys_are_zero():
    """seqlen_q > seqlen_k, causal: rows 0..Sq-Sk-1 see no key: out 0, lse -inf, dq 0."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = rnd(gen, 1, 40, 2, 16), rnd(gen, 1, 7, 1, 16), rnd(gen, 1, 7, 1, 16)
    p = params(16, causal=True)
    out, lse = fwd(q, k, v, p, block_m=8, block_n=4)
    assert torch.equal(out[:, :33], torch.zeros_like(out[:, :33]))
    assert torch.isneginf(lse[:, :, :33]).all() and torch.isfinite(lse[:, :, 33:]).all()
    dq, dk, dv = bwd(torch.randn(out.shape, generator=gen, dtype=torch.float64), q, k, v, out, lse, p, block_m=8, block_n=4)
    assert torch.equal(dq[:, :33], torch.zeros_like(dq[:, :33]))
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


# -------------------------------------------------------------------- score features


FEATURES = {
    "window": dict(window=(9, 3)),
    "window-left-only": dict(window=(5, -1)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True, causal=True),
    "dropout": dict(dropout_p=0.3, seed=1234, causal=True),
    "everything": dict(window=(20, 2), softcap=2.0, alibi=True, dropout_p=0.2, seed=7),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_score_features(feature, dtype):
    opts = dict(FEATURES[feature])
    gen = torch.Generator().manual_seed(len(feature))
    batch, sq, sk, h, hk, d = 2, 45, 70, 4, 2, 32
    q, k, v = rnd(gen, batch, sq, h, d, dtype=dtype), rnd(gen, batch, sk, hk, d, dtype=dtype), rnd(gen, batch, sk, hk, d, dtype=dtype)
    # ALiBi slopes as the ops layer passes (H,) slopes: (B, H) with a zero batch stride
    alibi = torch.rand(h, generator=gen).float().expand(batch, h) if opts.pop("alibi", False) else None
    check_dense(q, k, v, params(d, **opts), alibi=alibi, block_m=16, block_n=32)


# --------------------------------------------------------------------- invariances


@settings(max_examples=12, deadline=None)
@given(block_m=st.integers(1, 80), block_n=st.integers(1, 80), tile_elems=st.sampled_from([1, 500, 1 << 21]),
       num_splits=st.integers(0, 5))
def test_any_tiling_gives_the_same_answer(block_m, block_n, tile_elems, num_splits):
    gen = torch.Generator().manual_seed(11)
    q, k, v = rnd(gen, 2, 37, 4, 16), rnd(gen, 2, 53, 2, 16), rnd(gen, 2, 53, 2, 16)
    check_dense(q, k, v, params(16, window=(12, 4)), alibi=torch.rand(2, 4, generator=gen).float(),
                block_m=block_m, block_n=block_n, tile_elems=tile_elems, num_splits=num_splits)


@settings(max_examples=15, deadline=None)
@given(sq=st.integers(1, 70), sk=st.integers(1, 70), hk=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([8, 40]), left=st.integers(-1, 30), right=st.integers(-1, 30), seed=st.integers(0, 2**16))
def test_random_shapes(sq, sk, hk, group, d, left, right, seed):
    gen = torch.Generator().manual_seed(seed)
    h = hk * group
    q, k, v = rnd(gen, 1, sq, h, d), rnd(gen, 1, sk, hk, d), rnd(gen, 1, sk, hk, d)
    check_dense(q, k, v, params(d, window=(left, right)), block_m=16, block_n=24)


def test_num_splits_invariance_low_precision():
    gen = torch.Generator().manual_seed(12)
    q, k, v = rnd(gen, 1, 3, 8, 64, dtype=torch.float32), rnd(gen, 1, 300, 2, 64, dtype=torch.float32), rnd(gen, 1, 300, 2, 64, dtype=torch.float32)
    for num_splits in (1, 2, 7):
        check_dense(q, k, v, params(64, causal=True), grads=False, block_n=32, num_splits=num_splits)


def test_gqa_equals_mha_on_repeated_kv():
    gen = torch.Generator().manual_seed(13)
    q, k, v = rnd(gen, 2, 30, 8, 16), rnd(gen, 2, 30, 2, 16), rnd(gen, 2, 30, 2, 16)
    p = params(16, causal=True)
    out_gqa, lse_gqa = fwd(q, k, v, p, block_m=8, block_n=8)
    out_mha, lse_mha = fwd(q, k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2), p, block_m=8, block_n=8)
    torch.testing.assert_close(out_gqa, out_mha, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse_gqa, lse_mha, rtol=1e-13, atol=1e-13)


def test_strided_views():
    """q transposed from (B, H, S, D), k and v sliced out of larger tensors, out a view."""
    gen = torch.Generator().manual_seed(14)
    q = rnd(gen, 2, 4, 50, 32).transpose(1, 2)  # (B, S, H, D), heads-major in memory
    kv = rnd(gen, 2, 61, 2, 2, 40)
    k, v = kv[:, 5:, :, 0, :32], kv[:, 5:, :, 1, 4:36]
    p = params(32, causal=True)
    ref_out, ref_lse = R.attention_naive(q.numpy(), k.numpy(), v.numpy(), **ref_options(p))
    out = torch.full((2, 4, 50, 32), NAN, dtype=torch.float64).transpose(1, 2)
    lse = torch.full((2, 50, 4), NAN, dtype=torch.float64).transpose(1, 2)
    attn_fwd(q, k, v, out, lse, params=p, block_m=16, block_n=16)
    assert_close64("out", out, ref_out)
    assert_close64("lse", lse, ref_lse)
    dout = rnd(gen, 2, 50, 4, 32)
    dq = torch.full((2, 4, 50, 32), NAN, dtype=torch.float64).transpose(1, 2)
    dkv = torch.full((2, 56, 2, 2, 32), NAN, dtype=torch.float64)
    attn_bwd(dout, q, k, v, out, lse, dq, dkv[:, :, :, 0], dkv[:, :, :, 1], params=p, block_m=16, block_n=16)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dkv[:, :, :, 0], dkv[:, :, :, 1]),
                          R.attention_naive_grad(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), **ref_options(p))):
        assert_close64(name, g, r)


def test_backward_is_deterministic():
    gen = torch.Generator().manual_seed(15)
    q, k, v = rnd(gen, 1, 90, 4, 32, dtype=torch.float32), rnd(gen, 1, 90, 1, 32, dtype=torch.float32), rnd(gen, 1, 90, 1, 32, dtype=torch.float32)
    p = params(32, causal=True, dropout_p=0.1, seed=3)
    out, lse = fwd(q, k, v, p, block_m=16, block_n=16)
    dout = rnd(gen, 1, 90, 4, 32, dtype=torch.float32)
    first = bwd(dout, q, k, v, out, lse, p, block_m=16, block_n=16, deterministic=True)
    second = bwd(dout, q, k, v, out, lse, p, block_m=16, block_n=16, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ------------------------------------------------------------------ varlen, KV caches


def cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def varlen_case(gen, lens_q, lens_k, h, hk, d, dtype):
    q = rnd(gen, sum(lens_q), h, d, dtype=dtype)
    k, v = rnd(gen, sum(lens_k), hk, d, dtype=dtype), rnd(gen, sum(lens_k), hk, d, dtype=dtype)
    return q, k, v, rnd(gen, sum(lens_q), h, d, dtype=dtype)


def test_varlen_with_empty_sequence():
    """Packed float64 batch with a zero-length sequence; dropout's bh and ALiBi count b as the
    sequence. Gradients of sequence b come from the dense reference on a batch whose entry b
    is that sequence (so the reference draws the same dropout mask)."""
    gen = torch.Generator().manual_seed(21)
    lens_q, lens_k = [17, 0, 1, 40], [17, 5, 30, 33]
    h, hk, d = 4, 2, 40
    q, k, v, dout = varlen_case(gen, lens_q, lens_k, h, hk, d, torch.float64)
    alibi = torch.rand(h, generator=gen).float().expand(len(lens_q), h)
    p = params(d, causal=True, softcap=3.0, dropout_p=0.25, seed=77)
    kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
              alibi_slopes=alibi, block_m=16, block_n=16)
    out, lse = fwd(q, k, v, p, **kw)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, p, **kw)
    opts = ref_options(p, alibi)
    ref_out, ref_lse = R.attention_varlen(q.numpy(), k.numpy(), v.numpy(), cu(lens_q).numpy(), cu(lens_k).numpy(),
                                          **dict(opts, causal=True, window_size=(-1, -1)))
    assert_close64("out", out, ref_out)
    assert_close64("lse", lse, ref_lse)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b in range(len(lens_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        rep = [np.broadcast_to(x[s].numpy(), (b + 1,) + x[s].shape) for x, s in ((q, sq), (k, sk), (v, sk), (dout, sq))]
        grads = R.attention_naive_grad(*rep, **dict(opts, alibi_slopes=opts["alibi_slopes"][:b + 1]))
        for name, g, r in zip(("dq", "dk", "dv"), (dq[sq], dk[sk], dv[sk]), grads):
            assert_close64(f"{name}[{b}]", g, r[b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_low_precision(dtype):
    gen = torch.Generator().manual_seed(22)
    lens_q, lens_k = [9, 0, 70], [20, 3, 65]
    q, k, v, dout = varlen_case(gen, lens_q, lens_k, 4, 1, 80, dtype)
    p = params(80, causal=True)
    kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), block_m=32, block_n=16)
    out, lse = fwd(q, k, v, p, **kw)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, p, **kw)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b in range(len(lens_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lens_q[b] == 0:  # keys no query sees get zero gradients
            assert not dk[sk].any() and not dv[sk].any()
            continue
        seq = [x[s][None] for x, s in ((q, sq), (k, sk), (v, sk), (dout, sq))]
        ref_out, ref_lse = R.attention_naive(*(x.double().numpy() for x in seq[:3]), **ref_options(p))
        ref_grads = R.attention_naive_grad(*(x.double().numpy() for x in seq), **ref_options(p))
        leaves = [x.detach().clone().requires_grad_() for x in seq[:3]]
        plain_out, plain_lse = plain_attention(*leaves, softmax_scale=p.softmax_scale, causal=True)
        plain_grads = torch.autograd.grad(plain_out, leaves, seq[3])
        assert_within(f"out[{b}]", out[sq][None], plain_out, ref_out)
        assert_within(f"lse[{b}]", lse[:, sq][None], plain_lse, ref_lse)
        for name, g, pg, r in zip(("dq", "dk", "dv"), (dq[sq], dk[sk], dv[sk]), plain_grads, ref_grads):
            assert_within(f"{name}[{b}]", g[None], pg, r, GRAD_FACTOR)


def paged_case(gen, seqlens, block_size, h, hk, d, dtype, extra_blocks=5):
    """A pool larger than needed, the table a random permutation of it, unused slots NaN."""
    pages = [-(-n // block_size) for n in seqlens]
    num_blocks = sum(pages) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((len(seqlens), max(pages) + 2), num_blocks + 100, dtype=torch.int32)  # never read
    k_pool = torch.full((num_blocks, block_size, hk, d), NAN, dtype=dtype)
    v_pool = torch.full((num_blocks, block_size, hk, d), NAN, dtype=dtype)
    dense_k, dense_v, used = [], [], 0
    for b, n in enumerate(seqlens):
        table[b, :pages[b]] = perm[used:used + pages[b]]
        used += pages[b]
        k_b, v_b = rnd(gen, n, hk, d, dtype=dtype), rnd(gen, n, hk, d, dtype=dtype)
        for pos in range(n):
            k_pool[table[b, pos // block_size], pos % block_size] = k_b[pos]
            v_pool[table[b, pos // block_size], pos % block_size] = v_b[pos]
        dense_k.append(k_b)
        dense_v.append(v_b)
    return k_pool, v_pool, table, torch.tensor(seqlens, dtype=torch.int32), dense_k, dense_v


@pytest.mark.parametrize("block_size,num_splits", [(16, 1), (5, 3)])
def test_paged_cache(block_size, num_splits):
    gen = torch.Generator().manual_seed(31 + block_size)
    seqlens, sq, h, hk, d = [37, 1, 80], 3, 8, 2, 40
    k_pool, v_pool, table, used, dense_k, dense_v = paged_case(gen, seqlens, block_size, h, hk, d, torch.float64)
    q = rnd(gen, len(seqlens), sq, h, d)
    alibi = torch.rand(len(seqlens), h, generator=gen).float()
    p = params(d, causal=True, softcap=4.0)
    out, lse = fwd(q, k_pool, v_pool, p, block_table=table, seqused_k=used, alibi_slopes=alibi,
                   num_splits=num_splits, block_m=2, block_n=16)
    ref_out, ref_lse = R.attention_paged(q.numpy(), k_pool.numpy(), v_pool.numpy(), table.numpy(), used.numpy(),
                                         **{x: y for x, y in ref_options(p, alibi).items() if not x.startswith("dropout")})
    assert_close64("out", out, ref_out)
    assert_close64("lse", lse, ref_lse)
    for b in range(len(seqlens)):  # and the same as dense attention over that sequence's keys
        dense = R.attention_naive(q[b:b + 1].numpy(), dense_k[b][None].numpy(), dense_v[b][None].numpy(),
                                  **ref_options(p, alibi[b:b + 1]))
        assert_close64(f"out[{b}]", out[b:b + 1], dense[0])


def test_paged_varlen_queries_fp32():
    """Packed queries (a chunked prefill) over a paged cache, fp32 under the tolerance rule."""
    gen = torch.Generator().manual_seed(32)
    seqlens, lens_q, h, hk, d = [50, 9, 64], [4, 0, 64], 4, 4, 96
    k_pool, v_pool, table, used, dense_k, dense_v = paged_case(gen, seqlens, 8, h, hk, d, torch.float32)
    q = rnd(gen, sum(lens_q), h, d, dtype=torch.float32)
    p = params(d, causal=True)
    out, lse = fwd(q, k_pool, v_pool, p, cu_seqlens_q=cu(lens_q), block_table=table, seqused_k=used, block_n=24)
    cq = cu(lens_q).tolist()
    for b in range(len(seqlens)):
        sq = slice(cq[b], cq[b + 1])
        seq = (q[sq][None], dense_k[b][None], dense_v[b][None])
        ref_out, ref_lse = R.attention_naive(*(x.double().numpy() for x in seq), **ref_options(p))
        plain_out, plain_lse = plain_attention(*seq, softmax_scale=p.softmax_scale, causal=True)
        assert_within(f"out[{b}]", out[sq][None], plain_out, ref_out)
        assert_within(f"lse[{b}]", lse[:, sq][None], plain_lse, ref_lse)


def test_seqused_k_on_a_dense_cache():
    """A dense cache filled up to seqused_k[b]; the slots past it hold NaN."""
    gen = torch.Generator().manual_seed(33)
    used, sq, h, hk, d = [30, 1, 0, 64], 2, 4, 2, 16
    q = rnd(gen, len(used), sq, h, d)
    k, v = rnd(gen, len(used), 64, hk, d), rnd(gen, len(used), 64, hk, d)
    for b, n in enumerate(used):
        k[b, n:], v[b, n:] = NAN, NAN
    p = params(d, causal=True)
    out, lse = fwd(q, k, v, p, seqused_k=torch.tensor(used, dtype=torch.int32), num_splits=2, block_n=16)
    for b, n in enumerate(used):
        ref_out, ref_lse = R.attention_naive(q[b:b + 1].numpy(), k[b:b + 1, :n].numpy(), v[b:b + 1, :n].numpy(),
                                             **ref_options(p))
        assert_close64(f"out[{b}]", out[b:b + 1], ref_out)
        assert_close64(f"lse[{b}]", lse[b:b + 1], ref_lse)


ALIGNED_CASES = {  # keys used per sequence (the others NaN), tokens between sequence ends, options
    "left padded": ([9, 13, 2, 5], 13, dict(causal=True)),
    "window, softcap": ([9, 13, 2, 5], 20, dict(window=(3, 3), causal=True, softcap=2.0)),
    "non-causal": ([4, 1, 7], 8, dict()),
    # a row whose window holds none of its keys: not one tile (rows without keys), per sequence instead
    "a row sees no key": ([9, 1, 6], 10, dict(window=(0, 0))),
}


@pytest.mark.parametrize("case", ALIGNED_CASES)
@pytest.mark.parametrize("sinks", [False, True])
def test_varlen_keys_ending_evenly_spaced(case, sinks):
    """Packed queries (2 per sequence) and keys read through cu_seqlens_k's starts and seqused_k,
    whose ends lie evenly spaced (a left-padded batch read from a cache): one tile over a dense
    view of the keys, each sequence's leading keys left out (they hold NaN, never read). Each
    sequence equals the float64 reference over its own keys."""
    used, pitch, opts = ALIGNED_CASES[case]
    gen = torch.Generator().manual_seed(45)
    nb, sq, h, hk, d = len(used), 2, 4, 2, 16
    longest = max(used)
    tokens = (nb - 1) * pitch + longest + 3  # a few keys past the last sequence's end
    k, v = rnd(gen, tokens, hk, d), rnd(gen, tokens, hk, d)
    ends = [longest + 1 + b * pitch for b in range(nb)]
    starts = [e - n for e, n in zip(ends, used)]
    keep = torch.zeros(tokens, dtype=torch.bool)
    for a, e in zip(starts, ends):
        keep[a:e] = True
    k[~keep], v[~keep] = NAN, NAN
    q = rnd(gen, nb * sq, h, d)
    p = params(d, causal=opts.get("causal", False), window=opts.get("window", (-1, -1)),
               softcap=opts.get("softcap", 0.0))
    sink = torch.randn(h, generator=gen, dtype=torch.float64) if sinks else None
    out, lse = fwd(q, k, v, p, cu_seqlens_q=cu([sq] * nb),
                   cu_seqlens_k=torch.tensor(starts + [tokens], dtype=torch.int32),
                   seqused_k=torch.tensor(used, dtype=torch.int32), max_seqlen_q=sq, max_seqlen_k=longest,
                   learnable_sink=sink)
    for b, (a, e) in enumerate(zip(starts, ends)):
        rows = slice(b * sq, (b + 1) * sq)
        ref_out, ref_lse = R.attention_naive(q[rows][None].numpy(), k[a:e][None].numpy(), v[a:e][None].numpy(),
                                             learnable_sink=None if sink is None else sink.numpy(), **ref_options(p))
        assert_close64(f"out[{b}]", out[rows][None], ref_out)
        assert_close64(f"lse[{b}]", lse[:, rows][None], ref_lse)


# -------------------------------------------------------------------------- gradcheck


class _Attn(torch.autograd.Function):
    """The smallest autograd wiring of the backend, for gradcheck (the real one is tileattn.ops)."""

    @staticmethod
    def forward(ctx, q, k, v, p, alibi, kw):
        out, lse = fwd(q, k, v, p, alibi_slopes=alibi, **kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.p, ctx.alibi, ctx.kw = p, alibi, kw
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, ctx.p, alibi_slopes=ctx.alibi, **ctx.kw)
        return dq, dk, dv, None, None, None


@pytest.mark.parametrize("varlen", [False, True])
def test_gradcheck(varlen):
    gen = torch.Generator().manual_seed(41)
    p = params(4, window=(3, 1), softcap=1.5, dropout_p=0.2, seed=5)
    if varlen:
        shapes, kw = ((7, 2, 4), (8, 1, 4)), dict(cu_seqlens_q=cu([5, 0, 2]), cu_seqlens_k=cu([3, 2, 3]))
    else:
        shapes, kw = ((2, 5, 2, 4), (2, 4, 1, 4)), {}
    alibi = torch.rand(3 if varlen else 2, 2, generator=gen).float()
    q = rnd(gen, *shapes[0]).requires_grad_()
    k, v = rnd(gen, *shapes[1]).requires_grad_(), rnd(gen, *shapes[1]).requires_grad_()
    kw.update(block_m=3, block_n=2)
    assert torch.autograd.gradcheck(lambda q, k, v: _Attn.apply(q, k, v, p, alibi, kw), (q, k, v))


# ------------------------------------------------------------------------- bad input


def test_bad_tile_sizes_raise():
    """The tile sizes are the CPU backend's own arguments (the contract's are checked by tileattn.ops)."""
    gen = torch.Generator().manual_seed(51)
    q, k, v = rnd(gen, 1, 4, 2, 8), rnd(gen, 1, 4, 2, 8), rnd(gen, 1, 4, 2, 8)
    with pytest.raises(ValueError, match="tile sizes"):
        fwd(q, k, v, params(8), block_n=0)
