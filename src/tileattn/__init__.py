"""tileattn: exact attention computed the FlashAttention way.

Public functions keep flash-attn's names, arguments and layouts, so switching is a change
of import: ``from tileattn import flash_attn_func``. On CUDA tensors they run Triton
kernels; on CPU tensors, the same recurrence over tiles in torch. ``tileattn.reference``
holds the float64 NumPy ground truth.
"""

from .ops.attention import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .ops.cascade import cascade_attn_with_kvcache
from .ops.decode_plan import DecodePlan
from .ops.kvcache import flash_attn_with_kvcache
from .ops.merge import merge_many, merge_sink, merge_states
from .ops.paged_cache import PagedKVCache
from .ops.varlen import flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "cascade_attn_with_kvcache",
    "DecodePlan",
    "merge_states",
    "merge_many",
    "merge_sink",
    "PagedKVCache",
]
