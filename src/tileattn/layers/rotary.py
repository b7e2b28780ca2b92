"""flash-attn's ``flash_attn.layers.rotary.apply_rotary_emb`` under tileattn's name:

    # from flash_attn.layers.rotary import apply_rotary_emb
    from tileattn.layers.rotary import apply_rotary_emb

(the function lives in ``tileattn.ops.rotary``, with the rotation ``flash_attn_with_kvcache`` uses).
"""

from ..ops.rotary import apply_rotary_emb

__all__ = ["apply_rotary_emb"]
