"""Rotary position embedding for ``flash_attn_with_kvcache``'s ``rotary_cos`` / ``rotary_sin``.

With ``cos, sin`` of shape (seqlen_ro, rotary_dim / 2), the first ``rotary_dim`` features of
a head vector x at position p are rotated pairwise by the angles of row p:

    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)

where the pairs are features (0, 1), (2, 3), ... when ``interleaved`` (GPT-J) or
(i, i + rotary_dim / 2) otherwise (GPT-NeoX); features past ``rotary_dim`` are left as they
are. Computed in fp32 with torch ops on the device (no host synchronisation).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, nheads, headdim) rotated at ``positions`` (batch, seqlen) int64."""
    half = cos.shape[1]
    c = cos[positions].float().unsqueeze(2)  # (batch, seqlen, 1, half): one angle per pair, all heads
    s = sin[positions].float().unsqueeze(2)
    xr = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)
