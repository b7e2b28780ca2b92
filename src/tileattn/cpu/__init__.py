"""The CPU backend: the FlashAttention recurrence over tiles, written with torch ops.

Implements the contract of ``tileattn.contract``: ``attn_fwd``, ``attn_bwd`` and ``merge_parts``;
and ``prepare_fwd``, the forward with a call signature's options bound (the ops layer's fast lane).
"""

from .attention import attn_bwd, attn_fwd, merge_parts
from .prepared import prepare_fwd

__all__ = ["attn_fwd", "attn_bwd", "merge_parts", "prepare_fwd"]
