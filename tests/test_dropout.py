"""Dropout on a part of a batch: a call hashes the coordinates its elements have in the whole batch.

Ring attention computes one sequence (or one document of a packed batch, or one chunk of its
heads) in many calls; each must drop what the single call drops. ``AttnParams.dropout_base``
(batch, head, query, key) and ``dropout_nheads`` place a call's element (b, h, i, j) at
(b + b0, h + h0, i + i0, j + j0) of a batch of ``dropout_nheads`` query heads, whose dropout
counter is ``(b + b0) * dropout_nheads + h + h0`` (``tileattn.dropout_mask``). Each backend that
hashes (the CPU tiles, the Triton kernels) is checked, forward and backward, dense and packed,
against float64 attention with that mask written out here.
"""

from __future__ import annotations

import pytest
import torch

import tileattn.cpu
import tileattn.gpu
from tileattn.contract import AttnParams
from tileattn.dropout_mask import keep_mask
from tolerance import GRAD_FACTOR, assert_within

NAN = float("nan")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter (conftest)
BACKENDS = {"cpu": (tileattn.cpu, "cpu"), "triton": (tileattn.gpu, TRITON_DEVICE)}


def _masked_attention(q, k, v, *, seed, p, bh, i0, j0, causal):
    """Plain attention (b, s, h, d) in q's dtype with dropout element (b, h, i, j) kept iff
    keep_mask(seed, bh[b][h], i + i0, j + j0); causal bottom-right aligned. Returns (out, lse)."""
    batch, sq, nheads, d = q.shape
    sk, group = k.shape[1], nheads // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(group, 2)) * d**-0.5
    if causal:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    rows, cols = torch.arange(sq) + i0, torch.arange(sk) + j0
    z = torch.stack([torch.stack([keep_mask(seed, bh[b][h], rows, cols, p) for h in range(nheads)])
                     for b in range(batch)]).to(q.dtype) / (1 - p)
    probs = torch.softmax(s, -1).nan_to_num(0.0) * z
    return torch.einsum("bhij,bjhd->bihd", probs, v.repeat_interleave(group, 2)), lse


def _run(backend: str, q, k, v, dout, params, packed: bool):
    """(out, lse, dq, dk, dv) of ``backend``'s attn_fwd and attn_bwd, outputs poisoned with NaN; with
    ``packed`` the batch goes in as equal-length sequences of a packed one (lse back to (b, h, s))."""
    module, device = BACKENDS[backend]
    batch, sq, nheads, _ = q.shape
    sk = k.shape[1]
    kw = {}
    if packed:
        kw = dict(cu_seqlens_q=torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device=device),
                  cu_seqlens_k=torch.arange(0, (batch + 1) * sk, sk, dtype=torch.int32, device=device),
                  max_seqlen_q=sq, max_seqlen_k=sk)
    flat = (lambda t: t.flatten(0, 1)) if packed else (lambda t: t)  # noqa: E731
    q, k, v, dout = (flat(t).to(device) for t in (q, k, v, dout))
    out = torch.full(q.shape, NAN, device=device)
    lse = torch.full((nheads, batch * sq) if packed else (batch, nheads, sq), NAN, device=device)
    module.attn_fwd(q, k, v, out, lse, params=params, **kw)
    dq, dk, dv = (torch.full_like(t, NAN) for t in (q, k, v))
    module.attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, params=params, **kw)
    unflat = (lambda t: t.unflatten(0, (batch, -1))) if packed else (lambda t: t)  # noqa: E731
    lse = lse.unflatten(1, (batch, sq)).transpose(0, 1) if packed else lse
    return [unflat(t).cpu() if t is not lse else t.cpu() for t in (out, lse, dq, dk, dv)]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_a_call_on_part_of_a_batch_drops_what_the_whole_call_drops(backend, packed, causal):
    """Batch entries 1..2 of 3, query heads 2..3 of 4 (key/value head 1 of 2), rows from 5 and
    keys from 3 of their sequences: dropout_base (1, 2, 5, 3), dropout_nheads 4."""
    gen = torch.Generator().manual_seed(20 + 2 * packed + causal)
    seed, p = 31337, 0.3
    q = torch.randn(2, 12, 2, 16, generator=gen)
    k, v = torch.randn(2, 17, 1, 16, generator=gen), torch.randn(2, 17, 1, 16, generator=gen)
    dout = torch.randn(2, 12, 2, 16, generator=gen)
    params = AttnParams(softmax_scale=16**-0.5, window_right=0 if causal else -1, dropout_p=p, dropout_seed=seed,
                        dropout_base=(1, 2, 5, 3), dropout_nheads=4)
    fast = _run(backend, q, k, v, dout, params, packed)

    bh = [[(1 + b) * 4 + 2 + h for h in range(2)] for b in range(2)]
    opts = dict(seed=seed, p=p, bh=bh, i0=5, j0=3, causal=causal)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    leaves32 = [t.clone().requires_grad_() for t in (q, k, v)]
    out64, lse64 = _masked_attention(*leaves64, **opts)
    out32, lse32 = _masked_attention(*leaves32, **opts)
    ref = [out64.detach(), lse64.detach(), *torch.autograd.grad(out64, leaves64, dout.double())]
    plain = [out32.detach(), lse32.detach(), *torch.autograd.grad(out32, leaves32, dout)]
    for name, f, pl, r in zip(("out", "lse", "dq", "dk", "dv"), fast, plain, ref):
        assert_within(f"{backend} {name}", f, pl, r, factor=GRAD_FACTOR if name.startswith("d") else 2.0)


def test_dropout_offsets():
    """The counters the backends hash: bh = b * stride + bh0 + h, rows + i0, keys + j0."""
    assert AttnParams(1.0).dropout_offsets(6) == (0, 6, 0, 0)
    assert AttnParams(1.0, dropout_base=(2, 0, 7, 9)).dropout_offsets(6) == (12, 6, 7, 9)
    assert AttnParams(1.0, dropout_base=(2, 3, 7, 9), dropout_nheads=8).dropout_offsets(2) == (19, 8, 7, 9)
