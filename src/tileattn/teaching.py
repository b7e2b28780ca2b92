"""What ``tileattn demo | trace | memory | bench`` measure: small functions that return numbers,
printed by ``tileattn.cli``.

* :func:`agreement` — the float64 algorithms of ``tileattn.reference`` against each other.
* :func:`peak_extra_bytes` / :func:`memory_row` — peak intermediate memory, measured with
  ``tracemalloc`` (NumPy reports its buffers to it), inputs and outputs excluded;
  :func:`naive_bytes_per_score` and :func:`available_memory` decide beforehand whether a naive
  case fits.
* :func:`masked_tile` — the NaN of the unguarded recurrence when a row's first key tile is masked.
* :func:`trace_online_softmax` — the recurrence on one query row, tile by tile.
* :func:`sink_weights` — what a learnable attention sink does to one row's weights.
* :func:`public_api_agreement` — ``tileattn.flash_attn_func`` against the reference;
  :func:`bench_cases` / :func:`time_calls` — against torch, timed.
"""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np
import torch

from . import flash_attn_func
from . import reference as ref

# ------------------------------------------------------------------------------ helpers


def max_error(x, exact) -> float:
    """max |x - exact| over finite entries of ``exact``; inf when x is NaN, or differs where
    ``exact`` is infinite (the -inf LSE of a row that sees no key)."""
    x, exact = np.asarray(x, np.float64), np.asarray(exact, np.float64)
    inf = np.isinf(exact)
    if np.isnan(x).any() or not np.array_equal(x[inf], exact[inf]):
        return float("inf")
    return float(np.abs(x[~inf] - exact[~inf]).max(initial=0.0))


def state_error(got, exact) -> float:
    """The larger of the output and LSE errors of an ``(out, lse)`` pair."""
    return max(max_error(got[0], exact[0]), max_error(got[1], exact[1]))


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim):
    """Standard normal q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim)."""
    return (rng.standard_normal((batch, seqlen_q, nheads, headdim)),
            rng.standard_normal((batch, seqlen_k, nheads_k, headdim)),
            rng.standard_normal((batch, seqlen_k, nheads_k, headdim)))


def paged(rng, k, v, block_size):
    """k, v scattered into NaN-filled pools of pages through a random block table (2 spare pages)."""
    batch, seqlen_k, nheads_k, headdim = k.shape
    pages = -(-seqlen_k // block_size)
    order = rng.permutation(batch * pages + 2)
    k_pool = np.full((len(order), block_size, nheads_k, headdim), np.nan)
    v_pool = k_pool.copy()
    table = order[: batch * pages].reshape(batch, pages).astype(np.int32)
    for b in range(batch):
        for p in range(pages):
            lo, hi = p * block_size, min((p + 1) * block_size, seqlen_k)
            k_pool[table[b, p], : hi - lo], v_pool[table[b, p], : hi - lo] = k[b, lo:hi], v[b, lo:hi]
    return k_pool, v_pool, table, np.full(batch, seqlen_k, np.int32)


# ------------------------------------------------------------------- (a) agreement


# (label, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, tile, options)
AGREEMENT_CASES = [
    ("dense", 2, 64, 64, 4, 4, 32, 16, {}),
    ("length 1", 1, 1, 1, 2, 2, 16, 1, {}),
    ("causal", 1, 100, 100, 2, 2, 64, 32, {"causal": True}),
    ("causal, sq < sk", 1, 37, 113, 2, 1, 40, 16, {"causal": True}),
    ("causal, sq > sk", 1, 113, 37, 2, 1, 40, 7, {"causal": True}),
    ("GQA 8/2, window (9, 0)", 1, 33, 33, 8, 2, 16, 1, {"window_size": (9, 0)}),
    ("softcap + ALiBi", 2, 50, 70, 2, 2, 24, 128, {"softcap": 5.0, "alibi_slopes": np.array([0.25, 0.5])}),
]


def agreement(seed: int = 0):
    """Rows ``(label, shape, tile, err_tiled, err_paged, err_split)``: max |x - naive| over out and LSE."""
    rng = np.random.default_rng(seed)
    rows = []
    for label, batch, sq, sk, nheads, nheads_k, headdim, tile, opts in AGREEMENT_CASES:
        q, k, v = random_qkv(rng, batch, sq, sk, nheads, nheads_k, headdim)
        exact = ref.attention_naive(q, k, v, **opts)
        tiled = ref.attention_tiled(q, k, v, block_m=tile, block_n=tile, **opts)
        paged_state = ref.attention_paged(q, *paged(rng, k, v, tile), **opts)
        split = ref.attention_split(q, k, v, num_splits=3, block_n=tile, **opts)
        shape = f"{batch}x{sq}x{sk} h{nheads}/{nheads_k} d{headdim}"
        rows.append((label, shape, tile, *(state_error(s, exact) for s in (tiled, paged_state, split))))
    return rows


# ---------------------------------------------------------------------- (b) memory


def peak_extra_bytes(fn, *args, **kwargs) -> int:
    """Peak bytes allocated while ``fn(*args, **kwargs)`` runs, beyond what was allocated before
    it started (the inputs), less the arrays it returns (the outputs): its intermediates."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        result = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before - sum(np.asarray(r).nbytes for r in result)


@dataclass
class MemoryRow:
    seqlen: int
    naive_bytes: int | None  # measured peak intermediates of attention_naive (None: not run)
    flash_bytes: int  # measured peak intermediates of attention_tiled
    scores_bytes: int  # one float64 N x N score matrix, for scale
    tile_bytes: int  # one float64 score tile (block x block, at most N x N), for scale


def memory_row(n: int, headdim: int = 64, block: int = 128, seed: int = 0, naive: bool = True) -> MemoryRow:
    """Measured peak intermediate memory of naive (unless ``naive`` is False) and tiled attention,
    one head, ``n`` queries and keys."""
    q, k, v = random_qkv(np.random.default_rng(seed), 1, n, n, 1, 1, headdim)
    naive_bytes = peak_extra_bytes(ref.attention_naive, q, k, v) if naive else None
    flash = peak_extra_bytes(ref.attention_tiled, q, k, v, block_m=block, block_n=block)
    tile = min(block, n)  # the tiled path's score tile: no larger than the sequence
    return MemoryRow(n, naive_bytes, flash, n * n * 8, tile * tile * 8)


def naive_bytes_per_score(headdim: int = 64, seqlen: int = 256) -> float:
    """Peak intermediate bytes of attention_naive per entry of the N x N score matrix, measured at
    N = ``seqlen`` (about 4 float64 N x N arrays live at once: 32 bytes); times N^2, it
    estimates a larger N before running it."""
    return memory_row(seqlen, headdim, block=seqlen).naive_bytes / seqlen**2


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable; elsewhere the free
    physical pages), or None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


# ----------------------------------------------------------- (c) the fully-masked tile


@dataclass
class MaskedTileCase:
    seen: np.ndarray  # (seqlen, seqlen) which keys each query sees
    first_tile_blind: np.ndarray  # (seqlen,) the row sees no key of key tile 0
    unguarded: np.ndarray  # (seqlen, headdim) out of head 0 without the guard
    guarded: np.ndarray  # (seqlen, headdim) out of head 0 with the guard
    exact: np.ndarray  # (seqlen, headdim) attention_naive


def masked_tile(seqlen: int = 16, window_left: int = 3, tile: int = 4, seed: int = 0) -> MaskedTileCase:
    """Sliding window (window_left, 0): row i sees keys i - window_left .. i, so every row
    i > window_left + tile - 1 sees nothing in the first key tile, yet something later."""
    q, k, v = random_qkv(np.random.default_rng(seed), 1, seqlen, seqlen, 1, 1, 8)
    opts = {"window_size": (window_left, 0)}
    with np.errstate(invalid="ignore"):
        unguarded, _ = ref.attention_tiled(q, k, v, block_m=tile, block_n=tile, guard=False, **opts)
    guarded, _ = ref.attention_tiled(q, k, v, block_m=tile, block_n=tile, **opts)
    exact, _ = ref.attention_naive(q, k, v, **opts)
    positions = np.arange(seqlen)
    seen = ref.visible(positions, positions, seqlen, seqlen, window_size=(window_left, 0))
    return MaskedTileCase(seen, ~seen[:, :tile].any(axis=1), unguarded[0, :, 0], guarded[0, :, 0], exact[0, :, 0])


# -------------------------------------------------------------------------- trace


@dataclass
class TraceStep:
    keys: range  # the key positions of this tile
    tile_max: float  # max score in the tile
    m: float  # running max after the tile
    alpha: float  # exp(m_old - m_new), applied to l and acc (nan before the first tile)
    rescaled: bool  # the running max moved after the first tile: l and acc shrank
    l: float  # running sum of exp(s - m)
    o: np.ndarray  # acc / l, the output as known so far
    err: float  # max |o - exact|


def trace_online_softmax(keys: int = 16, tile: int = 4, seed: int = 0, headdim: int = 4):
    """The online softmax on one query row, one key tile at a time (``reference.online_softmax_step``)::

        m_new = max(m, max_j s_j)        alpha = exp(m - m_new)
        l     = alpha l + sum_j exp(s_j - m_new)
        acc   = alpha acc + sum_j exp(s_j - m_new) v_j          o = acc / l

    Returns ``(scores, steps, exact)``; only after the last tile is ``o`` the exact answer.
    """
    if keys < 1 or tile < 1:
        raise ValueError(f"keys ({keys}) and tile ({tile}) must be >= 1")
    q, k, v = random_qkv(np.random.default_rng(seed), 1, 1, keys, 1, 1, headdim)
    exact = ref.attention_naive(q, k, v)[0][0, 0, 0]
    scores = (k[0, :, 0] @ q[0, 0, 0]) * headdim**-0.5
    m, l, acc, steps = np.full(1, -np.inf), np.zeros(1), np.zeros((1, headdim)), []
    for lo in range(0, keys, tile):
        cols = range(lo, min(lo + tile, keys))
        s = scores[lo:cols.stop]
        m_new, l, acc, alpha = ref.online_softmax_step(m, l, acc, s[None], v[0, lo:cols.stop, 0])
        o = acc[0] / l[0]  # alpha is 0 on the first tile: nothing to rescale yet
        steps.append(TraceStep(cols, float(s.max()), float(m_new[0]), float(alpha[0]) if lo else float("nan"),
                               bool(lo and m_new[0] > m[0]), float(l[0]), o, float(np.abs(o - exact).max())))
        m = m_new
    return scores, steps, exact


def sink_weights(keys: int = 8, sink: float = 1.0, seed: int = 0, headdim: int = 4):
    """One query row's attention weights without and with a learnable sink (gpt-oss)::

        plain_j = exp(s_j - lse),        lse  = log sum_j exp(s_j)
        with_j  = exp(s_j - lse_s),      lse_s = log(sum_j exp(s_j) + exp(sink)),  p_sink = exp(sink - lse_s)

    The sink takes p_sink of the row's probability and gives back no value: every key's weight
    shrinks by the same factor 1 - p_sink, and so does the output. Both LSEs come from
    ``reference.attention_naive``. Returns ``(scores, plain, with_sink, p_sink)``.
    """
    if keys < 1:
        raise ValueError(f"keys ({keys}) must be >= 1")
    q, k, v = random_qkv(np.random.default_rng(seed), 1, 1, keys, 1, 1, headdim)
    scores = (k[0, :, 0] @ q[0, 0, 0]) * headdim**-0.5
    lse = ref.attention_naive(q, k, v)[1][0, 0, 0]
    lse_s = ref.attention_naive(q, k, v, learnable_sink=np.array([sink]))[1][0, 0, 0]
    return scores, np.exp(scores - lse), np.exp(scores - lse_s), float(np.exp(sink - lse_s))


# ------------------------------------------------------------- the public torch API


def torch_attention(q, k, v, causal=False):
    """Plain softmax(q k^T / sqrt(d)) v in the inputs' dtype, (B, S, H, D) layout, GQA by repetition,
    causal aligned bottom-right: the error budget a fast path is allowed (the tolerance rule of tests/tolerance.py)."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    s = (qt @ kt.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        seen = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        s = s.masked_fill(~seen, float("-inf"))
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ vt).transpose(1, 2)


# (label, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
API_CASES = [
    ("dense", 2, 100, 100, 4, 4, 64, False),
    ("causal", 1, 128, 128, 2, 2, 64, True),
    ("causal GQA 4/1, sq < sk", 1, 17, 113, 4, 1, 40, True),
]


def public_api_agreement(seed: int = 0):
    """Rows ``(device, dtype, label, err_tileattn, err_torch, ok)`` comparing flash_attn_func with the
    float64 reference; ok iff err_tileattn <= 2 err_torch + 1e-5 (tests/tolerance.py)."""
    targets = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        targets += [("cuda", torch.float16), ("cuda", torch.bfloat16)]
    rng = np.random.default_rng(seed)
    rows = []
    for label, batch, sq, sk, nheads, nheads_k, headdim, causal in API_CASES:
        q, k, v = random_qkv(rng, batch, sq, sk, nheads, nheads_k, headdim)
        exact = ref.attention_naive(q, k, v, causal=causal)[0]
        for device, dtype in targets:
            qt, kt, vt = (torch.from_numpy(x).to(device, dtype) for x in (q, k, v))
            err_fast = max_error(flash_attn_func(qt, kt, vt, causal=causal).double().cpu().numpy(), exact)
            err_torch = max_error(torch_attention(qt, kt, vt, causal).double().cpu().numpy(), exact)
            rows.append((device, str(dtype).removeprefix("torch."), label, err_fast, err_torch,
                         err_fast <= 2 * err_torch + 1e-5))
    return rows


# --------------------------------------------------------------------------- bench


def time_calls(fn, repeats: int, warmup: int = 2) -> list[float]:
    """Wall times in seconds of ``repeats`` calls of ``fn``, after ``warmup`` untimed calls (the
    first call pays for lazy initialisation, thread pools and caches warming up)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench_cases(n: int, nheads: int = 8, headdim: int = 64, seed: int = 0):
    """``{name: fn}`` computing attention of (1, nheads, n, headdim) fp32 on the CPU three ways:
    tileattn.flash_attn_func, torch SDPA, and naive softmax(q k^T) v. FLOPs: 4 n^2 nheads headdim."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, n, nheads, headdim) for _ in range(3))  # (B, S, H, D)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, S, D) views

    fns = {
        "tileattn": lambda: flash_attn_func(q, k, v),
        "torch SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
        "naive torch": lambda: torch.softmax(qt @ kt.transpose(-1, -2) * headdim**-0.5, -1) @ vt,
    }
    return {name: torch.no_grad()(fn) for name, fn in fns.items()}
