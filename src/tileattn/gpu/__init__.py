"""The Triton backend: launchers for the jit kernels of ``tileattn.kernels``.

Implements the contract of ``tileattn.ops.backend``: ``attn_fwd`` and ``attn_bwd``.
"""
