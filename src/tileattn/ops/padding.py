"""Between padded batches and packed (varlen) ones: flash-attn's ``bert_padding`` helpers.

A padded batch is (batch, seqlen, ...) with an ``attention_mask`` (batch, seqlen) that is 1 on
real tokens and 0 on padding (on either side, or anywhere). The packed form keeps the real
tokens only, (total, ...), in row-major order of the mask, with ``cu_seqlens`` (batch + 1,)
int32 marking where each sequence starts: what ``flash_attn_varlen_func`` takes.

    x, indices, cu_seqlens, max_seqlen, used = unpad_input(hidden, mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    hidden = pad_input(out, indices, batch, seqlen)      # zeros where the mask was 0

Same names, arguments and returns as ``flash_attn.bert_padding`` (flash-attn 2.6 and later:
``unpad_input`` returns the used lengths as a fifth value), so
``from tileattn.bert_padding import unpad_input, pad_input`` replaces flash-attn's import.
Gradients flow through every function (a gather and its scatter). ``unpad_input`` reads the
mask's values on the host (max_seqlen is a Python int), as flash-attn's does.
"""

from __future__ import annotations

import torch

from . import _validate as V

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "unpad_input_for_concatenated_sequences"]


def _check_indices(indices, name: str = "indices") -> None:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        V.fail(TypeError, f"{name} must be a 1-D int64 (or int32) tensor, got "
                          f"{getattr(indices, 'dtype', type(indices).__name__)} of shape "
                          f"{tuple(getattr(indices, 'shape', ()))}")


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows ``x[indices]`` of ``x`` (n, ...), differentiable (the gradient scatters back)."""
    _check_indices(indices)
    return x.index_select(0, indices.to(device=x.device, dtype=torch.long))


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor (first_axis_dim, ...) with row ``indices[i]`` set to ``values[i]``; differentiable."""
    _check_indices(indices)
    if indices.numel() != values.shape[0]:
        V.fail(ValueError, f"indices has {indices.numel()} entries for {values.shape[0]} rows of values")
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices.to(device=values.device, dtype=torch.long), values)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (n + 1,) int32 of the sequence lengths (n,): 0, then their running sums."""
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    return cu_seqlens


def _mask_lengths(name: str, mask, hidden_states) -> torch.Tensor:
    """The mask as bool (batch, seqlen), checked: shape of hidden_states' first two dims, 0/1 values."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        V.fail(ValueError, f"{name} must be a (batch, seqlen) tensor, got "
                           f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        V.fail(ValueError, f"{name} has shape {tuple(mask.shape)}, hidden_states starts with "
                           f"{tuple(hidden_states.shape[:2])} (batch, seqlen)")
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex():
            V.fail(TypeError, f"{name} must hold 0/1 as bool or integers, got {mask.dtype}")
        bad = mask[(mask != 0) & (mask != 1)]
        if bad.numel():  # name the offending values: the mask's max is 1 when they are negative
            V.fail(ValueError, f"{name} must hold only 0 and 1 (1 = a real token), found "
                               f"{bad.unique()[:4].tolist()}")
        mask = mask.bool()
    return mask


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """Pack the tokens of ``hidden_states`` (batch, seqlen, ...) where ``attention_mask`` is 1.

    ``unused_mask`` (batch, seqlen), optional: tokens kept in the packed rows (slots allocated)
    but not counted as used; they must not overlap the attention mask's tokens.

    Returns ``(hidden (total, ...), indices (total,) int64 into the flattened batch,
    cu_seqlens (batch + 1,) int32, max_seqlen (int), used (batch,) int32)``, where ``used``
    counts the attention mask's tokens only.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        V.fail(ValueError, "hidden_states must be a tensor of at least 2 dims (batch, seqlen, ...)")
    used_mask = _mask_lengths("attention_mask", attention_mask, hidden_states)
    kept = used_mask
    if unused_mask is not None:
        unused = _mask_lengths("unused_mask", unused_mask, hidden_states)
        if bool((unused & used_mask).any()):
            V.fail(ValueError, "unused_mask and attention_mask overlap: a token is either used or unused")
        kept = used_mask | unused
    lengths = kept.sum(dim=1, dtype=torch.int32)
    cu_seqlens = _offsets(lengths)
    indices = kept.flatten().nonzero().flatten()
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    packed = index_first_axis(hidden_states.flatten(0, 1), indices)
    return packed, indices, cu_seqlens, max_seqlen, used_mask.sum(dim=1, dtype=torch.int32)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of ``unpad_input``: packed rows (total, ...) back to (batch, seqlen, ...),
    zeros where no row goes."""
    batch, seqlen = V.integer("batch", batch, 0), V.integer("seqlen", seqlen, 0)
    _check_indices(indices)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= batch * seqlen):
        V.fail(IndexError, f"indices must lie within 0..{batch * seqlen - 1} (batch x seqlen), found "
                           f"{int(indices.min())}..{int(indices.max())}")
    return index_put_first_axis(hidden_states, indices, batch * seqlen).unflatten(0, (batch, seqlen))


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Pack rows that each hold several sequences back to back (sample packing).

    ``attention_mask_in_length`` (batch, seqlen): row b lists the lengths of the sequences packed
    in row b of ``hidden_states``, then zeros, e.g. [2, 3, 0, 0, 0] for a row holding sequences
    of 2 and 3 tokens (then 0 to 2 padding tokens). Each sequence becomes a sequence of its own.
    Returns ``(hidden (total, ...), indices, cu_seqlens, max_seqlen)``.
    """
    lengths_2d = attention_mask_in_length
    if not isinstance(lengths_2d, torch.Tensor) or tuple(lengths_2d.shape) != tuple(hidden_states.shape[:2]):
        V.fail(ValueError, f"attention_mask_in_length must be a (batch, seqlen) tensor shaped like hidden_states' "
                           f"first two dims {tuple(hidden_states.shape[:2])}")
    if lengths_2d.is_floating_point() or lengths_2d.dtype == torch.bool or bool((lengths_2d < 0).any()):
        V.fail(ValueError, "attention_mask_in_length must hold non-negative integer lengths")
    seqlen = lengths_2d.shape[1]
    if bool((lengths_2d.sum(dim=1) > seqlen).any()):
        V.fail(ValueError, f"a row of attention_mask_in_length packs more than its {seqlen} tokens")
    lengths = lengths_2d.flatten()
    lengths = lengths[lengths > 0].to(torch.int32)
    # tokens in use: in row b, the first sum(lengths of b) positions
    kept = torch.arange(seqlen, device=lengths_2d.device)[None, :] < lengths_2d.sum(dim=1, keepdim=True)
    indices = kept.flatten().nonzero().flatten()
    cu_seqlens = _offsets(lengths)
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen
