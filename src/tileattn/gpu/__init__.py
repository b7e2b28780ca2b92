"""The Triton backend: launchers for the jit kernels of ``tileattn.kernels``.

Implements the contract of ``tileattn.contract``: ``attn_fwd`` and ``attn_bwd``.
"""

from .attention import attn_fwd
from .backward import attn_bwd

__all__ = ["attn_fwd", "attn_bwd"]
