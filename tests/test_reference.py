"""The float64 reference checks itself: every algorithm against the textbook one, exact identities,
the NaN of an unguarded fully-masked tile, the merge of states, paged and packed layouts, the
gradient against finite differences and the dropout hash.

float64 paths agree within 1e-12 relative; -inf (a row that sees no key)
must be -inf in both, NaN never.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tileattn.dropout_mask import GOLDEN, M32, keep_mask
from tileattn.reference import (
    attention_naive,
    attention_naive_grad,
    attention_paged,
    attention_split,
    attention_tiled,
    attention_varlen,
    merge_many,
    merge_states,
    visible,
)

LENGTHS = [1, 2, 3, 5, 7, 13, 17, 31]


def assert_close64(x, ref, what="out"):
    """Same -inf entries, no NaN, finite entries within 1e-12 relative to the largest."""
    x, ref = np.asarray(x), np.asarray(ref)
    assert x.shape == ref.shape, f"{what}: shape {x.shape} != {ref.shape}"
    assert not np.isnan(x).any(), f"{what}: NaN"
    inf = np.isinf(ref)
    assert np.array_equal(x[inf], ref[inf]) and np.isfinite(x[~inf]).all(), f"{what}: infinities differ"
    if (~inf).any():
        err = np.abs(x[~inf] - ref[~inf]).max()
        bound = 1e-12 * max(1.0, np.abs(ref[~inf]).max())
        assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


def assert_state(got, ref):
    assert_close64(got[0], ref[0], "out")
    assert_close64(got[1], ref[1], "lse")


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim):
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    return q, k, v


def to_paged(rng, k, v, block_size, seq_lens, extra_blocks=3):
    """Scatter k, v into pools of pages picked by a random permutation of a larger pool;
    every slot not holding a key is NaN, so reading one shows up."""
    batch, _, nheads_k, headdim = k.shape
    pages = [-(-int(n) // block_size) for n in seq_lens]
    max_pages = max(max(pages), 1)
    num_blocks = batch * max_pages + extra_blocks
    order = rng.permutation(num_blocks)
    k_pool = np.full((num_blocks, block_size, nheads_k, headdim), np.nan)
    v_pool = np.full_like(k_pool, np.nan)
    table = np.full((batch, max_pages), -1, dtype=np.int32)
    for b in range(batch):
        for p in range(pages[b]):
            blk = order[b * max_pages + p]
            table[b, p] = blk
            lo, hi = p * block_size, min((p + 1) * block_size, int(seq_lens[b]))
            k_pool[blk, : hi - lo] = k[b, lo:hi]
            v_pool[blk, : hi - lo] = v[b, lo:hi]
    return k_pool, v_pool, table


@st.composite
def problems(draw):
    """A random attention problem: shapes, masks, score modifications and dropout."""
    sq, sk = draw(st.sampled_from(LENGTHS)), draw(st.sampled_from(LENGTHS))
    nheads_k, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    mask = draw(st.sampled_from(["none", "causal", "window"]))
    window = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6))) if mask == "window" else (-1, -1)
    return {
        "shape": (draw(st.integers(1, 2)), sq, sk, nheads_k * group, nheads_k, draw(st.sampled_from([1, 3, 8]))),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "options": {
            "causal": mask == "causal",
            "window_size": window,
            "softcap": draw(st.sampled_from([0.0, 0.0, 1.5])),
            "softmax_scale": draw(st.sampled_from([None, 0.7])),
        },
        "alibi": draw(st.booleans()),
        "dropout_p": draw(st.sampled_from([0.0, 0.0, 0.3])),
        "block_m": draw(st.integers(1, sq + 1)),
        "block_n": draw(st.integers(1, sk + 1)),
        "num_splits": draw(st.integers(1, sk + 1)),
        "page": draw(st.integers(1, sk + 1)),
    }


@settings(max_examples=300, deadline=None)
@given(problems())
def test_algorithms_agree(prob):
    """tiled, split-KV, paged and packed equal the naive softmax(q k^T) v for any tile size."""
    rng = np.random.default_rng(prob["seed"])
    batch, sq, sk, nheads, nheads_k, headdim = prob["shape"]
    q, k, v = random_qkv(rng, batch, sq, sk, nheads, nheads_k, headdim)
    opts = dict(prob["options"])
    if prob["alibi"]:
        opts["alibi_slopes"] = rng.uniform(0.05, 1.0, (batch, nheads))
    drop = {"dropout_p": prob["dropout_p"], "dropout_seed": prob["seed"]}
    ref = attention_naive(q, k, v, **opts, **drop)

    assert_state(attention_tiled(q, k, v, block_m=prob["block_m"], block_n=prob["block_n"], **opts, **drop), ref)
    assert_state(attention_split(q, k, v, num_splits=prob["num_splits"], block_n=prob["block_n"], **opts, **drop), ref)
    # Packed sequences of equal length number (b, h) as the dense batch does, dropout included.
    cu = np.arange(batch + 1, dtype=np.int32)
    out, lse = attention_varlen(q.reshape(-1, nheads, headdim), k.reshape(-1, nheads_k, headdim),
                                v.reshape(-1, nheads_k, headdim), cu * sq, cu * sk, **opts, **drop)
    assert_state((out.reshape(q.shape), lse.reshape(nheads, batch, sq).transpose(1, 0, 2)), ref)
    if prob["dropout_p"] == 0.0:  # the paged reference has no dropout
        seq_lens = np.full(batch, sk, dtype=np.int32)
        k_pool, v_pool, table = to_paged(rng, k, v, prob["page"], seq_lens)
        assert_state(attention_paged(q, k_pool, v_pool, table, seq_lens, **opts), ref)


# ------------------------------------------------------------------------ exact identities


def test_one_key_gives_its_value():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 2, 5, 1, 4, 2, 6)
    out, lse = attention_naive(q, k, v, softmax_scale=0.3)
    np.testing.assert_array_equal(out, np.repeat(v, 4 // 2, axis=2).repeat(5, axis=1))
    score = np.einsum("bqhd,bhd->bhq", q, np.repeat(k[:, 0], 2, axis=1)) * 0.3
    assert_close64(lse, score, "lse")


def test_equal_scores_give_the_mean_of_values():
    rng = np.random.default_rng(2)
    q, _, v = random_qkv(rng, 1, 7, 11, 2, 2, 5)
    k = np.broadcast_to(rng.standard_normal((1, 1, 2, 5)), (1, 11, 2, 5))  # every key the same
    for out, _ in (attention_naive(q, k, v), attention_tiled(q, k, v, block_m=3, block_n=4)):
        assert_close64(out, np.broadcast_to(v.mean(axis=1, keepdims=True), out.shape))


def test_causal_first_row_sees_only_the_first_key():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 2, 9, 9, 2, 1, 4)
    out, _ = attention_tiled(q, k, v, block_m=4, block_n=2, causal=True)
    assert_close64(out[:, 0], np.repeat(v[:, 0], 2, axis=1))


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 3), (3, 7)])
def test_causal_is_aligned_bottom_right(seqlen_q, seqlen_k):
    """Query i sees key j iff j <= i + seqlen_k - seqlen_q; rows that see nothing: 0 and -inf."""
    seen = visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k, causal=True)
    i, j = np.meshgrid(np.arange(seqlen_q), np.arange(seqlen_k), indexing="ij")
    np.testing.assert_array_equal(seen, j <= i + seqlen_k - seqlen_q)
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, seqlen_q, seqlen_k, 2, 2, 3)
    out, lse = attention_naive(q, k, v, causal=True)
    blind = ~seen.any(axis=1)
    assert (out[:, blind] == 0).all() and np.isneginf(lse[..., blind]).all()
    assert np.isfinite(lse[..., ~blind]).all()


# ---------------------------------------------------------------- the fully-masked tile


def test_unguarded_recurrence_gives_nan_where_the_first_tile_is_masked():
    """Sliding window (3, 0) with key tiles of 4: rows >= 7 see nothing in keys 0..3, so
    exp(m_old - m_new) = exp(-inf + inf) = NaN without the guard; the guard gives the exact answer."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 16, 16, 2, 2, 8)
    opts = {"window_size": (3, 0), "block_m": 4, "block_n": 4}
    ref = attention_naive(q, k, v, window_size=(3, 0))
    assert_state(attention_tiled(q, k, v, **opts), ref)
    with np.errstate(invalid="ignore"):
        out, lse = attention_tiled(q, k, v, guard=False, **opts)
    first_tile_blind = ~visible(np.arange(16), np.arange(4), 16, 16, window_size=(3, 0)).any(axis=1)
    assert first_tile_blind.sum() == 9 and visible(np.arange(16), np.arange(16), 16, 16, window_size=(3, 0)).any(1).all()
    np.testing.assert_array_equal(np.isnan(out).any(axis=(0, 2, 3)), first_tile_blind)
    assert_close64(out[:, ~first_tile_blind], ref[0][:, ~first_tile_blind])


# ------------------------------------------------------------------------- merging states


def _partial(q, k, v, cols):
    """The state of attention over the key subset ``cols`` (no mask, so positions do not matter)."""
    if len(cols) == 0:
        return np.zeros(q.shape), np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf)
    return attention_naive(q, k[:, cols], v[:, cols], softmax_scale=0.5)


def test_merge_is_associative_and_equals_the_unsplit_attention():
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 2, 5, 19, 3, 3, 4)
    parts = np.split(rng.permutation(19), [4, 11])  # three disjoint key sets, not contiguous
    a, b, c = (_partial(q, k, v, p) for p in parts)
    left = merge_states(*merge_states(*a, *b), *c)
    right = merge_states(*a, *merge_states(*b, *c))
    ref = attention_naive(q, k, v, softmax_scale=0.5)
    assert_state(left, ref)
    assert_state(right, ref)
    assert_state(merge_many([a[0], b[0], c[0]], [a[1], b[1], c[1]]), ref)


def test_merge_with_empty_states():
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 1, 4, 6, 2, 2, 3)
    full, empty = _partial(q, k, v, np.arange(6)), _partial(q, k, v, np.arange(0))
    with np.errstate(all="raise"):
        assert_state(merge_states(*full, *empty), full)
        assert_state(merge_states(*empty, *full), full)
        o, lse = merge_states(*empty, *empty)
    assert (o == 0).all() and np.isneginf(lse).all()
    # Rows empty in one part only (lse -inf in some rows) take the other part's state.
    part = list(_partial(q, k, v, np.arange(3)))
    part[1] = part[1].copy()
    part[1][..., 1] = -np.inf
    part[0] = part[0].copy()
    part[0][:, 1] = 0.0
    rest = _partial(q, k, v, np.arange(3, 6))
    merged = merge_states(*part, *rest)
    assert_close64(merged[0][:, 1], rest[0][:, 1])
    assert_close64(merged[1][..., 1], rest[1][..., 1], "lse")


# -------------------------------------------------------------------- paged and packed


def test_paged_with_ragged_lengths_equals_dense_per_sequence():
    rng = np.random.default_rng(8)
    seq_lens = np.array([13, 1, 8], dtype=np.int32)
    q, k, v = random_qkv(rng, 3, 2, 13, 4, 2, 5)
    k_pool, v_pool, table = to_paged(rng, k, v, 4, seq_lens, extra_blocks=5)
    opts = {"causal": True, "softcap": 2.0, "alibi_slopes": rng.uniform(0.1, 0.5, (3, 4))}
    out, lse = attention_paged(q, k_pool, v_pool, table, seq_lens, **opts)
    for b, n in enumerate(seq_lens):
        o_b, lse_b = attention_naive(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], **{**opts, "alibi_slopes": opts["alibi_slopes"][b]})
        assert_state((out[b:b + 1], lse[b:b + 1]), (o_b, lse_b))


def test_varlen_equals_dense_per_sequence():
    """Ragged packed batch with an empty query sequence and an empty key sequence; dropout's
    head counter b * nheads + h is matched by shifting the dense call's seed."""
    rng = np.random.default_rng(9)
    lens_q, lens_k = [3, 0, 5, 2], [4, 6, 5, 0]
    nheads, nheads_k, headdim, seed = 4, 2, 3, 1234
    cu_q, cu_k = np.cumsum([0] + lens_q).astype(np.int32), np.cumsum([0] + lens_k).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], nheads, headdim))
    k, v = (rng.standard_normal((cu_k[-1], nheads_k, headdim)) for _ in range(2))
    slopes = rng.uniform(0.1, 0.5, (4, nheads))
    opts = {"causal": True, "softcap": 3.0, "dropout_p": 0.25}
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes, dropout_seed=seed, **opts)
    for b in range(4):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_k[b] == 0:
            assert (out[rows] == 0).all() and np.isneginf(lse[:, rows]).all()
            continue
        shifted = (seed + b * nheads * GOLDEN) & M32
        o_b, lse_b = attention_naive(q[None, rows], k[None, cols], v[None, cols], alibi_slopes=slopes[b],
                                     dropout_seed=shifted, **opts)
        assert_state((out[rows], lse[:, rows]), (o_b[0], lse_b[0]))


# ---------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("opts", [
    {"causal": True},
    {"softcap": 1.2, "window_size": (1, 1), "alibi_slopes": np.array([0.3, 0.7])},
    {"dropout_p": 0.4, "dropout_seed": 77, "softmax_scale": 0.9},
])
def test_naive_grad_matches_finite_differences(opts):
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, 1, 3, 4, 2, 1, 3)
    dout = rng.standard_normal(q.shape)
    grads = attention_naive_grad(q, k, v, dout, **opts)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + eps
            up = (attention_naive(q, k, v, **opts)[0] * dout).sum()
            x[idx] = saved - eps
            down = (attention_naive(q, k, v, **opts)[0] * dout).sum()
            x[idx] = saved
            numeric[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------ dropout


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_dropout_keeps_about_one_minus_p(p):
    rows, cols = np.arange(256, dtype=np.uint64), np.arange(300, dtype=np.uint64)
    fractions = [keep_mask(seed, bh, rows, cols, p).mean() for seed, bh in ((0, 0), (99, 5))]
    sigma = np.sqrt(p * (1 - p) / (256 * 300))
    assert all(abs(f - (1 - p)) <= 5 * sigma + 1e-12 for f in fractions), fractions
    assert p == 0.0 or not np.array_equal(*[keep_mask(s, 0, rows, cols, p) for s in (0, 99)])
    # the same bits from torch integers
    torch_keep = keep_mask(99, 5, torch.arange(256), torch.arange(300), p).numpy()
    np.testing.assert_array_equal(torch_keep, keep_mask(99, 5, rows, cols, p))


# ---------------------------------------------------------------------------- bad input


def test_bad_input_raises():
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 1, 4, 4, 3, 2, 2)
    with pytest.raises(ValueError, match="multiple of nheads_k"):
        attention_naive(q, k, v)
    q, k, v = random_qkv(rng, 1, 4, 4, 2, 2, 2)
    with pytest.raises(ValueError, match="tile sizes"):
        attention_tiled(q, k, v, block_n=0)
    with pytest.raises(ValueError, match="num_splits"):
        attention_split(q, k, v, num_splits=0)
