"""GPU-only limits: element offsets past 2**31 and grids past CUDA's 65535 on one axis.

Both need real CUDA launches (the interpreter neither overflows int32 offsets nor has grid
limits), so every test here is ``gpu``-marked.
"""

import pytest
import torch

import tileattn

pytestmark = pytest.mark.gpu


def test_offsets_past_2_31_elements_forward_and_backward():
    """K and V of 3 x 2**30 elements each: batch 2 starts at element 2**31, past int32.

    The same keys read through a view that starts at batch 2 (small in-kernel offsets) must
    give the same output and gradients.
    """
    gen = torch.Generator(device="cuda").manual_seed(31)
    dev, dtype = "cuda", torch.bfloat16
    seqlen_k = 1 << 20  # 2**20 keys x 8 heads x 128 = 2**30 elements per batch
    q = torch.randn(3, 64, 8, 128, device=dev, dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(3, seqlen_k, 8, 128, device=dev, dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(3, seqlen_k, 8, 128, device=dev, dtype=dtype, generator=gen).requires_grad_()
    dout = torch.randn(3, 64, 8, 128, device=dev, dtype=dtype, generator=gen)
    out = tileattn.flash_attn_func(q, k, v)
    out.backward(dout)

    q2, k2, v2 = (t.detach()[2:].requires_grad_() for t in (q, k, v))  # views: storage offset, no copy
    out2 = tileattn.flash_attn_func(q2, k2, v2)
    out2.backward(dout[2:])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[2:], out2, rtol=0, atol=0)
    for name, full, alone in (("dq", q.grad, q2.grad), ("dk", k.grad, k2.grad), ("dv", v.grad, v2.grad)):
        torch.testing.assert_close(full[2:], alone, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_more_than_65535_batch_times_heads():
    """batch x heads = 80,000 programs' worth of (sequence, head) pairs: the grid must fit."""
    gen = torch.Generator(device="cuda").manual_seed(32)
    q = torch.randn(40000, 5, 4, 64, device="cuda", generator=gen).requires_grad_()
    k = torch.randn(40000, 7, 2, 64, device="cuda", generator=gen).requires_grad_()
    v = torch.randn(40000, 7, 2, 64, device="cuda", generator=gen).requires_grad_()
    out = tileattn.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr.transpose(1, 2), kr.repeat_interleave(2, dim=2).transpose(1, 2),
        vr.repeat_interleave(2, dim=2).transpose(1, 2),
        attn_mask=torch.ones(5, 7, dtype=torch.bool, device="cuda").tril(diagonal=2)).transpose(1, 2)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for fast, slow in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
