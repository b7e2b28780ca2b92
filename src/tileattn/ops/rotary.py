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

__all__ = ["apply_rotary", "apply_rotary_emb"]


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


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None) -> torch.Tensor:
    """flash-attn's ``flash_attn.layers.rotary.apply_rotary_emb``: x rotated at its tokens' positions.

    x (batch, seqlen, nheads, headdim), or packed (total, nheads, headdim) with ``cu_seqlens``
    (batch + 1,) int32; token i of sequence b sits at position ``seqlen_offsets`` (an int, or
    (batch,) integers) + i, whose row of ``cos, sin`` (seqlen_ro, rotary_dim / 2) rotates its first
    rotary_dim features (pairs as ``apply_rotary``; GPT-NeoX's halves unless ``interleaved``).
    ``inplace`` writes the result into x and returns x. Differentiable in x, cos and sin.
    ``max_seqlen`` is accepted for flash-attn's signature and bounds the packed sequences' lengths.
    """
    V.check_flags(interleaved=interleaved, inplace=inplace)
    packed = cu_seqlens is not None
    if not isinstance(x, torch.Tensor) or x.dim() != (3 if packed else 4) or not x.is_floating_point():
        V.fail(ValueError, f"x must be a floating-point tensor of shape "
                           f"{'(total, nheads, headdim) with cu_seqlens' if packed else '(batch, seqlen, nheads, headdim)'}"
                           f", got {getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    seqlen_ro = V.rotary_tables(cos, sin, x.shape[-1], x.device, names=("cos", "sin"), owner="x")
    if packed:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            V.fail(ValueError, f"cu_seqlens must be a 1-D int32 tensor of length batch + 1 (>= 2), got "
                               f"{getattr(cu_seqlens, 'shape', cu_seqlens)!r}")
        batch = cu_seqlens.shape[0] - 1
        V.check_int32_vector("cu_seqlens", cu_seqlens, batch + 1, x.device)
        longest = x.shape[0] if max_seqlen is None else V.integer("max_seqlen", max_seqlen, 0)
        V.check_cu_seqlens("cu_seqlens", cu_seqlens, x.shape[0], longest)
    else:
        batch, longest = x.shape[0], x.shape[1]
    offsets = _offsets(seqlen_offsets, batch, x.device)
    # positions: every sequence's tokens, counted from its offset
    if packed:
        token = torch.arange(x.shape[0], device=x.device)
        seq = torch.searchsorted(cu_seqlens[1:], token.to(torch.int32), right=True)  # the sequence of each token
        positions = (token - cu_seqlens.long()[seq] + (offsets[seq] if isinstance(offsets, torch.Tensor) else offsets))
        positions = positions.unsqueeze(0)  # (1, total)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    else:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0) + (
            offsets.unsqueeze(1) if isinstance(offsets, torch.Tensor) else offsets)  # (batch or 1, seqlen)
        lengths = None
    _check_reach(offsets, lengths, longest, seqlen_ro, packed)
    x4 = x.unsqueeze(0) if packed else x
    rotated = apply_rotary(x4, cos, sin, positions.expand(x4.shape[0], -1), interleaved)
    rotated = rotated.squeeze(0) if packed else rotated
    if inplace:
        rd = 2 * cos.shape[1]
        x[..., :rd] = rotated[..., :rd]
        return x
    return rotated


def _offsets(seqlen_offsets, batch: int, device):
    """seqlen_offsets as a Python int or an int64 (batch,) tensor on ``device``."""
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.dim() == 1:
        if seqlen_offsets.is_floating_point() or seqlen_offsets.dtype == torch.bool:
            V.fail(TypeError, f"seqlen_offsets must hold integers, got {seqlen_offsets.dtype}")
        if seqlen_offsets.shape[0] != batch:
            V.fail(ValueError, f"seqlen_offsets must have shape ({batch},) (one per sequence), got "
                               f"{tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != device:
            V.fail(ValueError, f"seqlen_offsets is on {seqlen_offsets.device} but x is on {device}")
        return seqlen_offsets.long()
    return V.integer("seqlen_offsets", seqlen_offsets, 0)


def _check_reach(offsets, lengths, longest: int, seqlen_ro: int, packed: bool) -> None:
    """Every rotated position (offset + token index) has a row of cos/sin, and offsets are >= 0:
    at once for an int offset of a dense batch, else as the other value checks (``_validate``)."""
    what = f"cos/sin cover {seqlen_ro} positions: seqlen_offsets + the sequence's length must not exceed it"
    if not isinstance(offsets, torch.Tensor) and not packed:
        if offsets + longest > seqlen_ro:
            V.fail(IndexError, f"{what} (offset {offsets} + {longest} tokens)")
        return
    mode = V.value_mode(lengths if lengths is not None else offsets)
    reach = offsets + (lengths if lengths is not None else longest)  # the end of each sequence's positions
    low = offsets if isinstance(offsets, torch.Tensor) else torch.full_like(reach, offsets)
    if mode == "device":
        V.assert_on_device(V.within(reach, 0, seqlen_ro) & V.within(low, 0, seqlen_ro), what)
    elif mode == "host" and reach.numel() and (int(reach.max()) > seqlen_ro or int(low.min()) < 0):
        V.fail(IndexError, f"{what}, and offsets must be >= 0 (found ends up to {int(reach.max())}, offsets from "
                           f"{int(low.min())})")
