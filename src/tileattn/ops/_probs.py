"""``return_attn_probs``: the attention probabilities as a full (N x N) tensor, for tests only.

Recomputed from q, k and the LSE the kernel returned, so they show what the kernel used:
P[b, h, i, j] = exp(s_ij - lse_i); entries dropped by dropout are negated (flash-attn's
convention: negative means dropped). This materialises O(seqlen_q * seqlen_k) memory.
"""

from __future__ import annotations

import torch

from ..dropout_mask import keep_mask
from ..contract import AttnParams


def attention_probs(q, k, lse, params: AttnParams, alibi_slopes) -> torch.Tensor:
    """(batch, nheads, seqlen_q, seqlen_k) in the LSE's dtype (fp64 for fp64 inputs, else fp32),
    computed with autocast off: its matmul would otherwise run in the autocast dtype."""
    with torch.autocast(q.device.type, enabled=False):
        return _probs(q, k, lse, params, alibi_slopes)


def _probs(q, k, lse, params: AttnParams, alibi_slopes) -> torch.Tensor:
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.detach().to(acc).transpose(1, 2)  # (B, H, Sq, D)
    kf = k.detach().to(acc).transpose(1, 2).repeat_interleave(group, dim=1)  # (B, H, Sk, D)
    s = (qf @ kf.transpose(-1, -2)) * params.softmax_scale
    if params.softcap > 0:
        s = params.softcap * torch.tanh(s / params.softcap)
    rows = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes[:, :, None, None] * (rows - cols).abs()
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if params.window_right >= 0:
        seen &= cols <= rows + params.window_right
    if params.window_left >= 0:
        seen &= cols >= rows - params.window_left
    live = torch.isfinite(lse.detach().to(acc))[..., None]
    p = torch.where(seen & live, torch.exp(s - lse.detach().to(acc)[..., None]), 0.0)
    if params.dropout_p > 0:
        r = torch.arange(seqlen_q, dtype=torch.int64, device="cpu")
        c = torch.arange(seqlen_k, dtype=torch.int64, device="cpu")
        sign = torch.stack([
            torch.stack([keep_mask(params.dropout_seed, b * nheads + h, r, c, params.dropout_p)
                         for h in range(nheads)]) for b in range(batch)
        ]).to(q.device)
        p = torch.where(sign, p, -p)
    return p
