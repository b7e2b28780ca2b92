"""The Triton backend: launchers for the jit kernels of ``tileattn.kernels``.

Implements the contract of ``tileattn.contract``: ``attn_fwd`` and ``attn_bwd``; and
``append_kv``, the one-launch append of a decoding step's keys and values to its cache
(``prepare_append``: its plan for a call signature, the ops layer's decoding lane), and
``plan_fwd``, the forward's launch plan for callers that launch it many times (``DecodePlan``);
``prepare_fwd``, the forward decided once for a call signature (the ops layer's fast lane);
``prepare_bwd``, the backward decided once for a forward signature (the ops layer's graph lane);
``plan_partials``, a paged sequence's attention as unmerged split partial states (a cascade's
prefix); ``merge_parts``, one launch merging partial states (``tileattn.contract``).
"""

from .attention import attn_fwd, plan_fwd, plan_partials
from .combine import merge_parts
from .backward import attn_bwd, prepare_bwd
from .kvcache import append_kv, prepare_append
from .prepared import prepare_fwd

__all__ = ["attn_fwd", "attn_bwd", "append_kv", "merge_parts", "plan_fwd", "plan_partials", "prepare_append",
           "prepare_fwd", "prepare_bwd"]
