"""Checks once per call signature: what a public function's metadata checks worked out, kept.

A model calls the same function with the same shapes and options in every layer and every
decoding step. The checks that read only metadata (types, shapes, strides, dtypes, devices,
option values, the backend variable) give the same answer for the same signature, so a
function keys what they returned (``AttnParams``, capacities, ...) on ``signature(...)`` and
runs them again only for a signature it has not seen pass. A key holds everything such a
check reads: per tensor its type, shape, strides, dtype, device and requires_grad; per option
its type and value (``True`` and ``1`` differ: one passes ``check_flags``, the other not);
the ``TILEATTN_BACKEND`` value and grad mode; and whether v starts where k does (``kv``): a
``v`` that is a view of ``k[..., :headdim_v]`` (MLA's latent) is read from the key tile by the
Triton plans (``gpu.attention._v_is_k``), so a launch kept for such a call must not serve a
call whose v is another tensor of the same shape and strides, nor the other way round.
Checks of tensor *values* (lengths, block tables) are no part of it and run on every call, as
do the checks that return a tensor derived from this call's (``check_alibi``, ``check_sink``,
``cache_lengths``, ...).

An entry also keeps what the call's launch needs (``_custom.prepare``; on the Triton backend the
plan, its arguments, the output shapes and the value check's launch; on the CPU tiles the bound
options): a later call of the signature that needs no autograd graph goes from the key straight
to its value checks and that launch.

A call that cannot be keyed exactly takes the full checks every time: an argument that is a
tensor subclass (``nn.Parameter`` included), a Python int where a tensor may stand (a length),
a list or other container as an option, and anything while torch.compile traces or a forward-mode
AD level is open (``torch.autograd.forward_ad.dual_level``: an input may carry a tangent, which
no key holds; ``_custom.attention`` refuses such inputs, where a kept CPU lane returned a zero
tangent and the Triton one none).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad

from .._env import getenv

__all__ = ["Memo", "signature"]

_OPTION_TYPES = frozenset((bool, int, float, str, type(None)))


def signature(tensors: tuple, options: tuple, window_size, kv: tuple[int, int] | None = None) -> tuple | None:
    """A hashable key of ``tensors`` (each a ``torch.Tensor`` or None), ``options`` (plain bools,
    ints, floats, strings or None) and ``window_size`` (a tuple of two ints), or None where one
    of them is anything else. ``kv``: the positions of k and v in ``tensors`` (callers that take
    them), whose sharing of a start address is then part of the key (the module docstring)."""
    kinds = tuple(map(type, options))
    if (not _OPTION_TYPES.issuperset(kinds) or type(window_size) is not tuple or len(window_size) != 2
            or type(window_size[0]) is not int or type(window_size[1]) is not int
            or torch.compiler.is_compiling() or getattr(_forward_ad, "_current_level", -1) >= 0):
        return None
    key = [getenv("TILEATTN_BACKEND", ""), torch.is_grad_enabled(), options, kinds, window_size]
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is torch.Tensor:
            key.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
        else:
            return None
    if kv is not None:
        k, v = tensors[kv[0]], tensors[kv[1]]
        key.append(k is not None and v is not None and k.data_ptr() == v.data_ptr())
    return tuple(key)


class Memo:
    """What the checks returned, by signature; at most ``size`` of them (then it starts over)."""

    def __init__(self, size: int = 256):
        self.size, self.entries = size, {}

    def get(self, key):
        # a method, not the dict's own bound ``get`` kept as an attribute: torch 2.11's dynamo cannot
        # trace that builtin (fullgraph compiles of flash_attn_func failed on the GPU host, 2026-12-01)
        return None if key is None else self.entries.get(key)

    def put(self, key, value) -> None:
        if key is None:
            return
        if len(self.entries) >= self.size:
            self.entries.clear()
        self.entries[key] = value

    def clear(self) -> None:
        self.entries.clear()
