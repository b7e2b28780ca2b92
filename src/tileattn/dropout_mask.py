"""The dropout mask as a counter-based hash: the same bits in NumPy, torch and Triton.

Whether probability ``P[b, h, i, j]`` is kept depends only on ``(seed, b * nheads + h, i, j)``,
never on tile sizes, the order of work or the device, so the backward pass, the CPU path,
the Triton kernels and the float64 reference all regenerate exactly the same mask.

    row  = fmix32(fmix32(seed + bh * 0x9E3779B9) ^ i)
    bits = fmix32(row ^ (j * 0x27D4EB2F))             (all arithmetic mod 2**32)
    keep = (bits >> 8) >= round(p * 2**24)

``fmix32`` is MurmurHash3's 32-bit finaliser. ``i`` and ``j`` are positions inside the
sequence (for packed batches, inside that sequence), ``bh`` counts query heads over the batch.
The Triton twin lives in ``tileattn/kernels/common.py`` and is checked against this one.
"""

from __future__ import annotations

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
COL_MUL = 0x27D4EB2F


def fmix32(h):
    """MurmurHash3 finaliser on 32-bit values held in a wider integer array (numpy or torch)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def keep_threshold(dropout_p: float) -> int:
    """Bits below this threshold drop the element: ``round(p * 2**24)``."""
    return int(round(dropout_p * (1 << 24)))


def keep_mask(seed: int, bh: int, rows, cols, dropout_p: float):
    """Boolean keep-mask of shape ``(len(rows), len(cols))``.

    ``rows`` and ``cols`` are 1-D integer arrays (numpy ``uint64``/``int64`` or torch
    ``int64``) of query and key positions; the result has the array type of ``rows``.
    """
    base = fmix32((int(seed) + int(bh) * GOLDEN) & M32)
    row = fmix32(base ^ (rows & M32))
    col = (cols * COL_MUL) & M32
    bits = fmix32(row[:, None] ^ col[None, :])
    return (bits >> 8) >= keep_threshold(dropout_p)
