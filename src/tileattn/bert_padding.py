"""flash-attn's ``flash_attn.bert_padding`` under tileattn's name: switch with the import,

    # from flash_attn.bert_padding import pad_input, unpad_input
    from tileattn.bert_padding import pad_input, unpad_input

(the functions live in ``tileattn.ops.padding``).
"""

from .ops.padding import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "unpad_input_for_concatenated_sequences"]
