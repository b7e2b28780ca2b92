"""Input checks shared by every public function: a clear exception before any kernel runs.

Checks on shapes, dtypes and devices are free and always run. Checks that must read tensor
*values* (cu_seqlens, cache lengths, block tables) copy a few integers to the host; they run
in eager mode and are skipped while a CUDA graph is being captured or torch.compile traces,
so a decoding step stays free of host-device synchronisation there.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from ..contract import AttnParams
from .backend import backend_name

MAX_HEADDIM = 256
_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)


def fail(kind: type[Exception], message: str):
    raise kind(message)


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks that read tensor values may run now (no capture, no tracing)."""
    if torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_qkv(q, k, v, *, packed: bool) -> None:
    """dtype, device and shape checks for q (.., H, D), k and v (.., Hk, D).

    Dense tensors are 4-D (batch, seqlen, heads, headdim); packed (varlen) ones 3-D.
    """
    names = ("q", "k", "v")
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not (q.dtype == k.dtype == v.dtype):
        fail(TypeError, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = _LOW_PRECISION + ((torch.float64,) if backend_name(q.device) == "cpu" else ())
    if q.dtype not in allowed:
        fail(TypeError, f"dtype {q.dtype} is not supported here: use one of {', '.join(map(str, allowed))}")
    if not (q.device == k.device == v.device):
        fail(ValueError, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    backend_name(q.device)  # raises for unsupported devices
    want = 3 if packed else 4
    layout = "(total_tokens, nheads, headdim)" if packed else "(batch, seqlen, nheads, headdim)"
    for name, t in zip(names, (q, k, v)):
        if t.dim() != want:
            fail(ValueError, f"{name} must be {want}-D {layout}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        fail(ValueError, f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_heads(q, k)


def check_heads(q, k) -> None:
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    headdim = q.shape[-1]
    if nheads_k == 0 or nheads % nheads_k:
        fail(ValueError, f"nheads of q ({nheads}) must be a multiple of nheads of k/v ({nheads_k})")
    if k.shape[-1] != headdim:
        fail(ValueError, f"q, k, v must share headdim, got q {headdim} and k/v {k.shape[-1]}")
    if not 1 <= headdim <= MAX_HEADDIM:
        fail(ValueError, f"headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")


def last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels take any strides but a unit stride on the last dim; copy only when needed."""
    if t is not None and t.stride(-1) != 1:
        return t.contiguous()
    return t


def check_flags(**flags) -> None:
    """Boolean options (``deterministic``, ``return_attn_probs``, ...) must be bools: a string
    such as "false" would otherwise count as true."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            fail(TypeError, f"{name} must be a bool, got {type(value).__name__}")


def make_params(headdim: int, *, softmax_scale, causal, window_size, softcap, dropout_p, dropout_seed=0) -> AttnParams:
    """Normalise the scalar options into AttnParams; causal becomes window_right = 0."""
    if softmax_scale is None:
        softmax_scale = headdim**-0.5
    if isinstance(softmax_scale, (torch.Tensor, bool)) or not isinstance(softmax_scale, numbers.Real):
        fail(TypeError, f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        fail(ValueError, f"softmax_scale must be finite, got {softmax_scale!r}")
    check_flags(causal=causal)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        fail(TypeError, f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        fail(ValueError, f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if causal:
        right = 0
    if (isinstance(softcap, (torch.Tensor, bool)) or not isinstance(softcap, numbers.Real) or not softcap >= 0
            or not math.isfinite(softcap)):
        fail(ValueError, f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    if isinstance(dropout_p, (torch.Tensor, bool)) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        fail(ValueError, f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return AttnParams(float(softmax_scale), int(left), int(right), float(softcap), float(dropout_p), int(dropout_seed))


def check_alibi(alibi_slopes, batch: int, nheads: int, device) -> torch.Tensor | None:
    """ALiBi slopes (nheads,) or (batch, nheads) fp32 -> a (batch, nheads) view (stride 0 on batch)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        fail(TypeError, "alibi_slopes must be a torch.Tensor of shape (nheads,) or (batch, nheads)")
    if alibi_slopes.dtype != torch.float32:
        fail(TypeError, f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        fail(ValueError, f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    if alibi_slopes.shape not in ((nheads,), (batch, nheads)):
        fail(ValueError, f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {tuple(alibi_slopes.shape)}")
    return alibi_slopes.expand(batch, nheads)


def check_int32_vector(name: str, t, length: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        fail(TypeError, f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        fail(TypeError, f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        fail(ValueError, f"{name} must have shape ({length},), got {tuple(t.shape)}")
    if t.device != device:
        fail(ValueError, f"{name} is on {t.device} but q is on {device}")


def check_cu_seqlens(name: str, cu, total: int, max_seqlen: int) -> None:
    """cu_seqlens starts at 0, never decreases, ends at the number of packed tokens."""
    if not value_checks_enabled(cu):
        return
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        fail(ValueError, f"{name} must start at 0 and end at the number of packed tokens ({total}), "
                         f"got {values[0]} ... {values[-1]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if min(lengths, default=0) < 0:
        fail(ValueError, f"{name} must be non-decreasing, got {values}")
    if max(lengths, default=0) > max_seqlen:
        fail(ValueError, f"a sequence in {name} has {max(lengths)} tokens, more than max_seqlen {max_seqlen}")


def check_cache_values(seqlens, new_tokens: int, capacity: int, block_table=None, block_size: int = 1,
                       num_blocks: int = 0, rotary_len: int | None = None, table_name: str = "block_table",
                       leftpad=None) -> None:
    """KV-cache lengths and block-table entries, read back with one device-to-host copy.

    After appending ``new_tokens``, every length must fit the capacity, and every block-table
    entry that a sequence's keys live in must index the pool (entries past a sequence's last
    page are never read, so they may hold anything). A sequence's ``leftpad`` (the slot its
    keys start at) must lie within 0 .. its length.
    """
    if seqlens.numel() == 0 or not value_checks_enabled(seqlens):
        return
    batch = seqlens.shape[0]
    has_table = block_table is not None and block_table.numel() > 0
    # The one device-to-host copy (lengths and table together), then a few numpy reductions:
    # cheaper on the host than the handful of small reduction kernels the device would run.
    parts = [seqlens] + ([leftpad] if leftpad is not None else []) + ([block_table.reshape(-1)] if has_table else [])
    host = (torch.cat(parts) if len(parts) > 1 else seqlens).cpu().numpy().astype(np.int64)
    lengths = host[:batch]
    if leftpad is not None:
        pads, host = host[batch:2 * batch], np.concatenate([lengths, host[2 * batch:]])
        if (pads < 0).any() or (pads > lengths).any():
            fail(IndexError, f"cache_leftpad must lie within 0..cache_seqlens of each sequence, found "
                             f"{pads.tolist()} for lengths {lengths.tolist()}")
    total = lengths + new_tokens
    lo, hi = int(lengths.min()), int(total.max())
    table = []
    if has_table:
        entries = host[batch:].reshape(batch, -1)
        pages = (total + block_size - 1) // block_size  # (batch,) pages each sequence's keys occupy
        in_use = entries[np.arange(entries.shape[1])[None, :] < pages[:, None]]
        if in_use.size:
            table = [int(in_use.min()), int(in_use.max())]
    if lo < 0 or hi > capacity:
        if new_tokens:
            fail(IndexError, f"appending {new_tokens} tokens needs room for {hi} keys, the cache holds {capacity} "
                             f"per sequence (cache_seqlens found {lo}..{hi - new_tokens})")
        fail(IndexError, f"cache_seqlens must be within 0..{capacity} (the cache's capacity), found {lo}..{hi}")
    if rotary_len is not None and hi > rotary_len:
        fail(IndexError, f"rotary_cos/rotary_sin cover {rotary_len} positions, the new tokens reach position {hi - 1}")
    if table and (table[0] < 0 or table[1] >= num_blocks):
        fail(IndexError, f"{table_name} entries in use must index the cache's {num_blocks} "
                         f"{'blocks' if table_name == 'block_table' else 'rows'}, found {table[0]}..{table[1]}")
