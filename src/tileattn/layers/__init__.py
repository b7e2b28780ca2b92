"""flash-attn's ``flash_attn.layers`` functions under tileattn's name (``tileattn.layers.rotary``)."""
