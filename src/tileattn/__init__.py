"""tileattn: exact attention computed the FlashAttention way.

Public functions keep flash-attn's names, arguments and layouts, so switching is a change
of import: ``from tileattn import flash_attn_func``.
"""

__version__ = "0.1.0"
