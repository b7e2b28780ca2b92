"""Unusual tensors and execution modes through the public functions, on both backends: non-finite
inputs under masks, autocast, float64 probabilities, scale/softcap factors that overflow float32,
tensors written in place that share memory (expanded views) or storage with autograd's saved
tensors, and merges of non-floating states."""

import pytest
import torch

import tileattn
from tileattn import reference as R
from tolerance import assert_within, plain_attention


def masked_softmax_attention(q, k, v, *, causal=False, window_size=(-1, -1)):
    """torch's plain softmax attention in float64, hidden scores set with masked_fill: what a NaN or
    inf in q, k or v should reach (out (B, Sq, H, Dv))."""
    q, k, v = (x.detach().double().transpose(1, 2) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    sq, sk = s.shape[-2:]
    i, j = torch.arange(sq).view(-1, 1) + sk - sq, torch.arange(sk).view(1, -1)
    left, right = window_size
    right = 0 if causal else right
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    if right >= 0:
        hidden |= j > i + right
    if left >= 0:
        hidden |= j < i - left
    return (torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("seqlen", [7, 600])  # one tile, and several (the CPU tiles hold 512 keys)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(2, 1))])
def test_non_finite_key_reaches_only_the_rows_that_see_it(device, seqlen, bad, mask):
    """A NaN (or inf) in key j makes NaN exactly the rows torch's masked softmax makes NaN: rows
    that cannot see key j stay finite and correct. The CPU tiles added a 0/-inf tile to hide
    scores, and NaN + -inf (inf + -inf) is NaN: every row of key j's tile became NaN."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, seqlen, 2, 8, generator=gen) for _ in range(3))
    j = seqlen - 3
    k[0, j, :, 0] = bad
    q[0, :, :, 0] = q[0, :, :, 0].abs() + 0.1  # inf * q > 0: the score is +inf where the key is seen
    want = masked_softmax_attention(q, k, v, **mask)
    got = tileattn.flash_attn_func(q.to(device), k.to(device), v.to(device), **mask).double().cpu()
    assert torch.equal(got.isnan(), want.isnan()), (
        f"NaN rows {got.isnan().any(-1).any(-1)[0].nonzero().flatten().tolist()[:8]}, torch's "
        f"{want.isnan().any(-1).any(-1)[0].nonzero().flatten().tolist()[:8]}")
    assert want.isnan().any() and not want[0, :j - 2].isnan().any()
    clean = ~want.isnan()
    assert (got[clean] - want[clean]).abs().max() < 1e-5


def test_autocast_leaves_the_computation_in_the_inputs_dtype(device):
    """Under torch.autocast("cpu", bfloat16) tileattn computes in q/k/v's dtype, as without it (and
    the backends agree): the CPU tiles' matmuls ran in bf16 under autocast, a one-tile problem
    returned fp32 ~1e-2 off and a tiled one stopped on a dtype mismatch of a matmul's out= buffer."""
    gen = torch.Generator().manual_seed(5)
    for shape in ((2, 5, 2, 8), (1, 530, 2, 8)):
        q, k, v = (torch.randn(*shape, generator=gen) for _ in range(3))
        ref_o, ref_lse = R.attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True)
        plain_o, plain_lse = plain_attention(q, k, v, causal=True)
        qd, kd, vd = (t.to(device).requires_grad_() for t in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, lse, probs = tileattn.flash_attn_func(qd, kd, vd, causal=True, return_attn_probs=True)
            out.sum().backward()  # the backward under autocast too
        assert out.dtype == torch.float32 and lse.dtype == torch.float32 and probs.dtype == torch.float32
        assert_within("out", out, plain_o, ref_o)
        assert_within("lse", lse, plain_lse, ref_lse)
        assert torch.isfinite(qd.grad).all()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the kept signature's lane, second call
            again = tileattn.flash_attn_func(q.to(device), k.to(device), v.to(device), causal=True)
            again = tileattn.flash_attn_func(q.to(device), k.to(device), v.to(device), causal=True)
        assert_within("out (lane)", again, plain_o, ref_o)


def test_float64_attention_probabilities_are_float64():
    """return_attn_probs of float64 inputs (CPU tiles): float64, exact to 1e-12 (they were computed
    and returned in float32)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    _, lse, probs = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    s = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * 8 ** -0.5
    s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    assert probs.dtype == torch.float64
    assert (probs - torch.softmax(s, -1)).abs().max() < 1e-12


@pytest.mark.parametrize("options", [dict(softmax_scale=3e38), dict(softmax_scale=-1e39), dict(softcap=1e39),
                                     dict(softcap=1e300), dict(softcap=1e-40)])
def test_scale_and_softcap_factors_must_fit_float32(device, options):
    """Finite options whose float32 factors overflow (scale * log2(e), cap * log2(e), scale / cap) are
    refused; they gave NaN outputs (Triton, CPU softcap) or a bare RuntimeError (CPU scale)."""
    q = torch.randn(1, 4, 2, 8).to(device)
    with pytest.raises(ValueError, match="softmax_scale|softcap"):
        tileattn.flash_attn_func(q, q, q, **options)
    with pytest.raises(ValueError, match="softmax_scale|softcap"):
        tileattn.flash_attn_with_kvcache(q, q.clone(), q.clone(), **options)


def test_large_finite_factors_still_work(device):
    """The edges just inside the bounds compute plain attention's numbers."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 5, 2, 8, generator=gen) for _ in range(3))
    for options in (dict(softmax_scale=0.0), dict(softmax_scale=-0.7), dict(softcap=1e-6)):
        ref_o, _ = R.attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True,
                                     **options)
        plain_o, _ = plain_attention(q, k, v, causal=True, **options)
        out = tileattn.flash_attn_func(q.to(device), k.to(device), v.to(device), causal=True, **options)
        assert_within(f"out {options}", out, plain_o, ref_o)


def test_expanded_tensors_written_in_place_are_refused(device):
    """A cache appended to, or an out= buffer, that is an expanded view (stride 0) is refused before
    anything is written: the Triton path wrote every batch row's (slot's) keys into the same memory
    and returned wrong outputs, the CPU path stopped on torch's internal-overlap error."""
    B, H, D = 2, 2, 8
    q, k, v = (torch.randn(B, 1, H, D).to(device) for _ in range(3))
    lens = torch.tensor([3, 5], dtype=torch.int32, device=device)
    # expanded on the device (.to of an expanded view would copy it into a tensor of its own)
    for shared in (torch.randn(1, 16, H, D).to(device).expand(B, 16, H, D),
                   torch.randn(B, 1, H, D).to(device).expand(B, 16, H, D)):
        before = shared.clone()
        with pytest.raises(ValueError, match="k_cache is written in place but is an expanded view"):
            tileattn.flash_attn_with_kvcache(q, shared, shared.clone(), k, v, cache_seqlens=lens)
        with pytest.raises(ValueError, match="k_cache is written in place but is an expanded view"):
            tileattn.DecodePlan(q, shared, shared.clone(), lens, seqlen_new=1)
        assert torch.equal(shared, before)
        # read only, an expanded cache is fine
        out = tileattn.flash_attn_with_kvcache(q, shared, shared, cache_seqlens=lens)
        assert torch.isfinite(out).all()
    qv = torch.randn(6, H, D).to(device)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="out is written in place but is an expanded view"):
        tileattn.flash_attn_varlen_func(qv, qv, qv, cu, cu, 4, 4, out=torch.zeros(1, H, D).to(device).expand(6, H, D))


def test_out_requiring_grad_is_refused(device):
    """out= written in place must not require grad in grad mode (the Triton path overwrote a leaf
    requiring grad unnoticed; the CPU path stopped in its last op)."""
    H, D = 2, 8
    qv = torch.randn(6, H, D).to(device)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    out = torch.zeros(6, H, D).to(device).requires_grad_()
    with pytest.raises(ValueError, match="out requires grad"):
        tileattn.flash_attn_varlen_func(qv, qv, qv, cu, cu, 4, 4, out=out)
    assert not out.detach().any()
    with torch.no_grad():
        tileattn.flash_attn_varlen_func(qv, qv, qv, cu, cu, 4, 4, out=out)
    assert out.detach().abs().sum() > 0


def test_writes_into_storage_autograd_saved_are_noticed(device):
    """out= and an appended cache that share storage with a tensor autograd saved (a .detach() view):
    that backward fails, as after any in-place write. The Triton kernels wrote through pointers without
    bumping the version counter, so the backward silently used the overwritten values."""
    H, D = 2, 8
    qv = torch.randn(6, H, D).to(device)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    x = torch.randn(6, H, D).to(device).requires_grad_()
    y = (x * x).sum()
    tileattn.flash_attn_varlen_func(qv, qv, qv, cu, cu, 4, 4, out=x.detach())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    cache = torch.randn(2, 8, H, D).to(device).requires_grad_()
    z = (cache * cache).sum()
    new = torch.randn(2, 1, H, D).to(device)
    tileattn.flash_attn_with_kvcache(new, cache.detach(), torch.randn(2, 8, H, D).to(device), new, new,
                                     cache_seqlens=torch.tensor([1, 2], dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_merge_refuses_non_floating_states():
    """merge_states / merge_many take floating-point states of matching shapes (an int32 o came back
    as a truncated int32 merge; o parts of different shapes broadcast in merge_many)."""
    o, lse = torch.randn(2, 3, 2, 4), torch.randn(2, 2, 3)
    for bad in (o.int(), o.to(torch.complex64)):
        with pytest.raises(TypeError, match="every o must be a floating-point tensor"):
            tileattn.merge_states(bad, lse, bad, lse)
    with pytest.raises(TypeError, match="every lse must be a floating-point tensor"):
        tileattn.merge_states(o, lse.int(), o, lse.int())
    with pytest.raises(ValueError, match="differ in shape"):
        tileattn.merge_many([o, o[:1]], [lse, lse])
    merged, merged_lse = tileattn.merge_many([o, o], [lse, lse])
    assert torch.allclose(merged, o, atol=1e-6) and torch.allclose(merged_lse, lse + torch.log(torch.tensor(2.0)))


@pytest.mark.parametrize("window", [(-1, 2**31 - 2), (2**31 - 2, 0), (2**40, 2**30)])
def test_window_sides_past_any_sequence_mean_unbounded(device, window):
    """A window side of 2**30 or more reaches every key: the call equals the unbounded side's. The
    kernels added a side to a position in int32: (-1, 2**31 - 2) wrapped and hid keys (error 1.55)."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=gen).to(device) for _ in range(3))
    bounded = tuple(-1 if w >= 2**30 else w for w in window)
    got = tileattn.flash_attn_func(q, k, v, window_size=window)
    want = tileattn.flash_attn_func(q, k, v, window_size=bounded)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
