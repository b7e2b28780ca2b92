"""Every input check of the public functions, in one place: a clear exception before anything runs.

Each public function calls these checks first, all of them, and only then rotates, appends
or launches anything, so a bad argument never leaves a cache half-written. The backends and
the launchers take validated inputs and do not check again.

Checks on types, shapes, dtypes and devices only read the host's metadata and always run.
Checks that read tensor *values* (cu_seqlens, cache lengths, block tables, left pads) run
the way ``value_mode`` says:

* ``"host"`` — on CPU tensors (no synchronisation to pay), and on CUDA tensors when
  ``TILEATTN_DEBUG_CHECKS=1``: the values are read on the host and a failing check raises
  an exception that names the argument and the offending values;
* ``"device"`` — on CUDA tensors by default: the check is a few reductions ending in one
  ``torch._assert_async``, which never synchronises; a failure is reported by the device
  (``device-side assert triggered``) at a later synchronisation, and rerunning with
  ``TILEATTN_DEBUG_CHECKS=1`` names the problem;
* ``None`` — no value check: while torch.compile traces, while a CUDA graph is captured (a
  replay must stay lean), with ``TILEATTN_DEBUG_CHECKS=0`` (flash-attn's behaviour: bad
  values are undefined behaviour), and for tensors that ``PagedKVCache`` produced and
  vouched for (``vouch``): the host already knows those values.
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch

from .._env import getenv
from ..contract import AttnParams
from .backend import backend_name
from .fp8 import FP8_DTYPE, is_fp8

# q/k's head dim (576: MLA's absorbed latent; on the Triton path above 256 as a power-of-two part and
# a tail, gpu.attention._split_head_dim) and v's own head dim, where it may differ from q/k's
MAX_HEADDIM = {"cpu": 576, "triton": 576}
MAX_HEADDIM_V = {"cpu": 512, "triton": 512}
# ... when a gradient may be asked for: the Triton backward's tiles stop at 256 (wider head dims
# run forward only there: MLA decoding; the CPU tiles train them)
MAX_HEADDIM_GRAD = {"cpu": 576, "triton": 256}
MAX_GRID = 65535  # batch and heads are grid axes of the Triton backward
DEBUG_ENV = "TILEATTN_DEBUG_CHECKS"
_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)


def fail(kind: type[Exception], message: str):
    raise kind(message)


# ------------------------------------------------------------------------ scalar options


def integer(name: str, value, minimum: int | None = None) -> int:
    """An integer-like (int, numpy integer, 0-d integer tensor) as a Python int.

    bool, float and multi-element values are refused (a float window or length is a bug in
    the caller, not something to round)."""
    if type(value) is not int:
        given = value
        bad = isinstance(value, (bool, np.bool_)) or (
            isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool
                                                 or value.is_floating_point() or value.is_complex()))
        try:
            value = None if bad else operator.index(value)
        except TypeError:
            value = None
        if value is None:
            fail(TypeError, f"{name} must be an integer (int, numpy integer or 0-d integer tensor), got {given!r}")
    if minimum is not None and value < minimum:
        fail(ValueError, f"{name} must be >= {minimum}, got {value}")
    return value


UNBOUNDED_WINDOW = 2**30  # a window side this wide reaches every key of any sequence a GPU can hold: -1


def window(window_size) -> tuple[int, int]:
    """(left, right) from any pair of integer-likes: tuple, list, tensor or numpy array of 2. A side
    of ``UNBOUNDED_WINDOW`` or more is -1 (unbounded), as it means: the kernels add a side to a
    position in int32, and a side near 2**31 wrapped around (a window that hid keys it covered)."""
    if type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int \
            and type(window_size[1]) is int and -1 <= window_size[0] < UNBOUNDED_WINDOW \
            and -1 <= window_size[1] < UNBOUNDED_WINDOW:
        return window_size  # the usual case, (-1, -1) or a window of ints, without the general path
    if isinstance(window_size, (torch.Tensor, np.ndarray)) and window_size.ndim == 1 and len(window_size) == 2:
        if window_size.dtype in (torch.bool, np.bool_) or not (
                (isinstance(window_size, torch.Tensor) and not window_size.is_floating_point()
                 and not window_size.is_complex())
                or (isinstance(window_size, np.ndarray) and np.issubdtype(window_size.dtype, np.integer))):
            fail(TypeError, f"window_size must hold integers, got dtype {window_size.dtype}")
        entries = window_size.tolist()
    elif isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        entries = window_size
    else:
        fail(TypeError, f"window_size must be a pair of integers (left, right), got {window_size!r}")
    left, right = (integer(f"window_size[{i}]", w) for i, w in enumerate(entries))
    if left < -1 or right < -1:
        fail(ValueError, f"window_size entries must be >= -1 (-1 = unbounded), got {(left, right)}")
    return tuple(-1 if w >= UNBOUNDED_WINDOW else w for w in (left, right))


def check_flags(**flags) -> None:
    """Boolean options (``deterministic``, ``return_attn_probs``, ...) must be bools: a string
    such as "false" would otherwise count as true."""
    for name, value in flags.items():
        if value is not True and value is not False:
            fail(TypeError, f"{name} must be a bool, got {type(value).__name__}")


def _real(value) -> bool:
    return type(value) is float or type(value) is int or (
        isinstance(value, numbers.Real) and not isinstance(value, (bool, torch.Tensor)))


def make_params(headdim: int, *, softmax_scale, causal, window_size, softcap, dropout_p, dropout_seed=0) -> AttnParams:
    """Normalise the scalar options into AttnParams; causal becomes window_right = 0. Options
    of exactly the plain Python types that passed before are answered from a small cache
    (AttnParams is frozen), as every layer of a model repeats them."""
    key = None
    if (type(window_size) is tuple and type(causal) is bool and type(softcap) in (float, int)
            and type(dropout_p) in (float, int) and type(softmax_scale) in (float, int, type(None))
            and type(dropout_seed) is int and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int):
        key = (headdim, softmax_scale, causal, window_size, softcap, dropout_p, dropout_seed)
        params = _PARAMS.get(key)
        if params is not None:
            return params
    params = _make_params(headdim, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed)
    if key is not None:
        if len(_PARAMS) >= 256:
            _PARAMS.clear()
        _PARAMS[key] = params
    return params


_PARAMS: dict = {}
_FP32_MAX = float(torch.finfo(torch.float32).max)
_MAX_FACTOR = _FP32_MAX / math.log2(math.e)  # the largest x whose x * log2(e) is a float32


def _make_params(headdim: int, *, softmax_scale, causal, window_size, softcap, dropout_p, dropout_seed) -> AttnParams:
    if softmax_scale is None:
        softmax_scale = headdim**-0.5
    if not _real(softmax_scale):
        fail(TypeError, f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        fail(ValueError, f"softmax_scale must be finite, got {softmax_scale!r}")
    if abs(softmax_scale) > _MAX_FACTOR:  # scale * log2(e) must be a float32: else inf, NaN scores
        fail(ValueError, f"softmax_scale must lie within +-{_MAX_FACTOR:.4g} (scale * log2(e) is a float32 in the "
                         f"kernels), got {softmax_scale!r}")
    check_flags(causal=causal)
    left, right = window(window_size)
    if causal:
        right = 0
    if not _real(softcap) or not softcap >= 0 or not math.isfinite(softcap):
        fail(ValueError, f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    # the kernels compute cap * tanh(s * scale / cap) with cap * log2(e) and scale / cap as float32 factors:
    # one that overflows (a softcap of 1e39, or of 1e-40 with scale 0.1) turned every score into NaN
    if softcap > 0 and (softcap > _MAX_FACTOR or abs(softmax_scale) / softcap > _FP32_MAX):
        fail(ValueError, f"softcap must lie within |softmax_scale| / {_FP32_MAX:.4g} .. {_MAX_FACTOR:.4g} (its "
                         f"factors cap * log2(e) and softmax_scale / cap are float32 in the kernels), got {softcap!r} "
                         f"with softmax_scale {softmax_scale!r}")
    if not _real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        fail(ValueError, f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return AttnParams(float(softmax_scale), left, right, float(softcap), float(dropout_p), int(dropout_seed))


def num_splits(value) -> int:
    if type(value) is not int or value < 0:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, torch.Tensor)):
            fail(ValueError, f"num_splits must be an int >= 0 (0 = automatic), got {value!r}")
        value = integer("num_splits", value, 0)
    return value


# ------------------------------------------------------------------------ tensors


def check_qkv(q, k, v, *, packed: bool, cache: bool = False, headdim_v: bool = False) -> None:
    """dtype, device and shape checks for q (.., H, D), k (.., Hk, D) and v (.., Hk, Dv).

    Dense tensors are 4-D (batch, seqlen, heads, headdim); packed (varlen) q is 3-D, and so
    are k, v unless ``cache``: then they are a KV cache or block pool, always 4-D. Dv == D
    unless ``headdim_v`` (a caller that supports a value head dim of its own, as MLA uses).
    A cache may be float8_e4m3fn, both k and v, under a float16 or bfloat16 q (``ops.fp8``).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if cache and (is_fp8(k) or is_fp8(v)):
        if k.dtype != v.dtype:
            fail(TypeError, f"k and v caches must share a dtype, got {k.dtype} and {v.dtype}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            fail(TypeError, f"with a {FP8_DTYPE} cache q must be float16 or bfloat16, got {q.dtype}")
    elif not (q.dtype == k.dtype == v.dtype):
        fail(TypeError, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        fail(ValueError, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    backend = backend_name(q.device)  # raises on an unsupported device or TILEATTN_BACKEND value
    if q.dtype not in _LOW_PRECISION and not (q.dtype == torch.float64 and backend == "cpu"):
        allowed = _LOW_PRECISION + ((torch.float64,) if backend == "cpu" else ())
        fail(TypeError, f"dtype {q.dtype} is not supported here: use one of {', '.join(map(str, allowed))}")
    want = 3 if packed else 4
    if q.dim() != want:
        fail(ValueError, f"q must be {want}-D {'(total_tokens' if packed else '(batch, seqlen'}, nheads, headdim), "
                         f"got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if cache and t.dim() != 4:
            fail(ValueError, f"the {name} cache must be 4-D: (batch, seqlen_cache, nheads_k, headdim), or with "
                             f"block_table a pool (num_blocks, block_size, nheads_k, headdim); got {tuple(t.shape)}")
        if not cache and t.dim() != want:
            fail(ValueError, f"{name} must be {want}-D {'(total_tokens' if packed else '(batch, seqlen'}, nheads, "
                             f"headdim), got shape {tuple(t.shape)}")
    if headdim_v and k.shape[:-1] == v.shape[:-1]:
        if not 1 <= v.shape[-1] <= MAX_HEADDIM_V[backend]:
            fail(ValueError, f"v's headdim must be between 1 and {MAX_HEADDIM_V[backend]} on the {backend} path, "
                             f"got {v.shape[-1]}")
    elif k.shape != v.shape:
        fail(ValueError, f"k and v{' caches' if cache else ''} must have one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if cache and not packed and (k.stride(-1) != 1 or v.stride(-1) != 1):
        fail(ValueError, "k_cache and v_cache must be contiguous in their last dimension (they are written in "
                         "place, so tileattn cannot use a copy; flash-attn asks the same)")
    nheads, nheads_k, headdim = q.shape[-2], k.shape[-2], q.shape[-1]
    if nheads_k == 0 or nheads % nheads_k:
        fail(ValueError, f"nheads of q ({nheads}) must be a multiple of nheads of k/v ({nheads_k})")
    if k.shape[-1] != headdim:
        fail(ValueError, f"q, k, v must share headdim, got q {headdim} and k/v {k.shape[-1]}")
    if not 1 <= headdim <= MAX_HEADDIM[backend]:
        fail(ValueError, f"headdim must be between 1 and {MAX_HEADDIM[backend]} on the {backend} path, got {headdim}")


def check_backward(batch: int, q, k, v, learnable_sink=None) -> None:
    """The backward's limits, checked before the forward runs when a gradient may be asked for
    (grad mode on and q, k, v or the sinks requiring one): its grid has batch and heads on axes
    of at most 65535 (the forward's grid has no such limit), and on the Triton path it takes
    head dims up to ``MAX_HEADDIM_GRAD`` (the forward takes wider ones)."""
    sink_grad = isinstance(learnable_sink, torch.Tensor) and learnable_sink.requires_grad
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad or sink_grad):
        return
    if batch > MAX_GRID or q.shape[-2] > MAX_GRID:
        fail(ValueError, f"the backward handles batch and nheads up to {MAX_GRID}, got batch {batch} and nheads "
                         f"{q.shape[-2]}")
    backend = backend_name(q.device)
    limit = MAX_HEADDIM_GRAD[backend]
    if q.shape[-1] > limit or v.shape[-1] > limit:
        fail(NotImplementedError, f"gradients on the {backend} path take head dims up to {limit}, got q/k "
                                  f"{q.shape[-1]} and v {v.shape[-1]}: the {backend} forward takes them, the "
                                  f"backward does not. Call it without gradients (torch.no_grad(), or inputs that "
                                  f"do not require grad), or train on the CPU tiles (CPU tensors, "
                                  f"TILEATTN_BACKEND=cpu)")


def last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels take any strides but a unit stride on the last dim; copy only when needed.

    Not ``t.contiguous()``: torch counts a tensor without elements, or one whose last dim has
    size 1, as contiguous whatever its last stride (``x[..., ::2]`` of a sequence of length 0,
    a head dim of 1 reached by a transpose) and returns it as it is; the Triton backward then
    stopped on a bare AssertionError after the forward had run."""
    if t is not None and t.stride(-1) != 1:
        return t.clone(memory_format=torch.contiguous_format)
    return t


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


def check_int32_vector(name: str, t, length: int, device, what: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        fail(TypeError, f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        fail(TypeError, f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        fail(ValueError, f"{name} must have shape ({length},){what}, got {tuple(t.shape)}")
    if t.device != device:
        fail(ValueError, f"{name} is on {t.device} but q is on {device}")
    check_unit_stride(name, t)


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """Lengths, offsets and block tables reach the kernels as a pointer and a row stride: their last
    dimension must be contiguous (flash-attn requires it of the same arguments). A strided view read
    as if it were contiguous gives wrong numbers or reads out of bounds, so it is refused here."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(ValueError, f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}: "
                         f"pass {name}.contiguous()")


def check_offsets(cu_seqlens_q, cu_seqlens_k, q) -> int:
    """Types and shapes of the two cu_seqlens; returns the batch size (their values: ``check_cu_seqlens``)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 2:
            fail(ValueError, f"{name} must be a 1-D int32 tensor of length batch + 1 (>= 2), got "
                             f"{getattr(cu, 'shape', cu)!r}")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1:
        fail(ValueError, f"cu_seqlens_q and cu_seqlens_k must both hold batch + 1 offsets: cu_seqlens_q has "
                         f"{batch + 1} (a batch of {batch}), cu_seqlens_k has {cu_seqlens_k.shape[0]}")
    check_int32_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, q.device)
    check_int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, q.device)
    return batch


def check_block_table(block_table, batch: int, device) -> None:
    """Type, shape and device of a block table (its values: ``check_cache_values``)."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        fail(TypeError, "block_table must be an int32 tensor of shape (batch, max_blocks_per_seq)")
    if block_table.shape[0] != batch:
        fail(ValueError, f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
    if block_table.device != device:
        fail(ValueError, f"block_table is on {block_table.device} but q is on {device}")
    check_unit_stride("block_table", block_table)


def check_new_kv(k, v, k_cache, v_cache, batch: int, dtype=None) -> None:
    """The new keys and values that ``flash_attn_with_kvcache`` appends (v with v_cache's head dim),
    in the cache's dtype, or ``dtype`` when given (q's, for an FP8 cache that quantises them)."""
    if (k is None) != (v is None):
        fail(ValueError, "pass both k and v to append, or neither")
    if k is None:
        return
    check_writable("k_cache", k_cache)
    check_writable("v_cache", v_cache)
    for name, t, c in (("k", k, k_cache), ("v", v, v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            fail(ValueError, f"new {name} must be 4-D (batch, seqlen_new, nheads_k, headdim), got "
                             f"{getattr(t, 'shape', t)}")
        if t.shape[0] != batch or t.shape[2:] != c.shape[2:]:
            fail(ValueError, f"new {name} has shape {tuple(t.shape)}; expected ({batch}, seqlen_new, "
                             f"{c.shape[2]}, {c.shape[3]})")
        if t.dtype != (dtype or c.dtype) or t.device != c.device:
            fail(TypeError, f"new {name} must have dtype {dtype or c.dtype} on {c.device} (the "
                            f"{'queries' if dtype else 'cache'}'s), got {t.dtype} on {t.device}")
    if k.shape[:-1] != v.shape[:-1]:
        fail(ValueError, f"new k and v must have one shape but the head dim, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")


def check_packed_tokens(layer, k_pools: list, v_pools: list, k, v, offsets: list) -> None:
    """``PagedKVCache.write_packed``'s layer, tokens and offsets, before anything is written: k, v
    packed (total, nheads_k, headdim) as the layer's pools hold them (index_put would broadcast a
    single head or feature, or write k and then fail on v), on the pools' device, in their dtype
    (any floating dtype for a float8_e4m3fn pool, which quantises them), and offsets that start at
    0 and end at the tokens' count (flash-attn's cu_seqlens)."""
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral) or not 0 <= layer < len(k_pools):
        fail(IndexError, f"write_packed: layer must be an int in 0..{len(k_pools) - 1}, got {layer!r}")
    for name, t, pool in (("k", k, k_pools[layer]), ("v", v, v_pools[layer])):
        want = (pool.shape[2], pool.shape[3])
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != want:
            fail(ValueError, f"write_packed: {name} must be packed (total, {want[0]}, {want[1]}) as the pool holds "
                             f"tokens, got {tuple(getattr(t, 'shape', ())) or type(t).__name__}")
        if t.device != pool.device:
            fail(ValueError, f"write_packed: {name} is on {t.device} but the pool is on {pool.device}")
        if not (t.is_floating_point() if is_fp8(pool) else t.dtype == pool.dtype):
            fail(TypeError, f"write_packed: {name} must have the pool's dtype {pool.dtype}"
                            f"{' or be floating point (quantised as written)' if is_fp8(pool) else ''}, got {t.dtype}")
    if k.shape[0] != v.shape[0]:
        fail(ValueError, f"write_packed: k and v must hold one number of tokens, got {k.shape[0]} and {v.shape[0]}")
    if any(isinstance(o, (bool, np.bool_)) or not isinstance(o, numbers.Integral) for o in offsets):
        fail(TypeError, f"write_packed: cu_seqlens must hold integers, got {offsets}")
    if offsets and (offsets[0] != 0 or offsets[-1] != k.shape[0]):
        fail(ValueError, f"write_packed: cu_seqlens must start at 0 and end at the number of packed tokens "
                         f"({k.shape[0]}), got {offsets[0]} ... {offsets[-1]}")


def check_descales(k_cache, q, k_descale, v_descale, batch: int, prefix: str = "", v_cache=None):
    """The descales of an FP8 cache as contiguous (batch, nheads_k) fp32, or (None, None) for a
    cache in q's dtype, which takes none. ``prefix`` goes before their names in messages.

    A ``v_cache`` in ``k_cache``'s storage (MLA's one latent cache, v = k[..., :headdim_v]) holds
    the values as the keys stored them, at k_descale's scale: its v_descale must be k_descale
    itself, or every value would be read at another scale (no error, wrong numbers)."""
    names = (f"{prefix}k_descale", f"{prefix}v_descale")
    if not is_fp8(k_cache):
        if k_descale is not None or v_descale is not None:
            fail(ValueError, f"{names[0]}/{names[1]} go with a {FP8_DTYPE} KV cache, the cache is {k_cache.dtype}")
        return None, None
    want = (batch, k_cache.shape[-2])
    for name, d in zip(names, (k_descale, v_descale)):
        if d is None:
            fail(ValueError, f"a {FP8_DTYPE} KV cache needs {name} (float32, shape {want})")
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
            fail(TypeError, f"{name} must be a float32 tensor, got {getattr(d, 'dtype', type(d).__name__)}")
        if tuple(d.shape) != want:
            fail(ValueError, f"{name} must have shape {want} (batch, nheads_k), got {tuple(d.shape)}")
        if d.device != q.device:
            fail(ValueError, f"{name} is on {d.device} but q is on {q.device}")
    if (v_cache is not None and v_descale is not k_descale
            and v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()):
        fail(ValueError, f"{prefix}v_cache shares {prefix}k_cache's storage (one latent cache): its values are "
                         f"the keys' entries at {names[0]}'s scale, so pass {names[1]}={names[0]} (the same tensor)")
    return k_descale.contiguous(), v_descale.contiguous()


def check_out(out, q, v) -> None:
    """An ``out=`` buffer: q's shape with v's head dim, q's dtype and device (any strides whose
    elements do not share memory), not requiring grad while grad mode is on."""
    if out is None:
        return
    want = tuple(q.shape[:-1]) + tuple(v.shape[-1:])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device:
        fail(ValueError, f"out must be a tensor of shape {want}, dtype {q.dtype} on {q.device}, got "
                         f"{getattr(out, 'shape', type(out).__name__)!r} {getattr(out, 'dtype', '')}")
    check_writable("out", out)
    if out.requires_grad and torch.is_grad_enabled():
        # torch refuses an in-place write into such a tensor (a leaf) or records it; the kernels write
        # out directly: the Triton path overwrote a leaf requiring grad unnoticed, the CPU path stopped
        # in its last op
        fail(ValueError, "out requires grad: it is written in place, outside autograd. Pass a tensor that does not "
                         "require grad (the returned output carries the gradient), or call under torch.no_grad()")


def check_states(outs, lses, what: str) -> None:
    """Partial states for ``merge_states`` / ``merge_many``: floating-point tensors (an integer o came
    back truncated to integers, a complex one merged with a warning), each o of one shape with an lse
    (..., nheads, seqlen) for its (..., seqlen, nheads, headdim), all on one device."""
    for name, parts in (("o", outs), ("lse", lses)):
        for t in parts:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                fail(TypeError, f"{what}: every {name} must be a floating-point tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
    o0, l0 = outs[0], lses[0]
    if any(o.shape != o0.shape for o in outs) or any(lse.shape != l0.shape for lse in lses):
        fail(ValueError, f"{what}: states differ in shape: o {[tuple(o.shape) for o in outs]}, "
                         f"lse {[tuple(lse.shape) for lse in lses]}")
    if o0.dim() < 3 or l0.shape != o0.shape[:-3] + (o0.shape[-2], o0.shape[-3]):
        fail(ValueError, f"{what}: lse shape {tuple(l0.shape)} does not match o shape {tuple(o0.shape)}: "
                         f"expected o (..., seqlen, nheads, headdim) with lse (..., nheads, seqlen)")
    if any(t.device != o0.device for t in (*outs, *lses)):
        fail(ValueError, f"{what}: states must be on one device, got {sorted({str(t.device) for t in (*outs, *lses)})}")


def check_writable(name: str, t: torch.Tensor) -> None:
    """A tensor tileattn writes in place (``out``, a cache it appends to) must not be an expanded
    view (stride 0 on a dimension of size > 1): its elements share memory, so the kernels' writes
    for one batch row or slot land in the others' (the Triton path gave silently wrong outputs and
    caches, the CPU path stopped on torch's internal-overlap error after the checks)."""
    for size, stride in zip(t.shape, t.stride()):
        if stride == 0 and size > 1:
            fail(ValueError, f"{name} is written in place but is an expanded view (shape {tuple(t.shape)}, strides "
                             f"{t.stride()}): several of its elements share one memory location. Pass a tensor that "
                             f"owns its elements ({name}.clone())")


def check_sink(learnable_sink, q: torch.Tensor, nheads: int) -> torch.Tensor | None:
    """Learnable sinks: one logit per query head, (nheads,) float32 (float64 with float64 q) on
    q's device; returned with unit stride (a copy only if needed, which autograd follows)."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor):
        fail(TypeError, f"learnable_sink must be a torch.Tensor of shape ({nheads},), got "
                        f"{type(learnable_sink).__name__}")
    allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if learnable_sink.dtype not in allowed:
        fail(TypeError, f"learnable_sink must be float32, got {learnable_sink.dtype}")
    if learnable_sink.device != q.device:
        fail(ValueError, f"learnable_sink is on {learnable_sink.device} but q is on {q.device}")
    if learnable_sink.shape != (nheads,):
        fail(ValueError, f"learnable_sink must have shape ({nheads},) (one logit per query head), got "
                         f"{tuple(learnable_sink.shape)}")
    return learnable_sink.contiguous()


def check_rotary(rotary_cos, rotary_sin, k, headdim: int, device) -> int | None:
    """Shapes, dtypes and devices of the rotary tables; returns seqlen_ro (None without rotary)."""
    if (rotary_cos is None) != (rotary_sin is None):
        fail(ValueError, "pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is None:
        return None
    if k is None:
        fail(ValueError, "rotary_cos/rotary_sin rotate the new k and q: pass k and v too (flash-attn asks the same)")
    return rotary_tables(rotary_cos, rotary_sin, headdim, device)


def rotary_tables(cos, sin, headdim: int, device, names=("rotary_cos", "rotary_sin"), owner: str = "q") -> int:
    """cos and sin (seqlen_ro, rotary_dim / 2), floating point, on ``device`` (``owner``'s),
    rotary_dim <= headdim; returns seqlen_ro."""
    for name, t in zip(names, (cos, sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            fail(ValueError, f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2), got {getattr(t, 'shape', t)}")
        if not t.is_floating_point():
            fail(TypeError, f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != device:
            fail(ValueError, f"{name} is on {t.device} but {owner} is on {device}")
    if cos.shape != sin.shape:
        fail(ValueError, f"{names[0]} and {names[1]} must have one shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if not 0 < 2 * cos.shape[1] <= headdim:
        fail(ValueError, f"rotary_dim (2 x {cos.shape[1]}) must be between 1 and headdim ({headdim})")
    return cos.shape[0]


def cache_capacity(k_cache: torch.Tensor, block_table, batch: int, device) -> int:
    """Keys a sequence's cache can hold: a paged cache's block table (checked) times the page
    size, or a contiguous cache's length (its batch must be q's)."""
    if block_table is not None:
        check_block_table(block_table, batch, device)
        return block_table.shape[1] * k_cache.shape[1]
    if k_cache.shape[0] != batch:
        fail(ValueError, f"k_cache has batch {k_cache.shape[0]} but q has {batch}")
    return k_cache.shape[1]


def check_prefix(prefix_block_table, prefix_len, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared prefix's blocks, (prefix_blocks,) or (1, prefix_blocks) int32, and its length, an
    int or an int32 tensor (1,): returned as a (1, prefix_blocks) table and a (1,) int32 tensor."""
    t = prefix_block_table
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() not in (1, 2) or (
            t.dim() == 2 and t.shape[0] != 1):
        fail(TypeError, "prefix_block_table must be an int32 tensor of shape (prefix_blocks,) or (1, prefix_blocks)")
    if t.device != device:
        fail(ValueError, f"prefix_block_table is on {t.device} but q is on {device}")
    check_unit_stride("prefix_block_table", t)
    if isinstance(prefix_len, torch.Tensor):
        check_int32_vector("prefix_len", prefix_len, 1, device)
        return t.view(1, -1), prefix_len
    return t.view(1, -1), torch.full((1,), integer("prefix_len", prefix_len, 0), dtype=torch.int32, device=device)


def check_queries_in_suffix(cache_seqlens, new_tokens: int, seqlen_q: int) -> None:
    """Causal cascade attention: every request's queries lie among its own (suffix) keys."""
    mode = value_mode(cache_seqlens)
    if mode == "device" and cache_seqlens.numel():
        assert_on_device(cache_seqlens.min() + new_tokens >= seqlen_q,
                          "causal cascade attention needs each request's queries among its own suffix keys")
    if mode == "host" and cache_seqlens.numel() and int(cache_seqlens.min()) + new_tokens < seqlen_q:
        fail(ValueError, f"causal cascade attention needs each request's {seqlen_q} queries among its own suffix "
                         f"keys; a suffix has {int(cache_seqlens.min()) + new_tokens} (cache_seqlens + seqlen_new)")


def cache_lengths(cache_seqlens, batch: int, capacity: int, paged: bool, device) -> torch.Tensor:
    """cache_seqlens as an int32 tensor (batch,) on q's device (its values: ``check_cache_values``)."""
    if cache_seqlens is None:
        if paged:
            fail(ValueError, "a paged cache (block_table) needs cache_seqlens")
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        n = integer("cache_seqlens", cache_seqlens, 0)
        if n > capacity:
            fail(IndexError, f"cache_seqlens must be within 0..{capacity} (the cache's capacity), found {n}")
        return torch.full((batch,), n, dtype=torch.int32, device=device)
    check_int32_vector("cache_seqlens", cache_seqlens, batch, device)
    return cache_seqlens


# ------------------------------------------------------------------------ tensor values


def value_mode(t: torch.Tensor) -> str | None:
    """How checks that read ``t``'s values run now: "host", "device" or None (module docstring)."""
    if torch.compiler.is_compiling():
        return None
    if not t.is_cuda:
        return "host"
    if torch.cuda.is_current_stream_capturing():
        return None
    flag = getenv(DEBUG_ENV, "")
    return "host" if flag == "1" else None if flag == "0" else "device"


def kernel_asserts(t: torch.Tensor) -> bool:
    """Whether a Triton kernel reading ``t`` keeps its device assertions: compiled for its CUDA
    device (with the ``debug`` option), not run by Triton's interpreter on a CPU tensor, which drops
    them (so a check there writes a flag instead)."""
    return t.is_cuda


def assert_on_device(ok: torch.Tensor, what: str) -> None:
    """One asynchronous assertion; the message shows where the check runs synchronously (CPU
    tensors), a CUDA device reports only that an assertion failed."""
    if ok.is_cuda:
        torch._assert_async(ok)
    else:
        torch._assert_async(ok, f"tileattn: {what} (rerun with {DEBUG_ENV}=1 for the exact check)")


def within(x: torch.Tensor, lo, hi) -> torch.Tensor:
    """One boolean on x's device: every entry of x lies in [lo, hi] (bounds: numbers or tensors)."""
    return x.clamp(min=lo, max=hi).eq(x).all()


def vouch(t: torch.Tensor, facts: tuple) -> torch.Tensor:
    """Mark ``t`` as holding values its producer knows on the host (``PagedKVCache``): ``facts``
    stand in for reading them, as long as ``t`` is not modified (its version counter). An
    inference tensor has no version counter to tell a later change: its values get checked."""
    if t.is_inference():
        return t
    t._tileattn_facts = (t._version, facts)
    return t


def vouched(t: torch.Tensor):
    """The facts ``vouch`` recorded for ``t``, or None if there are none or ``t`` changed since."""
    mark = getattr(t, "_tileattn_facts", None)
    return mark[1] if mark is not None and mark[0] == t._version else None


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int | None, max_seqlen: int) -> None:
    """cu_seqlens starts at 0, never decreases, ends at the number of packed tokens (``total``;
    None for the keys of a paged pool, whose end is not a row count) and no sequence has more
    than ``max_seqlen`` tokens. A producer that built ``cu`` on the host may vouch for it with
    facts ("cu_seqlens", total, longest sequence): then nothing is read or launched."""
    facts = vouched(cu)
    if (facts is not None and facts[0] == "cu_seqlens" and (total is None or facts[1] == total)
            and facts[2] <= max_seqlen):
        return
    mode = value_mode(cu)
    if mode == "device":
        lengths = cu.diff()
        ok = within(lengths, 0, max_seqlen) & cu[0].eq(0)
        if total is not None:
            ok = ok & cu[-1].eq(total)
        assert_on_device(ok, f"{name} must start at 0, never decrease and end at the number of packed tokens, "
                              f"with no sequence longer than its max_seqlen")
    if mode != "host":
        return
    values = cu.tolist()
    if values[0] != 0 or (total is not None and values[-1] != total):
        fail(ValueError, f"{name} must start at 0 and end at the number of packed tokens ({total}), "
                         f"got {values[0]} ... {values[-1]}" if total is not None else
                         f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if min(lengths, default=0) < 0:
        fail(ValueError, f"{name} must be non-decreasing, got {values}")
    if max(lengths, default=0) > max_seqlen:
        fail(ValueError, f"a sequence in {name} has {max(lengths)} tokens, more than max_seqlen {max_seqlen}")


def check_used_keys(seqused_k, cu_seqlens_k) -> None:
    """With packed keys, seqused_k[b] must lie within 0 .. sequence b's keys."""
    mode = value_mode(seqused_k)
    if mode == "device":
        ok = within(seqused_k, 0, 2**31 - 1) & seqused_k.le(cu_seqlens_k.diff()).all()
        assert_on_device(ok, "seqused_k must lie within 0 .. each sequence's packed keys")
    if mode != "host":
        return
    for b, (n, lo, hi) in enumerate(zip(seqused_k.tolist(), cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:])):
        if not 0 <= n <= hi - lo:
            fail(IndexError, f"seqused_k[{b}] = {n} is outside 0..{hi - lo} (sequence {b}'s packed keys)")


def check_cache_values(seqlens, new_tokens: int, capacity: int, block_table=None, block_size: int = 1,
                       num_blocks: int = 0, rotary_len: int | None = None, rotary_reach: int = 0,
                       table_name: str = "block_table", leftpad=None, lengths_name: str = "cache_seqlens",
                       kept=None, folded: bool = False) -> bool | None:
    """KV-cache lengths, left pads and block-table entries.

    After appending ``new_tokens``, every length must fit the capacity, and every block-table
    entry that a sequence's keys live in must index the pool (entries past a sequence's last
    page are never read, so they may hold anything). A sequence's ``leftpad`` (the slot its
    keys start at) must lie within 0 .. its length. With rotary tables of ``rotary_len``
    positions, every rotated position (up to length + ``rotary_reach`` - 1) must have a row.
    ``kept``: a memo entry (``_memo``) of the caller's signature, whose ``device_check`` keeps
    the device check's launch (``gpu.checks.CacheCheck``) for its later calls.

    ``folded``: the caller's next launch checks these values itself before it reads the cache
    (``gpu.prepared.PreparedFwd.folds_cache_check``). Where the check would run on the device as a
    kernel that asserts (``kernel_asserts``) nothing is launched then and True is returned: the
    caller must launch its checking kernel. Otherwise (None) the check has run here, or needs none.
    """
    mode = value_mode(seqlens)
    if mode is None or seqlens.numel() == 0:
        return
    facts = _cache_facts(seqlens, block_table, block_size)
    if facts is not None:  # PagedKVCache's own tensors: the host knows every value
        longest, room, top_block = facts
        if new_tokens > room:
            fail(ValueError, f"PagedKVCache: a sequence has room for {room} more tokens, {new_tokens} are appended; "
                             f"call reserve first")
        _check_extent(0, longest, new_tokens, capacity, rotary_len, rotary_reach, lengths_name)
        if top_block >= num_blocks:
            fail(IndexError, f"block_table entries in use must index the cache's {num_blocks} blocks, found "
                             f"0..{top_block}")
        return
    extent = _lengths_facts(seqlens, leftpad, block_table)
    if extent is not None:  # lengths (and left pads within them) whose producer read them on the host
        _check_extent(*extent, new_tokens, capacity, rotary_len, rotary_reach, lengths_name)
        return
    if mode == "device":
        if folded and kernel_asserts(seqlens):
            return True
        _check_cache_on_device(seqlens, new_tokens, capacity, block_table, block_size, num_blocks, rotary_len,
                               rotary_reach, table_name, leftpad, lengths_name, kept)
    if mode != "host":
        return
    # One device-to-host copy each (when debugging CUDA tensors): lengths as a list (the
    # quickest for the usual small batch), the block table as an array.
    lengths = seqlens.tolist()
    if leftpad is not None:
        pads = leftpad.tolist()
        if any(not 0 <= p <= n for p, n in zip(pads, lengths)):
            fail(IndexError, f"cache_leftpad must lie within 0..cache_seqlens of each sequence, found "
                             f"{pads} for lengths {lengths}")
    _check_extent(min(lengths), max(lengths), new_tokens, capacity, rotary_len, rotary_reach, lengths_name)
    if block_table is not None and block_table.numel() > 0:
        entries = block_table.cpu().numpy()
        pages = (np.array(lengths) + new_tokens + block_size - 1) // block_size  # pages each sequence's keys occupy
        in_use = entries[np.arange(entries.shape[1])[None, :] < pages[:, None]]
        if in_use.size and (in_use.min() < 0 or in_use.max() >= num_blocks):
            fail(IndexError, f"{table_name} entries in use must index the cache's {num_blocks} "
                             f"{'rows' if table_name == 'cache_batch_idx' else 'blocks'}, found "
                             f"{in_use.min()}..{in_use.max()}")


def _check_extent(lo: int, hi: int, new_tokens: int, capacity: int, rotary_len, rotary_reach: int,
                  lengths_name: str) -> None:
    """Lengths lo..hi (before the append) against the capacity and the rotary tables."""
    if lo < 0:  # named as such: the messages below speak of the longest sequence
        fail(IndexError, f"{lengths_name} must be >= 0, found {lo}..{hi}")
    if hi + new_tokens > capacity:
        if new_tokens:
            fail(IndexError, f"appending {new_tokens} tokens needs room for {hi + new_tokens} keys, the cache holds "
                             f"{capacity} per sequence ({lengths_name} found {lo}..{hi})")
        if lengths_name == "cache_seqlens":
            fail(IndexError, f"cache_seqlens must be within 0..{capacity} (the cache's capacity), found {lo}..{hi}")
        fail(IndexError, f"a sequence in {lengths_name} has {hi} keys, the block table holds {capacity}")
    if rotary_len is not None and hi + rotary_reach > rotary_len:
        fail(IndexError, f"rotary_cos/rotary_sin cover {rotary_len} positions, the new tokens reach position "
                         f"{hi + rotary_reach - 1}")


def _check_cache_on_device(seqlens, new_tokens, capacity, block_table, block_size, num_blocks, rotary_len,
                           rotary_reach, table_name, leftpad, lengths_name, kept) -> None:
    """``check_cache_values`` in one kernel on the device (``gpu.checks``): on a GPU the kernel
    asserts itself; on CPU tensors (Triton's interpreter) it writes a flag, asserted here with
    the check's message."""
    check = None if kept is None else kept.device_check
    if check is None:
        from ..gpu.checks import CacheCheck

        top = capacity - new_tokens
        if rotary_len is not None:
            top = min(top, rotary_len - rotary_reach)
        check = CacheCheck(seqlens, top, leftpad, block_table, new_tokens, block_size, num_blocks,
                           asserting=kernel_asserts(seqlens))
        if kept is not None:
            kept.device_check = check
    ok = check(seqlens, leftpad, block_table)
    if ok is None:  # asserted by the kernel
        return
    what = f"{lengths_name} (+ {new_tokens} new tokens) must lie within 0..{capacity}"
    if rotary_len is not None:
        what += f" and within the {rotary_len} rotary positions"
    if leftpad is not None:
        what += "; cache_leftpad within 0..cache_seqlens"
    if block_table is not None and block_table.numel() > 0:
        what += f"; {table_name} entries in use within 0..{num_blocks - 1}"
    assert_on_device(ok, what)


def vouch_lengths(seqlens: torch.Tensor, leftpad: torch.Tensor | None, lengths: list[int]) -> None:
    """Mark a contiguous cache's lengths (and left pads) as holding values their producer knows on
    the host: ``lengths`` is what ``seqlens`` holds, and every left pad lies within 0 .. its
    sequence's length. ``check_cache_values`` then checks them on the host, reading and launching
    nothing (``vouch``: as long as neither tensor is modified)."""
    state = object()  # the two tensors' facts hold for each other only
    vouch(seqlens, ("cache_lengths", state, min(lengths), max(lengths)))
    if leftpad is not None:
        vouch(leftpad, ("cache_leftpad", state))


def _lengths_facts(seqlens, leftpad, block_table):
    """(shortest, longest length) when ``vouch_lengths`` vouched for ``seqlens`` (and for
    ``leftpad`` with it), no block table: else None."""
    if block_table is not None:
        return None
    lens = vouched(seqlens)
    if lens is None or lens[0] != "cache_lengths":
        return None
    if leftpad is not None:
        pads = vouched(leftpad)
        if pads is None or pads[0] != "cache_leftpad" or pads[1] is not lens[1]:
            return None
    return lens[2], lens[3]


def _cache_facts(seqlens, block_table, block_size: int):
    """(longest length, least room, largest block id) when PagedKVCache vouched for both tensors
    in one state of the cache, for the same sequences and this pool's block size, else None."""
    if block_table is None:
        return None
    lens, table = vouched(seqlens), vouched(block_table)
    if lens is None or table is None or lens[0] != table[0] or lens[0][-1] != block_size:
        return None
    return lens[1], lens[2], table[1]
