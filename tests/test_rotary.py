"""``flash_attn_with_kvcache`` with ``rotary_cos`` / ``rotary_sin``: keys rotated before they are
cached, queries rotated at their positions, both pairings, contiguous and paged caches."""

import numpy as np
import pytest
import torch

import tileattn
from tileattn import reference as R
from tolerance import assert_within, plain_attention


def rotate64(x, cos, sin, positions, interleaved):
    """Reference rotation in float64 through complex numbers: pair (a, b) is a + ib, times e^{i theta}."""
    x = np.array(x, dtype=np.float64)
    half = cos.shape[1]
    if interleaved:
        z = x[..., 0:2 * half:2] + 1j * x[..., 1:2 * half:2]
    else:
        z = x[..., :half] + 1j * x[..., half:2 * half]
    turn = (cos[positions] + 1j * sin[positions])[:, :, None, :]  # (batch, seqlen, 1, half)
    z = z * turn
    out = x.copy()
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:2 * half] = z.real, z.imag
    return out


def _check_row(b, out, q64, cached_k, cached_v, k64_new, v_new, causal):
    """Sequence b's output against attention over its cached keys then its rotated new ones."""
    keys = np.concatenate([cached_k.double().numpy(), k64_new])[None]
    values = np.concatenate([cached_v.double().numpy(), v_new.double().numpy()])[None]
    ref_o, _ = R.attention_naive(q64[b:b + 1], keys, values, causal=causal)
    plain_o, _ = plain_attention(torch.from_numpy(q64[b:b + 1]).float(), torch.from_numpy(keys).float(),
                                 torch.from_numpy(values).float(), causal=causal)
    assert_within(f"out[{b}]", out[b:b + 1], plain_o, ref_o)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal,paged", [(True, False), (False, True), (True, True)])
def test_rotary_kvcache_matches_reference(device, interleaved, causal, paged):
    gen = torch.Generator().manual_seed(61)
    batch, new, headdim, rotary_dim = 2, 3, 32, 16
    lens = torch.tensor([5, 12], dtype=torch.int32)
    angles = torch.rand(40, rotary_dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angles.cos(), angles.sin()
    q = torch.randn(batch, new, 4, headdim, generator=gen)
    k_new = torch.randn(batch, new, 2, headdim, generator=gen)
    v_new = torch.randn(batch, new, 2, headdim, generator=gen)
    cached_k = torch.randn(batch, 16, 2, headdim, generator=gen)  # already-rotated keys from earlier steps
    cached_v = torch.randn(batch, 16, 2, headdim, generator=gen)
    if paged:
        table = torch.randperm(12, generator=gen)[:8].view(2, 4).to(torch.int32)
        k_cache = torch.full((12, 4, 2, headdim), float("nan"))
        v_cache = torch.full((12, 4, 2, headdim), float("nan"))
        for b in range(batch):
            for p in range(int(lens[b])):
                k_cache[table[b, p // 4], p % 4] = cached_k[b, p]
                v_cache[table[b, p // 4], p % 4] = cached_v[b, p]
    else:
        table, k_cache, v_cache = None, cached_k.clone(), cached_v.clone()
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    out = tileattn.flash_attn_with_kvcache(
        q.to(device), k_cache, v_cache, k=k_new.to(device), v=v_new.to(device), rotary_cos=cos.float().to(device),
        rotary_sin=sin.float().to(device), cache_seqlens=lens.to(device),
        block_table=None if table is None else table.to(device), causal=causal, rotary_interleaved=interleaved)

    steps = np.arange(new)
    k_pos = lens.numpy()[:, None] + steps
    q_pos = k_pos if causal else np.repeat(lens.numpy()[:, None], new, axis=1)
    q64 = rotate64(q.numpy(), cos.numpy(), sin.numpy(), q_pos, interleaved)
    k64_new = rotate64(k_new.numpy(), cos.numpy(), sin.numpy(), k_pos, interleaved)
    for b in range(batch):
        n = int(lens[b])
        _check_row(b, out, q64, cached_k[b, :n], cached_v[b, :n], k64_new[b], v_new[b], causal)
        stored = [k_cache[b, n + i] if table is None else k_cache[table[b, (n + i) // 4], (n + i) % 4]
                  for i in range(new)]
        np.testing.assert_allclose(torch.stack(stored).cpu().double().numpy(), k64_new[b], rtol=0, atol=1e-5)


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "rotary_sin": None}, ValueError, "both rotary_cos and rotary_sin"),
    (lambda a: {**a, "k": None, "v": None}, ValueError, "pass k and v"),
    (lambda a: {**a, "rotary_cos": torch.ones(6, 4), "rotary_sin": torch.ones(6, 4)}, IndexError, "positions"),
    (lambda a: {**a, "rotary_cos": torch.ones(40, 20), "rotary_sin": torch.ones(40, 20)}, ValueError, "rotary_dim"),
    (lambda a: {**a, "rotary_cos": torch.ones(40, 4, dtype=torch.int32)}, TypeError, "floating-point"),
])
def test_rotary_bad_input_raises(change, error, words):
    args = dict(q=torch.randn(2, 1, 4, 16), k_cache=torch.randn(2, 8, 2, 16), v_cache=torch.randn(2, 8, 2, 16),
                k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16), cache_seqlens=torch.tensor([3, 6], dtype=torch.int32),
                rotary_cos=torch.ones(40, 4), rotary_sin=torch.zeros(40, 4), causal=True)
    with pytest.raises(error, match=words):
        tileattn.flash_attn_with_kvcache(**change(args))


@pytest.mark.parametrize("seqlen_q,new", [(4, 1), (2, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_when_the_new_chunk_and_q_differ_in_length(device, seqlen_q, new, causal):
    """flash-attn's positions with seqlen_q != seqlen_new (speculative decoding, chunked appends):
    key j at cache_seqlens + j; query i at cache_seqlens + i when causal, else at cache_seqlens."""
    gen = torch.Generator().manual_seed(62)
    batch, headdim, rotary_dim = 2, 32, 32
    lens = torch.tensor([4, 9], dtype=torch.int32)
    angles = torch.rand(20, rotary_dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angles.cos(), angles.sin()
    q = torch.randn(batch, seqlen_q, 4, headdim, generator=gen)
    k_new = torch.randn(batch, new, 2, headdim, generator=gen)
    v_new = torch.randn(batch, new, 2, headdim, generator=gen)
    cached_k = torch.randn(batch, 16, 2, headdim, generator=gen)
    cached_v = torch.randn(batch, 16, 2, headdim, generator=gen)
    k_cache, v_cache = cached_k.clone().to(device), cached_v.clone().to(device)
    out = tileattn.flash_attn_with_kvcache(
        q.to(device), k_cache, v_cache, k=k_new.to(device), v=v_new.to(device), rotary_cos=cos.float().to(device),
        rotary_sin=sin.float().to(device), cache_seqlens=lens.to(device), causal=causal, rotary_interleaved=False)
    base = lens.numpy()[:, None]
    k_pos = base + np.arange(new)
    q_pos = base + np.arange(seqlen_q) if causal else np.repeat(base, seqlen_q, axis=1)
    q64 = rotate64(q.numpy(), cos.numpy(), sin.numpy(), q_pos, False)
    k64_new = rotate64(k_new.numpy(), cos.numpy(), sin.numpy(), k_pos, False)
    for b in range(batch):
        n = int(lens[b])
        _check_row(b, out, q64, cached_k[b, :n], cached_v[b, :n], k64_new[b], v_new[b], causal)
        np.testing.assert_allclose(k_cache[b, n:n + new].cpu().double().numpy(), k64_new[b], rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch_idx", [False, True])
def test_rotary_with_cache_leftpad(device, batch_idx):
    """Left-padded rows (pad slots NaN): positions stay the absolute cache slots, attention starts at the pad;
    optionally through cache_batch_idx (a cache of more rows than the batch)."""
    gen = torch.Generator().manual_seed(63)
    batch, slots, new, headdim = 2, 12, 2, 16
    pads, lens = torch.tensor([3, 0], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32)
    rows = torch.tensor([2, 0], dtype=torch.int32) if batch_idx else torch.arange(batch, dtype=torch.int32)
    angles = torch.rand(slots, headdim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angles.cos(), angles.sin()
    q = torch.randn(batch, new, 4, headdim, generator=gen)
    k_new = torch.randn(batch, new, 2, headdim, generator=gen)
    v_new = torch.randn(batch, new, 2, headdim, generator=gen)
    cached_k = torch.full((3, slots, 2, headdim), float("nan"))
    cached_v = torch.full((3, slots, 2, headdim), float("nan"))
    for b in range(batch):
        r, lo, hi = int(rows[b]), int(pads[b]), int(lens[b])
        cached_k[r, lo:hi] = torch.randn(hi - lo, 2, headdim, generator=gen)
        cached_v[r, lo:hi] = torch.randn(hi - lo, 2, headdim, generator=gen)
    k_cache, v_cache = cached_k.clone().to(device), cached_v.clone().to(device)
    if not batch_idx:
        k_cache, v_cache = k_cache[:batch], v_cache[:batch]
    out = tileattn.flash_attn_with_kvcache(
        q.to(device), k_cache, v_cache, k=k_new.to(device), v=v_new.to(device), rotary_cos=cos.float().to(device),
        rotary_sin=sin.float().to(device), cache_seqlens=lens.to(device), cache_leftpad=pads.to(device),
        cache_batch_idx=rows.to(device) if batch_idx else None, causal=True)
    pos = lens.numpy()[:, None] + np.arange(new)
    q64 = rotate64(q.numpy(), cos.numpy(), sin.numpy(), pos, True)
    k64_new = rotate64(k_new.numpy(), cos.numpy(), sin.numpy(), pos, True)
    for b in range(batch):
        r, lo, hi = int(rows[b]), int(pads[b]), int(lens[b])
        keys = np.concatenate([cached_k[r, lo:hi].double().numpy(), k64_new[b]])[None]
        values = np.concatenate([cached_v[r, lo:hi].double().numpy(), v_new[b].double().numpy()])[None]
        ref_o, _ = R.attention_naive(q64[b:b + 1], keys, values, causal=True)
        plain_o, _ = plain_attention(torch.from_numpy(q64[b:b + 1]).float(), torch.from_numpy(keys).float(),
                                     torch.from_numpy(values).float(), causal=True)
        assert_within(f"out[{b}]", out[b:b + 1], plain_o, ref_o)
        np.testing.assert_allclose(k_cache[r, hi:hi + new].cpu().double().numpy(), k64_new[b], rtol=0, atol=1e-5)


# ------------------------------------------------------ apply_rotary_emb (flash_attn.layers.rotary)


def _tables(seqlen_ro, rotary_dim, seed):
    angles = torch.rand(seqlen_ro, rotary_dim // 2, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64) * 6.3
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", [0, 5, "tensor"])
def test_apply_rotary_emb_matches_reference(interleaved, offsets):
    from tileattn.layers.rotary import apply_rotary_emb

    batch, seqlen, headdim, rotary_dim = 3, 7, 24, 16
    cos, sin = _tables(20, rotary_dim, 5)
    x = torch.randn(batch, seqlen, 2, headdim, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    offs = torch.tensor([0, 9, 13]) if offsets == "tensor" else offsets
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offs)
    start = offs[:, None] if offsets == "tensor" else torch.full((batch, 1), offs)
    want = rotate64(x.numpy(), cos.numpy(), sin.numpy(), (start + torch.arange(seqlen)).numpy(), interleaved)
    assert np.abs(got.numpy() - want).max() < 1e-6  # fp32 arithmetic on float64 inputs
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_packed_and_in_place(device, interleaved):
    """Packed sequences (cu_seqlens), each counted from its own offset; inplace rotates x itself.
    The same on the CPU and CUDA paths (no host synchronisation on CUDA tensors)."""
    from tileattn.layers.rotary import apply_rotary_emb

    lens, offs = [4, 0, 6], torch.tensor([3, 1, 0])
    cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    cos, sin = _tables(12, 8, 7)
    x = torch.randn(10, 3, 16, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    dev = lambda t: t.to(device)  # noqa: E731
    got = apply_rotary_emb(dev(x), dev(cos), dev(sin), interleaved, seqlen_offsets=dev(offs), cu_seqlens=dev(cu),
                           max_seqlen=6).cpu()
    positions = torch.cat([offs[b] + torch.arange(n) for b, n in enumerate(lens)])[None]
    want = rotate64(x[None].float().numpy(), cos.numpy(), sin.numpy(), positions.numpy(), interleaved)[0]
    # rotated in fp32, rounded once to bf16: within bf16's half ulp of the exact result
    assert (np.abs(got.double().numpy() - want) <= 2.0**-8 * np.abs(want) + 1e-6).all()
    y = dev(x.clone())
    assert apply_rotary_emb(y, dev(cos), dev(sin), interleaved, inplace=True, seqlen_offsets=dev(offs),
                            cu_seqlens=dev(cu)) is y
    assert torch.equal(y.cpu(), got)


def test_apply_rotary_emb_gradients():
    from tileattn.layers.rotary import apply_rotary_emb

    cos, sin = _tables(6, 4, 9)
    x = torch.randn(1, 5, 2, 6, dtype=torch.float64, requires_grad=True)
    cos64, sin64 = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    # the rotation runs in fp32: compare the analytic gradient of x (rotation by -theta) instead of gradcheck
    out = apply_rotary_emb(x, cos64, sin64, seqlen_offsets=1)
    g = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, g)
    back = rotate64(g.detach().numpy(), cos.numpy(), -sin.numpy(), (1 + torch.arange(5))[None].numpy(), False)
    assert np.abs(dx.numpy() - back).max() < 1e-6


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(seqlen_offsets=14), IndexError, "cover 20 positions"),
    (dict(seqlen_offsets=torch.tensor([0, 14, 0])), IndexError, "cover 20 positions"),
    (dict(seqlen_offsets=torch.tensor([0.0, 1.0, 2.0])), TypeError, "integers"),
    (dict(seqlen_offsets=torch.tensor([0, 1])), ValueError, r"shape \(3,\)"),
    (dict(seqlen_offsets=-1), ValueError, "seqlen_offsets"),
    (dict(inplace="yes"), TypeError, "inplace must be a bool"),
])
def test_apply_rotary_emb_bad_input_raises(kwargs, error, words):
    from tileattn.layers.rotary import apply_rotary_emb

    cos, sin = _tables(20, 8, 1)
    with pytest.raises(error, match=words):
        apply_rotary_emb(torch.randn(3, 7, 2, 16), cos, sin, **kwargs)


def test_apply_rotary_emb_refuses_bad_tables():
    from tileattn.layers.rotary import apply_rotary_emb

    cos, sin = _tables(20, 8, 1)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(torch.randn(1, 3, 2, 6), cos, sin)  # rotary_dim 8 > headdim 6
    with pytest.raises(ValueError, match="one shape"):
        apply_rotary_emb(torch.randn(1, 3, 2, 16), cos, sin[:, :2])
    with pytest.raises(ValueError, match="x must be a floating-point"):
        apply_rotary_emb(torch.ones(1, 3, 2, 16, dtype=torch.int32), cos, sin)
