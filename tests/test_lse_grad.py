"""The returned LSE is differentiable (issue #15 item 5): a loss that uses it gets its gradient.

With lse = logsumexp(s), d lse / d s = P, so the backward's dS gains P * dlse: its
``delta = rowsum(dO * O)`` becomes ``rowsum(dO * O) - dlse``. Checked against float64 torch
autograd of plain attention (and the reference's gradient with dlse) on the dense and varlen
paths, on the CPU tiles and the Triton kernels, in eager mode and under torch.compile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tileattn
from tileattn import reference as R
from tolerance import GRAD_FACTOR, assert_within, plain_attention


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def z_loss_of(out, lse, dout):
    """A training loss that uses the LSE: the output's term plus a z-loss on each row's lse."""
    return (out.float() * dout.float()).sum() + 0.1 * (lse ** 2).sum()


def _plain_grads(inputs, dout, **opts):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out, lse = plain_attention(*leaves[:3], learnable_sink=leaves[3] if len(leaves) > 3 else None, **opts)
    z_loss_of(out, lse, dout).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype,causal,window,with_sink", [
    (torch.float32, True, (-1, -1), False), (torch.float16, True, (-1, -1), True),
    (torch.float16, False, (6, 3), False), (torch.float32, False, (6, 3), True)])
def test_z_loss_gradient_dense(device, dtype, causal, window, with_sink):
    gen = torch.Generator().manual_seed(11)
    q, k, v = rand(gen, 2, 23, 4, 32, dtype=dtype), rand(gen, 2, 31, 2, 32, dtype=dtype), rand(gen, 2, 31, 2, 32, dtype=dtype)
    dout = rand(gen, 2, 23, 4, 32, dtype=dtype)
    inputs = [q, k, v] + ([rand(gen, 4)] if with_sink else [])
    opts = dict(causal=causal, window_size=window)
    leaves = [t.clone().to(device).requires_grad_(True) for t in inputs]
    out, lse, _ = tileattn.flash_attn_func(*leaves[:3], learnable_sink=leaves[3] if with_sink else None,
                                           return_attn_probs=True, **opts)
    z_loss_of(out, lse, dout.to(device)).backward()
    ref = _plain_grads([t.double() for t in inputs], dout.double(), **opts)  # float64 autograd: the oracle
    plain = _plain_grads(inputs, dout, **opts)  # the same in the inputs' dtype: the budget
    for name, leaf, p, r in zip(("dq", "dk", "dv", "dsink"), leaves, plain, ref):
        assert_within(name, leaf.grad, p, r, factor=GRAD_FACTOR)


def test_lse_only_loss_and_rows_without_keys(device):
    """A loss on the LSE alone (out unused: its gradient is None) and rows that see no key
    (seqlen_q > seqlen_k, causal; their lse is -inf and is left out of the loss)."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = rand(gen, 1, 19, 2, 16), rand(gen, 1, 11, 2, 16), rand(gen, 1, 11, 2, 16)
    dlse = rand(gen, 1, 2, 19)
    leaves = [t.clone().to(device).requires_grad_(True) for t in (q, k, v)]
    _, lse, _ = tileattn.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    seen = slice(8, 19)  # rows 0..7 see no key
    (lse[..., seen] * dlse[..., seen].to(device)).sum().backward()
    dl = np.zeros((1, 2, 19))
    dl[..., seen] = dlse[..., seen].numpy()
    ref = R.attention_naive_grad(*(t.double().numpy() for t in (q, k, v)), np.zeros((1, 19, 2, 16)), dlse=dl,
                                 causal=True)
    for leaf, r in zip(leaves, ref):
        assert torch.isfinite(leaf.grad).all()
        np.testing.assert_allclose(leaf.grad.cpu().numpy(), r, atol=2e-5)
    assert torch.all(leaves[0].grad[:, :8] == 0)


def test_z_loss_gradient_varlen(device):
    gen = torch.Generator().manual_seed(13)
    lens_q, lens_k = [9, 0, 14], [12, 5, 14]
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q, k, v, dout = rand(gen, 23, 4, 16), rand(gen, 31, 2, 16), rand(gen, 31, 2, 16), rand(gen, 23, 4, 16)
    sink = rand(gen, 4)
    leaves = [t.clone().to(device).requires_grad_(True) for t in (q, k, v, sink)]
    out, lse, _ = tileattn.flash_attn_varlen_func(*leaves[:3], cu_q.to(device), cu_k.to(device), 14, 14, causal=True,
                                                  learnable_sink=leaves[3], return_attn_probs=True)
    z_loss_of(out, lse, dout.to(device)).backward()
    dsink = np.zeros(4)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [t.detach().double() for t in (q[None, qs], k[None, ks], v[None, ks], dout[None, qs])]
        _, lse64 = R.attention_naive(*(t.numpy() for t in seq[:3]), causal=True, learnable_sink=sink.numpy())
        g = R.attention_naive_grad(*(t.numpy() for t in seq), dlse=0.2 * lse64, causal=True,
                                   learnable_sink=sink.numpy())
        for got, want in zip((leaves[0].grad[qs], leaves[1].grad[ks], leaves[2].grad[ks]), g[:3]):
            np.testing.assert_allclose(got.cpu().numpy(), want[0], atol=5e-5)
        dsink += g[3]
    np.testing.assert_allclose(leaves[3].grad.cpu().numpy(), dsink, rtol=1e-5, atol=5e-5)


def test_z_loss_gradient_under_torch_compile(monkeypatch):
    """torch.compile (fullgraph) traces the custom ops: the same gradients as eager mode, and
    as float64 autograd (before, the LSE's gradient was dropped: q.grad was 0 for an LSE-only loss)."""
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(14)
    q, k, v, dout = rand(gen, 2, 13, 4, 16), rand(gen, 2, 17, 2, 16), rand(gen, 2, 17, 2, 16), rand(gen, 2, 13, 4, 16)
    sink = rand(gen, 4)

    def loss_fn(q, k, v, sink):
        out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
        return z_loss_of(out, lse, dout)

    def lse_only(q, k, v):
        _, lse, _ = tileattn.flash_attn_func(q, k, v, return_attn_probs=True)
        return lse.sum()

    compiled, compiled_lse = (torch.compile(f, fullgraph=True, backend="aot_eager") for f in (loss_fn, lse_only))
    ref = _plain_grads([t.double() for t in (q, k, v, sink)], dout.double(), causal=True)
    eager_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    loss_fn(*eager_leaves).backward()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    compiled(*leaves).backward()
    for leaf, eager, r in zip(leaves, eager_leaves, ref):
        torch.testing.assert_close(leaf.grad, eager.grad, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(leaf.grad.numpy(), r.numpy(), atol=5e-5)
    qa = q.clone().requires_grad_(True)
    compiled_lse(qa, k, v).backward()
    q64 = q.double().requires_grad_(True)
    plain_attention(q64, k.double(), v.double())[1].sum().backward()
    assert qa.grad.abs().max() > 0.1
    np.testing.assert_allclose(qa.grad.numpy(), q64.grad.numpy(), atol=5e-5)


def test_custom_op_passes_opcheck(monkeypatch):
    """torch.library.opcheck of tileattn::fwd with sinks: schema, autograd registration, fake
    kernel, and AOT dispatch (eager and traced outputs and gradients of both outputs agree)."""
    from tileattn.ops import _custom

    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    gen = torch.Generator().manual_seed(15)
    q, k, v = rand(gen, 1, 5, 2, 8), rand(gen, 1, 7, 1, 8), rand(gen, 1, 7, 1, 12)
    sink = rand(gen, 2)
    leaves = [t.requires_grad_(True) for t in (q, k, v, sink)]
    args = (*leaves[:3], None, None, None, None, None, leaves[3], 5, 7, 8**-0.5, -1, 0, 0.0, 0.0, 0, 1, False)
    torch.library.opcheck(_custom._fwd, args)


def _op_cases(gen):
    """tileattn::fwd's arguments as the public functions pass them (ALiBi slopes (batch, nheads),
    offsets int32), for layouts and options the sink case above does not reach."""
    q, k, v = rand(gen, 2, 5, 4, 16), rand(gen, 2, 7, 2, 16), rand(gen, 2, 7, 2, 16)
    alibi = torch.rand(4, generator=gen).expand(2, 4)
    qp, kp, vp = rand(gen, 9, 4, 16), rand(gen, 11, 2, 16), rand(gen, 11, 2, 16)
    cu_q, cu_k = torch.tensor([0, 4, 4, 9], dtype=torch.int32), torch.tensor([0, 5, 6, 11], dtype=torch.int32)
    pool_k, pool_v = rand(gen, 6, 4, 2, 16), rand(gen, 6, 4, 2, 16)
    table, used = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32), torch.tensor([9, 5], dtype=torch.int32)
    return {  # q, k, v, cu_q, cu_k, seqused_k, table, alibi, sink, max_q, max_k, scale, left, right, softcap,
        # dropout_p, seed, num_splits, deterministic
        "alibi, window, softcap": (q, k, v, None, None, None, None, alibi, None, 5, 7, 0.25, 3, 0, 5.0, 0.0, 0, 1,
                                   False),
        "dropout": (q, k, v, None, None, None, None, None, None, 5, 7, 0.25, -1, -1, 0.0, 0.3, 1234, 1, False),
        "varlen, causal, an empty sequence": (qp, kp, vp, cu_q, cu_k, None, None, None, None, 5, 5, 0.25, -1, 0, 0.0,
                                              0.0, 0, 1, False),
        "paged cache, two splits": (rand(gen, 2, 1, 4, 16), pool_k, pool_v, None, None, used, table, None, None, 1, 12,
                                    0.25, -1, 0, 0.0, 0.0, 0, 2, False),
    }


@pytest.mark.parametrize("case", ["alibi, window, softcap", "dropout", "varlen, causal, an empty sequence",
                                  "paged cache, two splits"])
def test_custom_op_passes_opcheck_on_each_layout(device, case):
    """torch.library.opcheck of tileattn::fwd on both backends for ALiBi with a window and softcap,
    dropout (its seed makes the op a function), varlen with an empty sequence and a paged cache with
    splits (no gradients through a cache): fake kernel, schema, autograd registration, AOT dispatch."""
    from tileattn.ops import _custom

    args = _op_cases(torch.Generator().manual_seed(16))[case]
    grad = args[5] is None  # no gradients through a KV cache
    args = tuple(t.to(device).requires_grad_(grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dim() > 1 else t.to(device) if isinstance(t, torch.Tensor) else t for t in args)
    torch.library.opcheck(_custom._fwd, args)
