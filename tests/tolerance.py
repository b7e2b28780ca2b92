"""The tolerance rule every fast path is tested by, and plain PyTorch attention that sets the budget.

    err(fast)  = max |fast - ref64|
    err(torch) = max |plain PyTorch attention in the same dtype - ref64|
    pass  <=>  err(fast) <= 2 err(torch) + 1e-5   (outputs, LSE)
               err(fast) <= 3 err(torch) + 1e-5   (gradients)

NaN or inf where the oracle is finite always fails; where the oracle is -inf (the LSE of a
row that sees no key) the fast path must give -inf too.
"""

from __future__ import annotations

import numpy as np
import torch

from tileattn.dropout_mask import keep_mask

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
SLACK = 1e-5


def as_f64(x) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x).to(torch.float64)
    return x.detach().to("cpu", torch.float64)


def max_err(x, ref) -> float:
    """max |x - ref| over the entries where ref is finite; inf if x breaks the rule there."""
    x, ref = as_f64(x), as_f64(ref)
    assert x.shape == ref.shape, f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    if not torch.equal(x[~finite], ref[~finite]):
        return float("inf")  # e.g. LSE must be -inf exactly where the reference's is
    if finite.any() and not torch.isfinite(x[finite]).all():
        return float("inf")
    return float((x[finite] - ref[finite]).abs().max()) if finite.any() else 0.0


def assert_within(name: str, fast, plain, ref, factor: float = OUT_FACTOR) -> None:
    """Check ``fast`` against the float64 ``ref`` with the budget set by ``plain``."""
    err_fast, err_plain = max_err(fast, ref), max_err(plain, ref)
    assert err_plain < float("inf"), f"{name}: the plain-torch budget itself is not finite (broken oracle)"
    # A budget near the size of the values means plain torch computed something else than the
    # reference (e.g. another dropout mask): the rule would then pass anything.
    scale = float(as_f64(ref)[torch.isfinite(as_f64(ref))].abs().max()) if torch.isfinite(as_f64(ref)).any() else 0.0
    assert err_plain <= 0.1 * max(1.0, scale), (
        f"{name}: plain torch is {err_plain:.3e} off the reference (values up to {scale:.3e}): broken oracle")
    bound = factor * err_plain + SLACK
    assert err_fast <= bound, f"{name}: err(fast)={err_fast:.3e} > {factor}*err(torch)={err_plain:.3e} + {SLACK}"


def plain_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, dropout_seed=0, learnable_sink=None):
    """Textbook attention in torch, in the inputs' own dtype (no upcast): the error budget.

    Layout (B, S, H, D) like flash-attn; returns (out, lse) with lse (B, H, Sq) in float32
    (float64 for float64 inputs). ``learnable_sink`` (H,) joins the softmax as an extra column
    without a value, as gpt-oss's eager attention does. Differentiable in every input.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = headdim**-0.5 if softmax_scale is None else softmax_scale
    group = nheads // nheads_k
    qt = q.transpose(1, 2)  # (B, H, Sq, D)
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    rows = torch.arange(seqlen_q).view(-1, 1) + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k).view(1, -1)
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes).to(torch.float32).expand(batch, nheads)
        s = s - (slopes[:, :, None, None] * (rows - cols).abs()).to(s.dtype)
    left, right = window_size
    if causal:
        right = 0
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if right >= 0:
        seen &= cols <= rows + right
    if left >= 0:
        seen &= cols >= rows - left
    s = s.masked_fill(~seen.to(s.device), float("-inf"))
    lse_dtype = torch.float64 if s.dtype == torch.float64 else torch.float32
    if learnable_sink is not None:
        sink = learnable_sink.to(s.dtype).view(1, -1, 1, 1).expand(batch, nheads, seqlen_q, 1)
        full = torch.cat([s, sink], dim=-1)
        lse = torch.logsumexp(full.to(lse_dtype), dim=-1)
        p = torch.softmax(full, dim=-1)[..., :-1]
    else:
        lse = torch.logsumexp(s.to(lse_dtype), dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if dropout_p > 0:
        z = torch.empty(batch, nheads, seqlen_q, seqlen_k)
        r, c = torch.arange(seqlen_q), torch.arange(seqlen_k)
        for b in range(batch):
            for h in range(nheads):
                z[b, h] = keep_mask(dropout_seed, b * nheads + h, r, c, dropout_p) / (1 - dropout_p)
        p = p * z.to(p.dtype).to(p.device)
    out = (p @ vt).transpose(1, 2)
    return out, lse


def assert_same_to_rounding(name: str, got, want) -> None:
    """``got`` and ``want``, two forms of one computation, agree bit for bit in Triton's interpreter
    (CPU tensors: the same NumPy operations) and to one rounding step of their dtype on a GPU, where
    each kernel's compiler orders a reduction's additions and contracts ``a * b + c`` on its own:
    |got - want| <= eps |want| element by element, and the same infinities and NaNs."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype} != {want.shape} {want.dtype}"
    if not got.is_cuda:
        assert torch.equal(got, want), f"{name}: not bit for bit in the interpreter"
        return
    a, b = got.double(), want.double()
    finite = torch.isfinite(b)
    assert torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()) and torch.isfinite(a[finite]).all(), \
        f"{name}: other infinities or NaNs"
    bound = torch.finfo(got.dtype).eps * b[finite].abs() + torch.finfo(got.dtype).tiny
    excess = (a[finite] - b[finite]).abs() - bound
    assert bool((excess <= 0).all()), f"{name}: {int((excess > 0).sum())} elements differ by more than a rounding step"
