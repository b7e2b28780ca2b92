"""The CPU backend: the FlashAttention recurrence over tiles, written with torch ops.

Implements the contract of ``tileattn.contract``: ``attn_fwd`` and ``attn_bwd``.
"""

from .attention import attn_bwd, attn_fwd

__all__ = ["attn_fwd", "attn_bwd"]
