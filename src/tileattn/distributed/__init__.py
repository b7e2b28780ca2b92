"""Ring attention across processes on torch.distributed (gloo on CPU, NCCL on GPU)."""

from . import ring
from .ring import (
    LAYOUTS,
    contiguous_shard,
    contiguous_unshard,
    ring_flash_attn_func,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = list(ring.__all__)
