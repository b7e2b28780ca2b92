"""The CPU backend: the FlashAttention recurrence over tiles, written with torch ops.

Implements the contract of ``tileattn.ops.backend``: ``attn_fwd`` and ``attn_bwd``.
"""
