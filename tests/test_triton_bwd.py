"""The Triton backward kernels (tileattn.gpu.backward.attn_bwd) against the float64 gradients.

The forward's (out, lse) come from ``tileattn.reference`` (float64, then cast), so these tests
do not depend on the forward kernel. Gradients must lie within GRAD_FACTOR times the error of
plain PyTorch attention's autograd gradients in the same dtype (tests/tolerance.py). On a CPU
the kernels run in Triton's interpreter (small shapes); ``gpu`` tests need a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tileattn import reference
from tileattn.gpu.backward import attn_bwd
from tileattn.contract import AttnParams
from tolerance import GRAD_FACTOR, as_f64, assert_within, max_err, plain_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _params(headdim, causal=False, window_size=(-1, -1), softcap=0.0, dropout_p=0.0, dropout_seed=0,
            softmax_scale=None):
    left, right = window_size
    if causal:
        right = 0
    return AttnParams(softmax_scale=headdim**-0.5 if softmax_scale is None else softmax_scale,
                      window_left=left, window_right=right, softcap=softcap,
                      dropout_p=dropout_p, dropout_seed=dropout_seed)


def _inputs(seed, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=g).to(dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=g).to(dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=g).to(dtype)
    dout = torch.randn(batch, seqlen_q, nheads, headdim, generator=g).to(dtype)
    return q, k, v, dout


def _np(*tensors):
    """float64 NumPy copies (the reference cannot read bf16 tensors)."""
    return [None if t is None else t.detach().cpu().double().numpy() for t in tensors]


def _poisoned(*tensors):
    return [torch.full_like(t, float("nan")) for t in tensors]


def _plain_grads(q, k, v, dout, **opts):
    """Autograd gradients of plain_attention in the inputs' dtype: the error budget."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = plain_attention(*leaves, **opts)
    out.backward(dout)
    return [t.grad for t in leaves]


def _check(fast, plain, ref):
    for name, f, p, r in zip(("dq", "dk", "dv"), fast, plain, ref):
        assert np.isfinite(max_err(p, r)), f"{name}: the budget itself is not finite"
        assert_within(name, f, p, r, factor=GRAD_FACTOR)


def _run_dense(q, k, v, dout, *, alibi_slopes=None, deterministic=False, **opts):
    """Reference forward, poisoned gradients, attn_bwd; returns (dq, dk, dv) on the CPU."""
    out64, lse64 = reference.attention_naive(*_np(q, k, v), alibi_slopes=_np(alibi_slopes)[0], **opts)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = dev(torch.from_numpy(out64).to(q.dtype))
    lse = dev(torch.from_numpy(lse64).to(torch.float32))
    dq, dk, dv = _poisoned(dev(q), dev(k), dev(v))
    slopes = None if alibi_slopes is None else dev(alibi_slopes)
    attn_bwd(dev(dout), dev(q), dev(k), dev(v), out, lse, dq, dk, dv, params=_params(q.shape[-1], **opts),
             alibi_slopes=slopes, deterministic=deterministic)
    return dq.cpu(), dk.cpu(), dv.cpu()


def _check_dense(q, k, v, dout, alibi_slopes=None, **opts):
    fast = _run_dense(q, k, v, dout, alibi_slopes=alibi_slopes, **opts)
    ref = reference.attention_naive_grad(*_np(q, k, v, dout), alibi_slopes=_np(alibi_slopes)[0], **opts)
    plain = _plain_grads(q, k, v, dout, alibi_slopes=alibi_slopes, **opts)
    _check(fast, plain, ref)
    return fast, ref


# ------------------------------------------------------------------ dense, interpreter-sized


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal, headdim, nheads, nheads_k, dtype",
    [
        (1, 1, False, 64, 2, 2, torch.float16),
        (17, 17, True, 40, 2, 1, torch.bfloat16),
        (113, 113, True, 80, 4, 2, torch.float16),
        (33, 113, True, 96, 4, 1, torch.bfloat16),  # seqlen_q < seqlen_k, MQA
        (113, 17, False, 32, 2, 2, torch.float32),  # seqlen_q > seqlen_k
        (65, 64, True, 128, 4, 4, torch.bfloat16),  # one past a block; causal rows without keys
        (203, 203, False, 16, 4, 1, torch.float16),
    ],
)
def test_dense_gradients(seqlen_q, seqlen_k, causal, headdim, nheads, nheads_k, dtype):
    q, k, v, dout = _inputs(seqlen_q * 7 + headdim, 2, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    _check_dense(q, k, v, dout, causal=causal)


def test_rows_without_keys_get_zero_gradients():
    """seqlen_q > seqlen_k, causal: the first seqlen_q - seqlen_k query rows see no key."""
    q, k, v, dout = _inputs(5, 1, 50, 20, 2, 2, 32, torch.float16)
    (dq, dk, dv), _ = _check_dense(q, k, v, dout, causal=True)
    assert torch.equal(dq[:, :30], torch.zeros_like(dq[:, :30]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize(
    "window_size, softcap, alibi, dropout_p, dtype",
    [
        ((20, 5), 0.0, False, 0.0, torch.float16),  # sliding window, both bounds
        ((-1, -1), 5.0, False, 0.0, torch.bfloat16),  # softcap
        ((-1, 0), 0.0, True, 0.0, torch.float16),  # causal + ALiBi
        ((-1, -1), 0.0, False, 0.25, torch.bfloat16),  # dropout
        ((8, -1), 2.0, True, 0.1, torch.float32),  # everything at once
    ],
)
def test_score_modifications(window_size, softcap, alibi, dropout_p, dtype):
    q, k, v, dout = _inputs(11, 2, 70, 90, 4, 2, 64, dtype)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(3)) * 0.5 if alibi else None
    _check_dense(q, k, v, dout, alibi_slopes=slopes, window_size=window_size, softcap=softcap,
                 dropout_p=dropout_p, dropout_seed=1234)


def test_alibi_with_batch_stride_zero():
    q, k, v, dout = _inputs(12, 2, 40, 40, 2, 2, 32, torch.float16)
    slopes = torch.tensor([0.3, 0.05]).expand(2, 2)  # (B, H) with batch stride 0
    _check_dense(q, k, v, dout, alibi_slopes=slopes, causal=True)


def test_strided_views_and_noncontiguous_dout():
    """q, k, v, out, dout and the gradients all as strided views (last dim contiguous)."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(21)
    qkv = torch.randn(2, 3, 80, 4, 48, generator=g).to(dtype)  # (B, 3, S, H, D)
    q, k, v = qkv[:, 0], qkv[:, 1, :, :2], qkv[:, 2, :, 2:]  # views, GQA 4 -> 2
    dout = torch.randn(2, 4, 80, 48, generator=g).to(dtype).transpose(1, 2)  # (B, S, H, D) strided
    out64, lse64 = reference.attention_naive(*_np(q, k, v), causal=True)
    out = torch.from_numpy(out64).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
    lse = torch.from_numpy(lse64).float().transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, S) strided
    grads = torch.full((3, 2, 4, 80, 48), float("nan"), dtype=dtype)
    dq, dk, dv = grads[0].transpose(1, 2), grads[1, :, :2].transpose(1, 2), grads[2, :, 2:].transpose(1, 2)
    dev = [t.to(DEVICE) if DEVICE != "cpu" else t for t in (dout, q, k, v, out, lse, dq, dk, dv)]
    attn_bwd(*dev, params=_params(48, causal=True))
    fast = [t.cpu() for t in dev[-3:]]
    ref = reference.attention_naive_grad(*_np(q, k, v, dout), causal=True)
    _check(fast, _plain_grads(q, k, v, dout, causal=True), ref)


def _heads_apart(tensors, head_stride):
    """Views of ``tensors`` (B, S, H, D) in one storage, each head ``head_stride`` elements after the
    previous one: a layout whose head index x head stride passes 2**31 while each stride fits int32.
    The storage is allocated but only the views' elements are written (on a CPU, pages untouched
    stay unallocated); a gradient view starts as NaN."""
    sizes = [t.numel() // t.shape[2] for t in tensors]
    nheads = max(t.shape[2] for t in tensors)
    store = torch.empty((nheads - 1) * head_stride + sum(sizes), dtype=tensors[0].dtype, device=DEVICE)
    views, start = [], 0
    for t, size in zip(tensors, sizes):
        B, S, H, D = t.shape
        view = store.as_strided(t.shape, (S * D, D, head_stride, 1), start)
        view.copy_(t)
        views.append(view)
        start += size
    return views


def test_heads_two_gigaelements_apart():
    """q, k, v, dout and dq, dk, dv with heads 2**30 + 64 elements apart: the kernels' head offsets
    (an int32 product) wrapped around and read out of bounds (a segfault in the interpreter). They
    run on contiguous copies now, and give the reference's gradients."""
    dtype = torch.float16
    q, k, v, dout = _inputs(23, 2, 21, 19, 3, 3, 16, dtype)
    out64, lse64 = reference.attention_naive(*_np(q, k, v), causal=True)
    out = torch.from_numpy(out64).to(dtype).to(DEVICE)
    lse = torch.from_numpy(lse64).to(torch.float32).to(DEVICE)
    views = _heads_apart([dout, q, k, v, *_poisoned(q, k, v)], 2**30 + 64)
    attn_bwd(*views[:4], out, lse, *views[4:], params=_params(16, causal=True))
    fast = [t.cpu() for t in views[4:]]
    ref = reference.attention_naive_grad(*_np(q, k, v, dout), causal=True)
    _check(fast, _plain_grads(q, k, v, dout, causal=True), ref)


def test_deterministic_is_bitwise_reproducible():
    q, k, v, dout = _inputs(31, 1, 60, 60, 4, 1, 32, torch.bfloat16)
    first = _run_dense(q, k, v, dout, causal=True, deterministic=True)
    second = _run_dense(q, k, v, dout, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# ---------------------------------------------------------------------------------- varlen


def test_varlen_gradients():
    """Packed sequences (one of them empty), GQA, causal, ALiBi; per-sequence references."""
    dtype, nheads, nheads_k, headdim = torch.float16, 4, 2, 40
    lens_q, lens_k = [17, 0, 50, 33], [17, 9, 33, 61]
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    g = torch.Generator().manual_seed(41)
    q = torch.randn(int(cu_q[-1]), nheads, headdim, generator=g).to(dtype)
    k = torch.randn(int(cu_k[-1]), nheads_k, headdim, generator=g).to(dtype)
    v = torch.randn(int(cu_k[-1]), nheads_k, headdim, generator=g).to(dtype)
    dout = torch.randn(int(cu_q[-1]), nheads, headdim, generator=g).to(dtype)
    slopes = torch.rand(len(lens_q), nheads, generator=g)
    opts = dict(causal=True)
    out64, lse64 = reference.attention_varlen(*_np(q, k, v), cu_q.numpy(), cu_k.numpy(), alibi_slopes=slopes.numpy(), **opts)
    out, lse = torch.from_numpy(out64).to(dtype), torch.from_numpy(lse64).float()
    dq, dk, dv = _poisoned(q, k, v)
    dev = [t.to(DEVICE) for t in (dout, q, k, v, out, lse, dq, dk, dv)]
    attn_bwd(*dev, params=_params(headdim, **opts), alibi_slopes=slopes.to(DEVICE),
             cu_seqlens_q=cu_q.to(DEVICE), cu_seqlens_k=cu_k.to(DEVICE),
             max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    fast = [t.cpu() for t in dev[-3:]]
    ref = [np.zeros(t.shape) for t in (q, k, v)]
    plain = [torch.zeros_like(t) for t in (q, k, v)]
    for b in range(len(lens_q)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        seq = [t[None] for t in (q[rq], k[rk], v[rk], dout[rq])]
        grads = reference.attention_naive_grad(*_np(*seq), alibi_slopes=slopes[b:b + 1].numpy(), **opts)
        budget = _plain_grads(*seq, alibi_slopes=slopes[b:b + 1], **opts)
        for i, rows in enumerate((rq, rk, rk)):
            ref[i][rows], plain[i][rows] = grads[i][0], budget[i][0]
    _check(fast, plain, ref)
    assert torch.equal(as_f64(fast[1][17:26]), torch.zeros(9, nheads_k, headdim, dtype=torch.float64))


# ------------------------------------------------------------------- end to end, GPU shapes


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen, headdim", [(1024, 64), (2048, 128), (4096, 128)])
def test_gpu_large_bf16(seqlen, headdim, causal):
    q, k, v, dout = (t.cuda() for t in _inputs(seqlen + headdim, 2, seqlen, seqlen, 4, 2, headdim, torch.bfloat16))
    out, lse = _plain_fp32_forward(q, k, v, causal)
    dq, dk, dv = _poisoned(q, k, v)
    attn_bwd(dout, q, k, v, out.to(q.dtype), lse, dq, dk, dv, params=_params(headdim, causal=causal))
    # oracle: fp32 autograd on the GPU (float64 would be too slow for these sizes)
    ref = _plain_grads(q.float(), k.float(), v.float(), dout.float(), causal=causal)
    plain = _plain_grads(q, k, v, dout, causal=causal)
    _check((dq, dk, dv), plain, ref)


def _plain_fp32_forward(q, k, v, causal):
    out, lse = plain_attention(q.float(), k.float(), v.float(), causal=causal)
    return out, lse.contiguous()


@pytest.mark.gpu
def test_gpu_deterministic_gradients_20_runs():
    """deterministic=True through the public API: 20 backward passes, bitwise the same gradients."""
    import tileattn

    gen = torch.Generator(device="cuda").manual_seed(41)
    q, k, v = (torch.randn(2, 2048, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (16, 4, 4))
    dout = torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    first = None
    for _ in range(20):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        tileattn.flash_attn_func(*leaves, causal=True, deterministic=True).backward(dout)
        grads = [t.grad.view(torch.int16) for t in leaves]
        if first is None:
            first = grads
        assert all(torch.equal(a, b) for a, b in zip(first, grads))


def test_dq_autotuner_skips_the_config_that_crashed(monkeypatch):
    """On the GPU the dq kernel's (128 rows, 32-key tiles, 4 warps) config made an illegal memory
    access (hdim 64, GQA 8:1, causal, 8k); the autotuner must not try it at head dims up to 128,
    while the dK/dV kernel keeps its own (128 keys, 32 rows, 4 warps), which ran clean."""
    from tileattn.gpu import backward as B

    monkeypatch.setattr(B, "interpreting", lambda: False)  # the GPU's config lists (nothing is launched)
    for d in (64, 128):
        dq = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in B._configs("dq", (d,), 2)]
        assert dq and (128, 32, 4) not in dq
    dkdv = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_M"], c.num_warps) for c in B._configs("dkdv", (64,), 2)]
    assert (128, 32, 4) in dkdv
