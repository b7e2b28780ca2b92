"""torch.autocast does not change what tileattn computes: the first call of a signature and the
kept launch its later calls take (``ops._memo``, the lanes) give the inputs' dtype and the
numbers they give without autocast, on both backends.

Under a CPU autocast region the CPU tiles' matmuls ran in bf16: with fp32 inputs the first call of
a decoding signature raised a dtype clash, while a signature kept from before the region (the
one-row lane) returned a bf16 output; other shapes returned fp32 with errors of 1e-2; bf16 inputs
lost their fp32 accumulation (errors past the tolerance rule's budget). The Triton kernels never
looked at autocast."""

import pytest
import torch

import tileattn
from tileattn import reference as R
from tileattn.ops import attention as dense_ops
from tileattn.ops import kvcache as kv_ops
from tolerance import assert_within, plain_attention

AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


def _inputs(seed, batch, seqlen_q, seqlen_k, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, 4, 16, generator=gen).to(dtype)
    k, v = (torch.randn(batch, seqlen_k, 2, 16, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _assert_exact(out, q, k, v, **opts):
    ref_o, _ = R.attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(), **opts)
    assert_within("out", out, plain_attention(q, k, v, **opts)[0], ref_o)


# decoding (the one-row step), a short prefill (one tile), a long one (the tiled recurrence)
SHAPES = [(1, 1, 7), (2, 3, 9), (1, 1, 300), (2, 40, 200)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_first_and_kept_calls_ignore_autocast(device, shape, dtype):
    q, k, v = _inputs(91, *shape, dtype)
    plain = tileattn.flash_attn_func(q, k, v, causal=True)  # kept: the lane of later calls
    for first in (False, True):
        if first:
            dense_ops._CHECKED.clear()
        with torch.autocast(**AUTOCAST):
            out = tileattn.flash_attn_func(q, k, v, causal=True)
            again = tileattn.flash_attn_func(q, k, v, causal=True)
        for o in (out, again):
            assert o.dtype == dtype
            assert torch.equal(o, plain)
    _assert_exact(out, q, k, v, causal=True)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_kvcache_first_and_kept_calls_ignore_autocast(device, shape):
    q, k_cache, v_cache = _inputs(92, *shape, torch.float32)
    lens = torch.full((q.shape[0],), k_cache.shape[1] - 2, dtype=torch.int32)
    plain = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    for first in (False, True):
        if first:
            kv_ops._CHECKED.clear()
        with torch.autocast(**AUTOCAST):
            outs = [tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
                    for _ in range(2)]
        for o in outs:
            assert o.dtype == torch.float32
            assert torch.equal(o, plain)


def test_gradients_ignore_autocast(device):
    """A training step's forward in an autocast region and its backward in one too: the gradients
    (first call, then the graph lane's) are those without autocast."""
    q, k, v = _inputs(93, 2, 9, 9, torch.float32)
    sink = torch.randn(4, generator=torch.Generator().manual_seed(94))
    grads = []
    for region in (False, True, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
        with torch.autocast(**AUTOCAST, enabled=region):
            out = tileattn.flash_attn_func(*leaves[:3], causal=True, learnable_sink=leaves[3])
            out.square().sum().backward()
        assert out.dtype == torch.float32
        grads.append([out.detach()] + [t.grad for t in leaves])
    for step in grads[1:]:
        for got, want in zip(step, grads[0]):
            assert torch.equal(got, want)
