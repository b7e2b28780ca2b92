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

from . import _validate as V

__all__ = ["apply_rotary", "check_rotary"]


def check_rotary(rotary_cos, rotary_sin, headdim: int, device) -> int:
    """Shapes, dtypes and devices of the tables; returns seqlen_ro (how many positions they cover)."""
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            V.fail(ValueError, f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2), got {getattr(t, 'shape', t)}")
        if not t.is_floating_point():
            V.fail(TypeError, f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != device:
            V.fail(ValueError, f"{name} is on {t.device} but q is on {device}")
    if rotary_cos.shape != rotary_sin.shape:
        V.fail(ValueError, f"rotary_cos and rotary_sin must have one shape, got {tuple(rotary_cos.shape)} and "
                           f"{tuple(rotary_sin.shape)}")
    if not 0 < 2 * rotary_cos.shape[1] <= headdim:
        V.fail(ValueError, f"rotary_dim (2 x {rotary_cos.shape[1]}) must be between 1 and headdim ({headdim})")
    return rotary_cos.shape[0]


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
