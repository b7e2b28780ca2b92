"""Edge inputs of the Hopper (Gluon) kernels that the rules accept (or route) and only an H100/H200 can
check, found by reading the host rules against the kernels' index math (2026-12-01). Each test names
the suspected problem; all need the GPU (marker ``gpu``).

* varlen: a key tile that runs past a packed sequence's end reads the next sequence's K and V rows.
  Their scores are masked to -inf (P = 0), but 0 x inf = NaN in the P V product: a non-finite V row
  in sequence b + 1 turns sequence b's last rows NaN (the portable kernel loads those rows as 0; the
  paged path zeroes them, ``_zero_rows_from``; the packed path does not).
* K/V expanded over batch or heads (stride 0): the stride rule takes 0 (a multiple of 16 bytes), so
  the TMA descriptors get a zero global stride; whether the driver and the copy engine take it is
  only known on the GPU.
* ``out=`` whose heads lie 2**27 elements apart (32 heads): the Gluon register store computes
  h * head stride in int32; ``hopper._outputs_reason`` now sends such calls to the portable kernel,
  and this checks the whole call end to end (8.6 GB of buffer, a tiny problem).
"""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn import reference
from tileattn.contract import AttnParams
from tileattn.gpu.hopper import hopper_attn_fwd, hopper_fwd_reason

from tolerance import GRAD_FACTOR, assert_within, plain_attention

pytestmark = pytest.mark.gpu


def _np64(x):
    return x.detach().cpu().double().numpy()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_varlen_next_sequence_non_finite_values_stay_out(bad, causal):
    """Sequence 0 (200 rows: its last key tile of 128 covers keys 128..255, 56 of them sequence 1's)
    must equal the reference on sequence 0 alone, finite, whatever sequence 1's V rows hold."""
    gen = torch.Generator().manual_seed(41)
    lens = [200, 300]
    nheads, head_dim = 4, 128
    cu = torch.tensor([0, 200, 500], dtype=torch.int32)
    q, k, v = (torch.randn(500, nheads, head_dim, generator=gen).to(torch.bfloat16).cuda() for _ in range(3))
    v[200:260] = bad  # sequence 1's first keys: inside sequence 0's last key tile
    params = AttnParams(head_dim**-0.5, -1, 0 if causal else -1)
    assert hopper_fwd_reason(q, k, v, params, alibi_slopes=None, varlen=True, paged=False, seqused_k=None,
                             num_splits=0, max_seqlen_q=max(lens)) is None, "the dispatch does not pick the Hopper kernel"
    out = torch.full_like(q, float("nan"))
    lse = torch.full((nheads, 500), float("nan"), device="cuda")
    hopper_attn_fwd(q, k, v, out, lse, params=params, cu_seqlens_q=cu.cuda(), cu_seqlens_k=cu.cuda(),
                    max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    torch.cuda.synchronize()
    q0, k0, v0 = (t[:200].unsqueeze(0).cpu() for t in (q, k, v))
    ref_out, ref_lse = reference.attention_naive(_np64(q0), _np64(k0), _np64(v0), causal=causal)
    plain_out, plain_lse = plain_attention(q0, k0, v0, causal=causal)
    assert torch.isfinite(out[:200]).all(), "sequence 1's values reached sequence 0's rows"
    assert_within("seq 0 out", out[:200].unsqueeze(0), plain_out, ref_out)
    assert_within("seq 0 lse", lse[:, :200].unsqueeze(0), plain_lse, ref_lse)


@pytest.mark.parametrize("expanded", ["heads", "batch"])
def test_hopper_expanded_keys_and_values(expanded):
    """K/V expanded with stride 0 over the KV heads or the batch (the stride rule takes 0 bytes as a
    multiple of 16): the public call, forward and backward, against the reference on copies. Either
    the Gluon kernels compute it right or the rule must send it to the portable kernel (a rule:
    refuse a q/k/v/dout stride of 0 on a dimension of size > 1)."""
    gen = torch.Generator().manual_seed(43)
    batch, seqlen, nheads, nheads_k, head_dim = 2, 300, 4, 2, 128
    q = torch.randn(batch, seqlen, nheads, head_dim, generator=gen).to(torch.bfloat16).cuda()
    shape = (1, seqlen, nheads_k, head_dim) if expanded == "batch" else (batch, seqlen, 1, head_dim)
    k_base, v_base = (torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    k, v = (t.expand(batch, seqlen, nheads_k, head_dim) for t in (k_base, v_base))
    assert 0 in k.stride()
    params = AttnParams(head_dim**-0.5, -1, 0)
    reason = hopper_fwd_reason(q, k, v, params, alibi_slopes=None, varlen=False, paged=False, seqused_k=None,
                               num_splits=1)
    print("hopper_fwd_reason:", reason)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k_base, v_base))
    out = tileattn.flash_attn_func(qg, kg.expand(k.shape), vg.expand(v.shape), causal=True)
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16).cuda()
    out.backward(dout)
    torch.cuda.synchronize()
    kc, vc = k.contiguous(), v.contiguous()
    ref_out, _ = reference.attention_naive(_np64(q), _np64(kc), _np64(vc), causal=True)
    plain_out, _ = plain_attention(q.cpu(), kc.cpu(), vc.cpu(), causal=True)
    assert_within("out", out, plain_out, ref_out)
    ref_dq, ref_dk, ref_dv = reference.attention_naive_grad(_np64(q), _np64(kc), _np64(vc), _np64(dout), causal=True)
    sum_dim = 0 if expanded == "batch" else 2
    np_sum = lambda g: g.sum(axis=sum_dim, keepdims=True)  # noqa: E731  the expand's gradient
    pq, pk, pv = (t.cpu().clone().requires_grad_() for t in (q, kc, vc))
    plain_attention(pq, pk, pv, causal=True)[0].backward(dout.cpu())
    assert_within("dq", qg.grad, pq.grad, ref_dq, factor=GRAD_FACTOR)
    assert_within("dk", kg.grad, pk.grad.sum(sum_dim, keepdim=True), np_sum(ref_dk), factor=GRAD_FACTOR)
    assert_within("dv", vg.grad, pv.grad.sum(sum_dim, keepdim=True), np_sum(ref_dv), factor=GRAD_FACTOR)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_out_view_with_heads_past_int32(head_dim):
    """``out=`` a packed (S, H, D) view whose 32 heads lie 2**27 elements apart (the last starts past
    2**31), given to ``flash_attn_varlen_func`` (the function that takes ``out=``): written by the
    portable kernel (``hopper._outputs_reason``), every row right, nothing written outside the view
    (the gaps between heads keep their sentinel). 8.6 GB of buffer."""
    gen = torch.Generator().manual_seed(47)
    seqlen, nheads, apart = 256, 32, 2**27
    q, k, v = (torch.randn(1, seqlen, nheads, head_dim, generator=gen).to(torch.bfloat16).cuda() for _ in range(3))
    buf = torch.full(((nheads - 1) * apart + seqlen * head_dim + 4096,), 7.0, dtype=torch.bfloat16, device="cuda")
    out = buf.as_strided(q.shape[1:], (head_dim, apart, 1))
    assert hopper_fwd_reason(q[0], k[0], v[0], AttnParams(head_dim**-0.5, -1, 0), alibi_slopes=None, varlen=True,
                             paged=False, seqused_k=None, num_splits=1, max_seqlen_q=seqlen,
                             out=out) == "output head offsets past int32"
    out.fill_(float("nan"))
    cu = torch.tensor([0, seqlen], dtype=torch.int32, device="cuda")
    tileattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, seqlen, seqlen, causal=True, out=out)
    torch.cuda.synchronize()
    ref_out, _ = reference.attention_naive(_np64(q), _np64(k), _np64(v), causal=True)
    plain_out, _ = plain_attention(q.cpu(), k.cpu(), v.cpu(), causal=True)
    assert_within("out", out[None], plain_out, ref_out)
    gaps = [buf[h * apart + seqlen * head_dim:(h + 1) * apart] for h in range(0, nheads - 1, 8)]
    assert all(bool((g == 7.0).all()) for g in gaps), "a write landed between the heads"
    assert bool((buf[-4096:] == 7.0).all())
    del buf
    torch.cuda.empty_cache()


@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_varlen_backward_next_sequence_non_finite_values_stay_out(deterministic):
    """The backward's sibling of the forward case above: dQ's last key tile of sequence 0 covers
    sequence 1's first keys, masked (P = 0) but dP = dO V^T reads their V rows: 0 x inf = NaN in
    dS. Sequence 0's gradients must be finite and match the reference (run on the forward's own
    output, through the public varlen call)."""
    gen = torch.Generator().manual_seed(53)
    nheads, head_dim = 4, 128
    cu = torch.tensor([0, 1200, 1500], dtype=torch.int32, device="cuda")  # 1200 rows: the dQ reductions too
    q, k, v = (torch.randn(1500, nheads, head_dim, generator=gen).to(torch.bfloat16).cuda() for _ in range(3))
    v[1200:1260] = float("inf")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = tileattn.flash_attn_varlen_func(qg, kg, vg, cu, cu, 1200, 1200, causal=False, deterministic=deterministic)
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16).cuda()
    dout[1200:] = 0
    out.backward(dout)
    torch.cuda.synchronize()
    assert torch.isfinite(out[:1200]).all(), "the forward already let sequence 1's values in"
    s0 = slice(0, 1200)
    args = [_np64(t[s0].unsqueeze(0)) for t in (q, k, v, dout)]
    ref_dq, ref_dk, ref_dv = reference.attention_naive_grad(*args)
    pq, pk, pv = (t[s0].unsqueeze(0).cpu().clone().requires_grad_() for t in (q, k, v))
    plain_attention(pq, pk, pv)[0].backward(dout[s0].unsqueeze(0).cpu())
    for name, got, plain, ref in (("dq", qg.grad, pq.grad, ref_dq), ("dk", kg.grad, pk.grad, ref_dk),
                                  ("dv", vg.grad, pv.grad, ref_dv)):
        assert torch.isfinite(got[s0]).all(), f"{name}: sequence 1's values reached sequence 0's gradients"
        assert_within(name, got[s0].unsqueeze(0), plain, ref, factor=GRAD_FACTOR)
