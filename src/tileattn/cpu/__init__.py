"""The CPU backend: the FlashAttention recurrence over tiles, written with torch ops.

Implements the contract of ``tileattn.contract``: ``attn_fwd``, ``attn_bwd`` and ``merge_parts``.
"""

from .attention import attn_bwd, attn_fwd, merge_parts

__all__ = ["attn_fwd", "attn_bwd", "merge_parts"]
