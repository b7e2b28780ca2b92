"""FP8 KV caches: keys and values stored in ``float8_e4m3fn`` with per-(sequence, KV head) descales.

flash-attn 3's convention: ``k_descale``/``v_descale`` are float32 (batch, nheads_k) and the
real keys are ``stored.float() * k_descale[b, h]`` (values likewise). Appending new keys
quantises them with the same scale, ``stored = saturate(k / k_descale[b, h])``: rounded to the
nearest e4m3 value and saturated to +-448 (e4m3fn has no infinity; a plain cast of a larger
value gives NaN).

e4m3 keeps 3 mantissa bits: a quantised value is within 2^-4 of its magnitude (half a unit in
the last place) when normal, and within 2^-10 x descale when subnormal (below 2^-6 x descale).
The kernels convert the stored values exactly to q's dtype and fold the descales into the score
scale (k) and the output (v): they compute attention over the dequantised cache. The checks of
these arguments are ``tileattn.ops._validate``'s (``check_qkv``, ``check_descales``).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "is_fp8", "quantize"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == FP8_DTYPE


def quantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """x (batch, seqlen, nheads_k, headdim) -> float8_e4m3fn values x / descale[b, h], saturated."""
    scaled = x.float() / descale[:, None, :, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
