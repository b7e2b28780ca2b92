"""NumPy float64 ground truth: the FlashAttention algorithms as the textbook writes them.

Every fast path in tileattn is judged against these functions. They favour clarity over
speed: loops over batch and heads, one tile at a time, no tricks.

Layouts (flash-attn's, used throughout tileattn):
    q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim),
    out like q, lse (batch, nheads, seqlen_q); nheads % nheads_k == 0 (GQA/MQA: query head
    h reads key/value head h // (nheads // nheads_k)).

Every function returns ``(out, lse)``. A query row that sees no key has out 0, lse -inf.

Masking, with ``off = seqlen_k - seqlen_q`` (bottom-right alignment, as flash-attn >= 2.1):
    query i sees key j  iff  j <= i + off + right   (when right >= 0)
                        and  j >= i + off - left    (when left >= 0)
``causal=True`` is the window (left, 0). For seqlen_q=2, seqlen_k=5, causal::

    q0: 1 1 1 1 0
    q1: 1 1 1 1 1

and for seqlen_q=5, seqlen_k=2, causal (rows 0..2 see no key at all)::

    q0: 0 0
    q1: 0 0
    q2: 0 0
    q3: 1 0
    q4: 1 1

Score modifications, applied in this order to s = scale * q.k:
    softcap > 0:  s = softcap * tanh(s / softcap)
    alibi slope:  s = s - slope * |i + off - j|
then masked entries become -inf, and with dropout_p > 0 the normalised probabilities are
multiplied by keep / (1 - p) (``tileattn.dropout_mask``; the LSE is not affected).

Learnable sinks (``learnable_sink``, one logit per query head, natural units, as gpt-oss and
flash-attn 4): the sink joins every row's softmax denominator but has no value row::

    lse_i = log(sum_j exp(s_ij) + exp(sink_h)),   out_i = sum_j exp(s_ij - lse_i) v_j

It is a key of score sink_h and value 0 that every row sees, so it enters each row exactly
once: the recurrence starts from the state (m = sink_h, l = 1, acc = 0) instead of
(-inf, 0, 0), and split or merged computations merge the sink's state (0, sink_h) once after
the splits. The returned LSE includes the sink; a row that sees no key gets out 0 and
lse = sink_h (all its probability goes to the sink).
"""

from __future__ import annotations

import numpy as np

from .dropout_mask import keep_mask

__all__ = [
    "visible",
    "attention_naive",
    "attention_tiled",
    "attention_paged",
    "attention_split",
    "attention_varlen",
    "attention_naive_grad",
    "merge_states",
    "merge_many",
    "merge_sink",
    "online_softmax_step",
]


# ----------------------------------------------------------------------------- helpers


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _window(causal: bool, window_size) -> tuple[int, int]:
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    return left, right


def visible(rows, cols, seqlen_q: int, seqlen_k: int, causal=False, window_size=(-1, -1)):
    """Boolean (len(rows), len(cols)): which keys each query row may see."""
    left, right = _window(causal, window_size)
    i = np.asarray(rows)[:, None] + (seqlen_k - seqlen_q)
    j = np.asarray(cols)[None, :]
    seen = np.ones((len(rows), len(cols)), dtype=bool)
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    return seen


def _scores(q_rows, k_cols, rows, cols, seqlen_q, seqlen_k, opts, slope):
    """Scores of query rows against key columns, masked entries -inf."""
    s = (q_rows @ k_cols.T) * opts["softmax_scale"]
    if opts["softcap"] > 0:
        s = opts["softcap"] * np.tanh(s / opts["softcap"])
    if slope != 0.0:
        dist = np.abs(np.asarray(rows)[:, None] + (seqlen_k - seqlen_q) - np.asarray(cols)[None, :])
        s = s - slope * dist
    seen = visible(rows, cols, seqlen_q, seqlen_k, opts["causal"], opts["window_size"])
    return np.where(seen, s, -np.inf)


def _dropout_scale(opts, bh, rows, cols):
    """keep / (1 - p) for the given rows and columns (ones when dropout is off)."""
    p = opts["dropout_p"]
    if p == 0.0:
        return 1.0
    keep = keep_mask(opts["dropout_seed"], bh, np.asarray(rows, np.uint64), np.asarray(cols, np.uint64), p)
    return keep / (1.0 - p)


def _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
             learnable_sink=None):
    batch, _, nheads, headdim = q.shape
    slopes = np.zeros((batch, nheads))
    if alibi_slopes is not None:
        slopes = np.broadcast_to(_f64(alibi_slopes), (batch, nheads))
    sinks = None
    if learnable_sink is not None:
        sinks = _f64(learnable_sink).reshape(-1)
        if sinks.shape != (nheads,):
            raise ValueError(f"learnable_sink must have shape ({nheads},), got {sinks.shape}")
    return {
        "sinks": sinks,
        "softmax_scale": headdim**-0.5 if softmax_scale is None else float(softmax_scale),
        "causal": bool(causal),
        "window_size": tuple(window_size),
        "softcap": float(softcap),
        "slopes": slopes,
        "dropout_p": float(dropout_p),
        "dropout_seed": int(dropout_seed),
    }


def _heads(q, k):
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    return nheads, nheads // nheads_k


# ------------------------------------------------------------------- the merge of states


def merge_states(o_a, lse_a, o_b, lse_b):
    """Combine two partial attentions over disjoint key sets into one.

    ``o`` has the query rows and heads in its leading axes and headdim last, e.g.
    (batch, seqlen_q, nheads, headdim), with ``lse`` (batch, nheads, seqlen_q); or packed
    (total, nheads, headdim) with lse (nheads, total). An empty state has lse -inf.

        lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b
    """
    lse_a, lse_b = _f64(lse_a), _f64(lse_b)
    lse = np.logaddexp(lse_a, lse_b)
    safe = np.where(np.isneginf(lse), 0.0, lse)
    w_a = np.where(np.isneginf(lse_a), 0.0, np.exp(lse_a - safe))
    w_b = np.where(np.isneginf(lse_b), 0.0, np.exp(lse_b - safe))
    w_a, w_b = np.swapaxes(w_a, -1, -2)[..., None], np.swapaxes(w_b, -1, -2)[..., None]
    return w_a * _f64(o_a) + w_b * _f64(o_b), lse


def merge_sink(o, lse, learnable_sink):
    """Merge the sinks' states (out 0, lse sink_h) into ``(o, lse)``, once per row: what a split or
    ring computation does after merging its partial states. ``lse`` is (batch, nheads, seqlen_q)
    or packed (nheads, total); ``learnable_sink`` (nheads,)."""
    lse = _f64(lse)
    sink = _f64(learnable_sink).reshape(-1)
    sink = np.broadcast_to(sink[:, None], lse.shape)
    return merge_states(o, lse, np.zeros_like(_f64(o)), sink)


def merge_many(outs, lses):
    """Fold :func:`merge_states` over a list of states (the merge is associative)."""
    o, lse = outs[0], lses[0]
    for o_i, lse_i in zip(outs[1:], lses[1:]):
        o, lse = merge_states(o, lse, o_i, lse_i)
    return _f64(o), _f64(lse)


# ------------------------------------------------------------------------ the algorithms


def _probabilities(s, sink):
    """Row-softmax of the scores ``s`` with the sink (or None) in the denominator.

    Returns (probs, lse); a row with no visible key and no sink has probs 0 and lse -inf."""
    m = s.max(axis=1, initial=-np.inf)
    if sink is not None:
        m = np.maximum(m, sink)
    live = ~np.isneginf(m)
    m_use = np.where(live, m, 0.0)
    p = np.exp(s - m_use[:, None])
    l = p.sum(axis=1) + (0.0 if sink is None else np.exp(sink - m_use))
    probs = np.where(live[:, None], p / np.where(live, l, 1.0)[:, None], 0.0)
    return probs, np.where(live, m_use + np.log(np.where(live, l, 1.0)), -np.inf)


def _sink(opts, h):
    return None if opts["sinks"] is None else opts["sinks"][h]


def attention_naive(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=0, learnable_sink=None):
    """softmax(q k^T * scale) v with the whole score matrix in memory."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    opts = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
                    learnable_sink)
    batch, seqlen_q, _, _ = q.shape
    seqlen_k = k.shape[1]
    nheads, group = _heads(q, k)
    rows, cols = np.arange(seqlen_q), np.arange(seqlen_k)
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            s = _scores(q[b, :, h], k[b, :, h // group], rows, cols, seqlen_q, seqlen_k, opts, opts["slopes"][b, h])
            probs, lse[b, h] = _probabilities(s, _sink(opts, h))
            probs = probs * _dropout_scale(opts, b * nheads + h, rows, cols)
            out[b, :, h] = probs @ v[b, :, h // group]
    return out, lse


def online_softmax_step(m, l, acc, s, v_tile, drop=1.0, guard=True):
    """One key tile of the FlashAttention recurrence, for each row of ``s`` (rows, tile keys)::

        m_new = max(m, max_j s_j)        alpha = exp(m - m_new)
        l     = alpha l + sum_j exp(s_j - m_new)
        acc   = alpha acc + sum_j exp(s_j - m_new) drop_j v_j

    Returns ``(m_new, l, acc, alpha)``. With ``guard`` a row whose max is still -inf (every key
    so far masked) subtracts 0 instead, so it keeps l = 0 rather than computing
    exp(-inf - (-inf)) = NaN.
    """
    m_new = np.maximum(m, s.max(axis=1, initial=-np.inf))
    m_use = np.where(np.isneginf(m_new), 0.0, m_new) if guard else m_new
    with np.errstate(invalid="ignore"):
        alpha = np.exp(m - m_use)  # the correction factor
        p = np.exp(s - m_use[:, None])
    return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + (p * drop) @ v_tile, alpha


def _online_softmax(score_tiles, rows, headdim_v, guard=True, sink=None):
    """The FlashAttention recurrence (``online_softmax_step``) over (scores, values,
    dropout-scale) key tiles, then ``out = acc / l`` and ``lse = m + log l``.

    The state starts at (m, l, acc) = (-inf, 0, 0), or with a sink at (sink, 1, 0): the sink
    is a key every row sees, of score ``sink`` and value 0. ``guard=False`` omits the
    fully-masked guard: a row whose first tiles are all -inf computes exp(-inf - (-inf)) = NaN.
    """
    m = np.full(rows, -np.inf if sink is None else sink)
    l = np.full(rows, 0.0 if sink is None else 1.0)
    acc = np.zeros((rows, headdim_v))
    for s, v_tile, drop in score_tiles:
        m, l, acc, _ = online_softmax_step(m, l, acc, s, v_tile, drop, guard)
    empty = l == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(empty[:, None], 0.0, acc / np.where(empty, 1.0, l)[:, None])
        lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
    if not guard:  # without the guard a NaN, once made, is what the user would see
        bad = np.isnan(l) | np.isnan(m)
        out[bad] = np.nan
        lse[bad] = np.nan
    return out, lse


def _tiled_rows(q_bh, rows, key_tiles, seqlen_q, seqlen_k, opts, slope, bh, guard, headdim_v, sink=None):
    """Run the recurrence for a block of query rows over ``key_tiles`` = [(cols, k, v)]."""
    tiles = (
        (_scores(q_bh, k_t, rows, cols, seqlen_q, seqlen_k, opts, slope), v_t,
         _dropout_scale(opts, bh, rows, cols))
        for cols, k_t, v_t in key_tiles
    )
    return _online_softmax(tiles, len(rows), headdim_v, guard, sink)


def attention_tiled(q, k, v, *, block_m=64, block_n=64, guard=True, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=0,
                    learnable_sink=None):
    """FlashAttention: query blocks of ``block_m`` rows, key/value tiles of ``block_n``.

    Only a (block_m, block_n) score tile and the (block_m,) running statistics exist at
    any time. ``guard=False`` reproduces the NaN of a fully-masked tile.
    """
    if block_m < 1 or block_n < 1:
        raise ValueError("tile sizes must be >= 1")
    q, k, v = _f64(q), _f64(k), _f64(v)
    opts = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
                    learnable_sink)
    batch, seqlen_q, _, _ = q.shape
    seqlen_k = k.shape[1]
    nheads, group = _heads(q, k)
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            k_bh, v_bh = k[b, :, h // group], v[b, :, h // group]
            key_tiles = [(np.arange(s, min(s + block_n, seqlen_k)), k_bh[s:s + block_n], v_bh[s:s + block_n])
                         for s in range(0, seqlen_k, block_n)]
            for start in range(0, seqlen_q, block_m):
                rows = np.arange(start, min(start + block_m, seqlen_q))
                o_blk, lse_blk = _tiled_rows(q[b, rows, h], rows, key_tiles, seqlen_q, seqlen_k, opts,
                                             opts["slopes"][b, h], b * nheads + h, guard, v.shape[-1], _sink(opts, h))
                out[b, rows, h], lse[b, h, rows] = o_blk, lse_blk
    return out, lse


def attention_paged(q, k_pool, v_pool, block_table, seq_lens, *, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, learnable_sink=None):
    """FlashAttention over a paged KV cache: one key tile per page of the block table.

    ``k_pool`` and ``v_pool`` are (num_blocks, block_size, nheads_k, headdim); sequence b's
    key p lives at ``pool[block_table[b, p // block_size], p % block_size]`` for
    p < seq_lens[b]. The queries are the last seqlen_q positions of each sequence.
    """
    q, k_pool, v_pool = _f64(q), _f64(k_pool), _f64(v_pool)
    opts = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes, 0.0, 0, learnable_sink)
    batch, seqlen_q, _, _ = q.shape
    block_size = k_pool.shape[1]
    nheads, group = _heads(q, k_pool)
    out = np.zeros(q.shape[:3] + (v_pool.shape[-1],))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    rows = np.arange(seqlen_q)
    for b in range(batch):
        seqlen_k = int(seq_lens[b])
        for h in range(nheads):
            key_tiles = []
            for page, start in enumerate(range(0, seqlen_k, block_size)):
                n = min(block_size, seqlen_k - start)
                blk = int(block_table[b, page])
                key_tiles.append((np.arange(start, start + n), k_pool[blk, :n, h // group], v_pool[blk, :n, h // group]))
            o_bh, lse_bh = _tiled_rows(q[b, :, h], rows, key_tiles, seqlen_q, seqlen_k, opts,
                                       opts["slopes"][b, h], b * nheads + h, True, v_pool.shape[-1], _sink(opts, h))
            out[b, :, h], lse[b, h] = o_bh, lse_bh
    return out, lse


def attention_split(q, k, v, *, num_splits, block_n=64, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=0, learnable_sink=None):
    """Flash-decoding: the keys cut into ``num_splits`` contiguous ranges, each range runs the
    recurrence on its own (as separate workers would), the partial (o, lse) states merged,
    then the sinks' states (once, not once per split)."""
    if num_splits < 1:
        raise ValueError("num_splits must be >= 1")
    q, k, v = _f64(q), _f64(k), _f64(v)
    opts = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_seed)
    seqlen_k = k.shape[1]
    bounds = np.linspace(0, seqlen_k, num_splits + 1).round().astype(int)
    states = [_attention_on_key_range(q, k, v, lo, hi, block_n, opts) for lo, hi in zip(bounds[:-1], bounds[1:])]
    out, lse = merge_many([o for o, _ in states], [lse for _, lse in states])
    return (out, lse) if learnable_sink is None else merge_sink(out, lse, learnable_sink)


def _attention_on_key_range(q, k, v, lo, hi, block_n, opts):
    """One worker of :func:`attention_split`: keys [lo, hi) only, positions kept global."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    nheads, group = _heads(q, k)
    rows = np.arange(seqlen_q)
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            kh, vh = k[b, :, h // group], v[b, :, h // group]
            key_tiles = [(np.arange(s, min(s + block_n, hi)), kh[s:min(s + block_n, hi)], vh[s:min(s + block_n, hi)])
                         for s in range(lo, hi, block_n)]
            if not key_tiles:
                continue
            out[b, :, h], lse[b, h] = _tiled_rows(q[b, :, h], rows, key_tiles, seqlen_q, seqlen_k, opts,
                                                  opts["slopes"][b, h], b * nheads + h, True, v.shape[-1])
    return out, lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                     softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=0, learnable_sink=None):
    """Packed batch: q (total_q, nheads, d), k/v (total_k, nheads_k, d); sequence b owns
    rows cu_seqlens[b]:cu_seqlens[b+1]. Returns out (total_q, nheads, d), lse (nheads, total_q).
    ``alibi_slopes`` may be (nheads,) or (batch, nheads); dropout counts b as the sequence."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    batch, nheads = len(cu_seqlens_q) - 1, q.shape[1]
    slopes = None if alibi_slopes is None else np.broadcast_to(_f64(alibi_slopes), (batch, nheads))
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    lse = np.full((nheads, q.shape[0]), -np.inf)
    for b in range(batch):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if qe == qs:
            continue
        opts = _options(q[None, qs:qe], softmax_scale, causal, window_size, softcap,
                        None if slopes is None else slopes[b], dropout_p, dropout_seed, learnable_sink)
        _, group = _heads(q[None], k[None])
        rows, cols = np.arange(qe - qs), np.arange(ke - ks)
        for h in range(nheads):
            key_tiles = [(cols, k[ks:ke, h // group], v[ks:ke, h // group])]
            # dropout's head counter for sequence b is b * nheads + h
            out[qs:qe, h], lse[h, qs:qe] = _tiled_rows(q[qs:qe, h], rows, key_tiles, qe - qs, ke - ks, opts,
                                                       opts["slopes"][0, h], b * nheads + h, True, v.shape[-1],
                                                       _sink(opts, h))
    return out, lse


# --------------------------------------------------------------------------- gradients


def attention_naive_grad(q, k, v, dout, *, dlse=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=0, learnable_sink=None):
    """Gradients (dq, dk, dv) of sum(out * dout) + sum(lse * dlse) for :func:`attention_naive`;
    with ``learnable_sink`` (dq, dk, dv, dsink).

    With P the softmax (sink in the denominator), Z = keep / (1 - p) and O = (P Z) V:
        dV = (P Z)^T dO,  dP = (dO V^T) Z,  delta = rowsum(dO * O) - dlse,  dS = P (dP - delta),
        through softcap dS *= 1 - tanh^2,   dQ = scale dS K,  dK = scale dS^T Q,
        dsink_h = -sum over batch and rows of P_sink delta,  P_sink = exp(sink_h - lse).
    (rowsum(dO * O) = rowsum(P dP); d lse / d s_j = P_j and d lse / d sink = P_sink.)
    Key/value heads shared by a group of query heads receive the sum of the group's gradients.
    ``dlse`` is (batch, nheads, seqlen_q) like the LSE, or None (0).
    """
    q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
    opts = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
                    learnable_sink)
    batch, seqlen_q, _, _ = q.shape
    seqlen_k = k.shape[1]
    nheads, group = _heads(q, k)
    dlse = np.zeros((batch, nheads, seqlen_q)) if dlse is None else _f64(dlse)
    rows, cols = np.arange(seqlen_q), np.arange(seqlen_k)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsink = np.zeros(nheads)
    scale, cap = opts["softmax_scale"], opts["softcap"]
    for b in range(batch):
        for h in range(nheads):
            hk = h // group
            s = _scores(q[b, :, h], k[b, :, hk], rows, cols, seqlen_q, seqlen_k, opts, opts["slopes"][b, h])
            p, lse = _probabilities(s, _sink(opts, h))
            z = _dropout_scale(opts, b * nheads + h, rows, cols)
            do = dout[b, :, h]
            dv[b, :, hk] += (p * z).T @ do
            dp = (do @ v[b, :, hk].T) * z
            delta = (dp * p).sum(axis=1) - np.where(np.isneginf(lse), 0.0, dlse[b, h])
            ds = p * (dp - delta[:, None])
            if cap > 0:
                raw = (q[b, :, h] @ k[b, :, hk].T) * scale
                ds = ds * (1.0 - np.tanh(raw / cap) ** 2)
            dq[b, :, h] = scale * ds @ k[b, :, hk]
            dk[b, :, hk] += scale * ds.T @ q[b, :, h]
            if opts["sinks"] is not None:
                dsink[h] -= (np.exp(opts["sinks"][h] - lse) * delta).sum()
    if opts["sinks"] is not None:
        return dq, dk, dv, dsink
    return dq, dk, dv
