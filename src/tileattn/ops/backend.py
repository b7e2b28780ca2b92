"""Which code computes attention: ``tileattn.gpu`` or ``tileattn.cpu``.

Both implement the contract of ``tileattn.contract`` (``attn_fwd`` / ``attn_bwd``):

* ``tileattn.gpu``  — launchers of the Triton kernels in ``tileattn.kernels`` (CUDA tensors,
  or CPU tensors under ``TRITON_INTERPRET=1``);
* ``tileattn.cpu``  — the same recurrence over tiles written with torch ops (CPU tensors).

``TILEATTN_BACKEND=triton`` forces the Triton path (how CI runs the kernels in Triton's
interpreter); ``TILEATTN_BACKEND=cpu`` forces the torch tiles; unset, the device decides.
"""

from __future__ import annotations

import torch

from .._env import getenv

__all__ = ["backend_for", "backend_name"]


def backend_name(device: torch.device) -> str:
    """'triton' or 'cpu' for tensors on ``device`` (see the module docstring). The variable is
    read on every call; the answer for each (value, device type) is kept once it is valid."""
    raw = getenv("TILEATTN_BACKEND", "")
    name = _NAMES.get((raw, device.type))
    if name is None:
        name = _NAMES[(raw, device.type)] = _backend_name(raw, device)
    return name


def _backend_name(raw: str, device: torch.device) -> str:
    forced = raw.strip().lower()
    if forced not in ("", "triton", "cpu"):
        raise ValueError(f"TILEATTN_BACKEND must be 'triton' or 'cpu', not {forced!r}")
    if forced:
        if forced == "cpu" and device.type != "cpu":
            raise ValueError("TILEATTN_BACKEND=cpu needs CPU tensors")
        return forced
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "cpu"
    raise ValueError(f"tileattn runs on CUDA and CPU tensors, not on {device.type!r}")


def backend_for(device: torch.device):
    """The module (``tileattn.gpu`` or ``tileattn.cpu``) implementing attn_fwd / attn_bwd."""
    name = backend_name(device)
    module = _MODULES.get(name)
    if module is None:  # imported on first use: the CPU path never loads Triton
        if name == "triton":
            from .. import gpu as module
        else:
            from .. import cpu as module
        _MODULES[name] = module
    return module


_MODULES: dict = {}
_NAMES: dict = {}
