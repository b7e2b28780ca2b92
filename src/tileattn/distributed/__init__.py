"""Attention over sequences sharded across processes (torch.distributed: gloo on CPU, NCCL on GPU).

Names, arguments and meanings follow ring-flash-attention:

* ``ring_flash_attn_func``: contiguous shards (rank r holds tokens [r S/W, (r+1) S/W));
* ``zigzag_ring_flash_attn_func``: zigzag shards (chunks r and 2W-1-r of 2W);
* ``ring_flash_attn_varlen_func`` / ``zigzag_ring_flash_attn_varlen_func``: packed documents,
  each cut contiguously / zigzag;
* ``llama3_flash_attn_varlen_func``: packed rows cut contiguously, keys/values all-gathered,
  with ``llama3_flash_attn_prepare_cu_seqlens``;

each with ``_kvpacked`` / ``_qkvpacked`` forms, and the helpers that cut and reassemble shards.
"""

from . import llama3, ring, shard
from .llama3 import (
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
)
from .ring import (
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
    ring_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_varlen_qkvpacked_func,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_kvpacked_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
)
from .shard import (
    contiguous_shard,
    contiguous_shard_varlen,
    contiguous_unshard,
    contiguous_unshard_varlen,
    llama3_flash_attn_prepare_cu_seqlens,
    zigzag_shard,
    zigzag_shard_varlen,
    zigzag_unshard,
    zigzag_unshard_varlen,
)

__all__ = ring.__all__ + llama3.__all__ + shard.__all__
