"""FlashAttention on the CPU: the tiled recurrence written with batched torch matmuls.

Implements ``attn_fwd`` / ``attn_bwd`` of the contract in ``tileattn.contract``.

Work is cut into query blocks of ``block_m`` rows and key tiles of ``block_n`` keys. A
score tile holds every query head of a chunk of (batch x key head) pairs at once: the
``G = H // Hk`` query heads that share key head ``hk`` are stacked as rows, so one
``bmm`` of shape ``(chunk, G * block_m, D) x (chunk, D, block_n)`` serves GQA/MQA without
repeating K or V. Forward, per query block and key tile (natural-log units)::

    s     = scale * q k^T;  softcap: s = cap * tanh(s / cap);  alibi: s -= slope * |i + off - j|
    s     = -inf where query i does not see key j (only tiles that cross the window's edge)
    m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
    l     = alpha * l + rowsum(p);  o = alpha * o + (p z) v;  m = m_new

with ``z = keep / (1 - dropout_p)`` the dropout scale (1 without dropout), and at the end
``out = o / l``, ``lse = m + log l``. A row whose keys are all masked so far has ``m = -inf``; it is shifted by 0 instead (the guard), so it stays at
``l = 0`` and ends as ``out = 0, lse = -inf`` without a NaN. Key tiles entirely outside a
query block's window are never visited. Learnable sinks (one logit per query head) are
merged into each row's final state once, as the state (out 0, lse sink_h):
``lse' = logaddexp(lse, sink_h)``, ``out' = exp(lse - lse') out``.

The backward recomputes ``p = exp(s - lse)`` per tile (with the sink inside lse, p is the
sink-normalised softmax) and accumulates, with ``delta = rowsum(dout * out) - dlse`` (dlse
the gradient reaching the returned LSE, 0 if none)::

    dv += (p z)^T dout;   ds = p ((dout v^T) z - delta);   softcap: ds *= 1 - tanh^2
    dq += scale ds k;     dk += scale ds^T q;     dsink_h -= sum_rows exp(sink_h - lse) delta

in a fixed order, so gradients are bitwise reproducible. Extra memory: fp32 (fp64 for
float64 inputs) copies of q, k, v, out-sized buffers, i.e. O(N * D), plus score tiles of
at most ``tile_elems`` elements; never N x N.

The code keeps scores in log2 units (``scale * log2(e)`` is folded into the copy of q, or
``cap * log2(e)`` into the softcap and ``log2(e)`` into the alibi slopes) and uses ``exp2``,
which torch evaluates several times faster than ``exp`` on CPUs; the stored lse is
``ln(2) * m + log l``. Score tiles are written into reused buffers, and the backward's
tiles are transposed (keys first, ``[c, keys, G * rows]``), the layout in which its
batched matmuls run fastest.

A problem that is one tile (decoding, short prefills) without ALiBi or dropout, whose rows
all see a key, runs that one step directly on strided views (``_fwd_whole``): a handful of
torch calls, as their Python and dispatch cost more than the arithmetic there. A decoding
step of batch 1 called again and again (the ops layer's lane, ``prepared.py``) runs the same ops
from ``RowStep``, its views' layout bound once per call signature. Every other problem, one
tile or many, runs the tiled recurrence (``_fwd_range``).

Causal and window masks align bottom-right: with ``off = seqlen_k - seqlen_q`` query i sees
key j iff ``i + off - window_left <= j <= i + off + window_right`` (unbounded sides < 0).

Every entry point computes in the dtypes it states whatever ``torch.autocast`` says
(``without_autocast``): the Triton kernels do, and the accumulation in fp32 is the point. Under a
CPU autocast region torch would otherwise run these matmuls in bf16 (fp32 inputs: errors of
1e-2, or a dtype clash; bf16 inputs: their fp32 accumulation undone), and the lane's one-row step
returned a bf16 output for fp32 inputs where the first call of its signature raised.
"""

from __future__ import annotations

import functools
import math

import torch

from ..dropout_mask import keep_mask
from ..contract import AttnParams
from ..ops.merge import merge_many

__all__ = ["attn_fwd", "attn_bwd", "without_autocast"]

BLOCK_M = 256  # query rows per block
BLOCK_N = 512  # keys per tile
TILE_ELEMS = 1 << 21  # score-tile elements (chunk x G x block_m x block_n) at most
LOG2E, LN2 = math.log2(math.e), math.log(2.0)
# every tensor this path allocates, named on its device: this path runs on CPU tensors only, and a
# user's torch.set_default_device (e.g. "cuda") must not move its scratch, masks or buffers
_CPU = torch.device("cpu")
# whether any autocast region is on (~0.08 us on the 2-core CPU machine, against ~0.28 for
# torch.is_autocast_enabled("cpu"), which is asked only then)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast_on() -> bool:
    """Whether torch.autocast would change the dtype of this backend's CPU matmuls now."""
    return _any_autocast() and torch.is_autocast_enabled("cpu")


def without_autocast(fn):
    """``fn`` run with CPU autocast off when it is on (see the module docstring)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if autocast_on():
            with torch.autocast("cpu", enabled=False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


# ------------------------------------------------------------------ sequences and views


class _Batch:
    """Host-side copies of the integer arguments that cut the inputs into sequences."""

    def __init__(self, nbatch, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table):
        self.nbatch = nbatch
        self.cu_q = None if cu_seqlens_q is None else cu_seqlens_q.tolist()
        self.cu_k = None if cu_seqlens_k is None else cu_seqlens_k.tolist()
        self.used = None if seqused_k is None else seqused_k.tolist()
        self.table = None if block_table is None else block_table.to(torch.long)
        assert self.table is None or self.used is not None, "a paged KV cache (block_table) needs seqused_k"

    def groups(self):
        """Batch slices computed together: all at once when every sequence has the same
        lengths (dense, no seqused_k), else one sequence at a time."""
        if self.cu_q is None and self.used is None:
            return [slice(0, self.nbatch)]
        return [slice(b, b + 1) for b in range(self.nbatch)]

    def uniform(self):
        """(Sq, Sk) when packed sequences all have Sq queries and Sk keys, laid out back to
        back (cu_seqlens in equal steps, no seqused_k or block table), else None: the batch
        is then a dense one, and :meth:`dense` views it so."""
        if self.cu_q is None or self.cu_k is None or self.used is not None or self.table is not None:
            return None
        cq, ck, nb = self.cu_q, self.cu_k, self.nbatch
        sq, sk = cq[1] - cq[0], ck[1] - ck[0]
        if cq[nb] - cq[0] != nb * sq or ck[nb] - ck[0] != nb * sk:
            return None
        if any(cq[b] != cq[0] + b * sq or ck[b] != ck[0] + b * sk for b in range(2, nb)):
            return None
        return sq, sk

    def ends_aligned(self):
        """(Sq, Sk, pitch, first) when the sequences all have Sq queries laid out back to back
        and their used keys (``seqused_k`` from ``cu_seqlens_k``'s starts) end ``pitch`` tokens
        apart: then key row b's last Sk keys are tokens first + b * pitch ... + Sk - 1 (Sk the
        most keys of a sequence, first >= 0), a dense (nb, Sk) view in which sequence b leaves its
        first Sk - used[b] keys out. A left-padded batch read from a cache is such a batch."""
        if self.cu_q is None or self.cu_k is None or self.used is None or self.table is not None or self.nbatch < 2:
            return None
        cq, nb = self.cu_q, self.nbatch
        sq = cq[1] - cq[0]
        ends = [start + n for start, n in zip(self.cu_k, self.used)]
        pitch, longest = ends[1] - ends[0], max(self.used)
        if (pitch < 0 or ends[0] < longest or any(cq[b] != cq[0] + b * sq for b in range(2, nb + 1))
                or any(e != ends[0] + b * pitch for b, e in enumerate(ends))):
            return None
        return sq, longest, pitch, ends[0] - longest

    def dense(self, x, lengths, keys=False):
        """Packed (T, ...) of a uniform batch -> its (nb, S, ...) view; lengths = uniform()."""
        c0, n = (self.cu_k[0], lengths[1]) if keys else (self.cu_q[0], lengths[0])
        if c0 or x.shape[0] != self.nbatch * n:
            x = x[c0:c0 + self.nbatch * n]
        return x.view((self.nbatch, n) + x.shape[1:])

    def dense_lse(self, lse, lengths):
        """Packed LSE (H, Tq) of a uniform batch -> its (nb, H, Sq) view."""
        c0, n = self.cu_q[0], lengths[0]
        if c0 or lse.shape[1] != self.nbatch * n:
            lse = lse[:, c0:c0 + self.nbatch * n]
        return lse.view(lse.shape[0], self.nbatch, n).transpose(0, 1)

    def rows(self, x, bs):
        """Query-aligned tensor (B, Sq, ...) or packed (Tq, ...) -> (nb, Sq_b, ...) view."""
        if self.cu_q is None:
            return x[bs]
        b = bs.start
        return x[self.cu_q[b]:self.cu_q[b + 1]].unsqueeze(0)

    def lse_rows(self, lse, bs):
        """LSE (B, H, Sq) or packed (H, Tq) -> (nb, H, Sq_b) view."""
        if self.cu_q is None:
            return lse[bs]
        b = bs.start
        return lse[:, self.cu_q[b]:self.cu_q[b + 1]].unsqueeze(0)

    def keys(self, x, bs):
        """Key-aligned tensor -> (nb, Sk_b, Hk, D): a view, or for a paged pool a gather of
        the blocks the table names for the used keys (other blocks are never read)."""
        b = bs.start
        if self.table is not None:
            n = self.used[b]
            pages = self.table[b, :math.ceil(n / x.shape[1])]
            return x[pages].flatten(0, 1)[:n].unsqueeze(0)
        if self.cu_k is not None:
            start = self.cu_k[b]
            n = self.used[b] if self.used is not None else self.cu_k[b + 1] - start
            return x[start:start + n].unsqueeze(0)
        if self.used is not None:
            return x[bs, :self.used[b]]
        return x[bs]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_first(x, acc, scale=1.0):
    """(B, S, H, D) any strides -> contiguous (B * H, S, D) in the accumulation dtype."""
    B, S, H, D = x.shape
    y = torch.empty((B, H, S, D), dtype=acc, device=_CPU)
    y.copy_(x.permute(0, 2, 1, 3))
    if scale != 1.0:
        y.mul_(scale)
    return y.view(B * H, S, D)


# --------------------------------------------------------------------- one score tile


def _needs_mask(params: AttnParams, off, i0, i1, j0, j1) -> bool:
    """Whether some (row, key) pair of the tile rows [i0, i1) x keys [j0, j1) lies outside the
    window; ``off`` is the diagonal (query i sits at key position i + off)."""
    left, right = params.window_left, params.window_right
    return (right >= 0 and j1 - 1 > i0 + off + right) or (left >= 0 and j0 < i1 - 1 + off - left)


_HIDDEN: dict = {}


def _window_mask(params: AttnParams, off, i0, i1, j0, j1):
    """The tile's [rows, keys] window as booleans: True where the pair is outside (hidden). It
    depends only on the tile's shape and its place relative to the diagonal, so it is built once
    per such place and kept (decoding and prefills repeat them).

    Scores are hidden with ``masked_fill_``, not by adding a tile of 0 / -inf (a few times
    cheaper on a row-major tile): a NaN or +inf score (a NaN or inf in a key) plus -inf is NaN,
    which then reached every row of the tile, rows that cannot see that key included; torch's
    softmax attention with a masked_fill (and the Triton kernels' ``tl.where``) keep them clean."""
    left, right = params.window_left, params.window_right
    key = (i1 - i0, j1 - j0, j0 - i0 - off, left, right)
    hidden = _HIDDEN.get(key)
    if hidden is None:
        rows = torch.arange(i1 - i0, device=_CPU).view(-1, 1)
        cols = torch.arange(j1 - j0, device=_CPU).view(1, -1) + (j0 - i0 - off)  # key j - (row i's diagonal i + off)
        hidden = torch.zeros(i1 - i0, j1 - j0, dtype=torch.bool, device=_CPU)
        if right >= 0:
            hidden |= cols > rows + right
        if left >= 0:
            hidden |= cols < rows - left
        if len(_HIDDEN) >= 256:
            _HIDDEN.clear()
        _HIDDEN[key] = hidden
    return hidden


class _Tiles:
    """Per-call constants and the score tile of (query block, key tile) for a group."""

    def __init__(self, params: AttnParams, Sq, Sk, H, Hk, pairs, slopes, b0, acc, block_m, block_n, tile_elems):
        if block_m < 1 or block_n < 1:
            raise ValueError(f"tile sizes must be >= 1, got block_m={block_m}, block_n={block_n}")
        self.p = params
        self.Sq, self.Sk, self.H, self.G = Sq, Sk, H, H // Hk
        self.off = Sk - Sq + params.diag_shift  # the diagonal: bottom-right aligned, moved by diag_shift
        self.cap = params.softcap
        # q is pre-multiplied by qscale so that bmm gives scale * q.k in log2 units (or the
        # natural scores / cap, whose tanh is then scaled by cap * log2(e))
        self.qscale = params.softmax_scale / self.cap if self.cap > 0 else params.softmax_scale * LOG2E
        self.acc = acc
        self.neg_slopes = None if slopes is None else (-LOG2E * slopes.to(acc)).reshape(-1, self.G)  # [B * Hk, G]
        self.b0 = b0
        self.bm, self.bn = max(1, min(block_m, Sq)), max(1, min(block_n, Sk))
        # (batch x key head) pairs per tile: no more than there are, so a small problem gets
        # small buffers (an allocation of tile_elems per call costs more than its arithmetic)
        self.chunk = max(1, min(tile_elems // (self.G * self.bm * self.bn), pairs))
        self._bufs = {}

    def buffer(self, name, shape):
        """A reused tile-sized scratch tensor of ``shape`` (fresh pages per tile are slow)."""
        n = math.prod(shape)
        if name not in self._bufs or self._bufs[name].numel() < n:
            self._bufs[name] = torch.empty(max(n, self.chunk * self.G * self.bm * self.bn), dtype=self.acc,
                                             device=_CPU)
        return self._bufs[name][:n].view(shape)

    def key_range(self, i0, i1, lo, hi):
        """Keys in [lo, hi) that some query row of [i0, i1) may see (window bounds)."""
        left, right = self.p.window_left, self.p.window_right
        if right >= 0:
            hi = min(hi, i1 - 1 + self.off + right + 1)
        if left >= 0:
            lo = max(lo, i0 + self.off - left)
        return lo, hi

    def needs_mask(self, i0, i1, j0, j1):
        """Whether some (row, key) pair of the tile lies outside the window."""
        return _needs_mask(self.p, self.off, i0, i1, j0, j1)

    def scores(self, q_t, k_t, t0, i0, i1, j0, j1, keep_tanh=False, keys_first=False):
        """Masked scores [c, G * rows, keys] of q_t [c, G * rows, D] against k_t [c, keys, D]
        in log2 units, or with ``keys_first`` their transpose [c, keys, G * rows] (the
        backward's matmuls run faster on it); with ``keep_tanh`` also returns
        tanh(raw / cap) in the same layout for the softcap derivative."""
        c, gm, n = q_t.shape[0], q_t.shape[1], k_t.shape[1]
        if keys_first:
            s = torch.bmm(k_t, q_t.transpose(1, 2), out=self.buffer("s", (c, n, gm)))  # [c, n, G*mr]
        else:
            s = torch.bmm(q_t, k_t.transpose(1, 2), out=self.buffer("s", (c, gm, n)))  # [c, G*mr, n]
        th = None
        if self.cap > 0:
            if keep_tanh:
                th = s.tanh_()
                s = th * (self.cap * LOG2E)
            else:
                s.tanh_().mul_(self.cap * LOG2E)
        # s4 [c, G, mr, n] and tile-shaped masks [mr, n] are views of s in either layout
        masked = self.needs_mask(i0, i1, j0, j1)
        if self.neg_slopes is None and not masked:
            return s, th
        s4 = s.view(c, n, self.G, i1 - i0).permute(0, 2, 3, 1) if keys_first else s.view(c, self.G, i1 - i0, n)
        if self.neg_slopes is not None:
            rows = torch.arange(i0, i1, dtype=self.acc, device=_CPU).view(-1, 1) + self.off
            cols = torch.arange(j0, j1, dtype=self.acc, device=_CPU).view(1, -1)
            slopes = self.neg_slopes[t0:t0 + c].view(-1, self.G, 1, 1)  # [c, G, 1, 1]
            s4.addcmul_(slopes, (rows - cols).abs())
        if masked:
            s4.masked_fill_(_window_mask(self.p, self.off, i0, i1, j0, j1), float("-inf"))
        return s, th

    def keep(self, t0, c, i0, i1, j0, j1):
        """Dropout keep / (1 - p) as [c, G * rows, keys] of (batch x key head) pairs [t0, t0 + c):
        element (b, h, i, j) hashes as bh = b * stride + bh0 + h, i + i0, j + j0, the coordinates it
        has in the whole batch (``AttnParams.dropout_offsets``; bh = b * H + h for a plain call)."""
        bh0, stride, r0, c0 = self.p.dropout_offsets(self.H)
        rows, cols = torch.arange(i0, i1, device=_CPU) + r0, torch.arange(j0, j1, device=_CPU) + c0
        z = torch.empty(c * self.G, i1 - i0, j1 - j0, dtype=self.acc, device=_CPU)
        Hk = self.H // self.G
        for x in range(c * self.G):
            b, hk = divmod(t0 + x // self.G, Hk)  # the pair's batch (in this group) and key head
            bh = (self.b0 + b) * stride + bh0 + hk * self.G + x % self.G
            z[x] = keep_mask(self.p.dropout_seed, bh, rows, cols, self.p.dropout_p)
        return z.mul_(1.0 / (1.0 - self.p.dropout_p)).view(c, -1, j1 - j0)


def _gather_q(x, t0, t1, G, i0, i1):
    """[B*H, S, D] buffer -> the rows [i0, i1) of chunk [t0, t1) as [c, G * rows, D]."""
    BH, S, D = x.shape
    return x.view(BH // G, G, S, D)[t0:t1, :, i0:i1].reshape(t1 - t0, -1, D)


def _scatter_q(x, y, t0, t1, G, i0, i1):
    """Inverse of :func:`_gather_q`: write y [c, G * rows, ...] into buffer x [B*H, S, ...]."""
    BH, S = x.shape[:2]
    x.view(BH // G, G, S, *x.shape[2:])[t0:t1, :, i0:i1] = y.view(t1 - t0, G, i1 - i0, *x.shape[2:])


# ---------------------------------------------------------------------------- forward


def _split_bounds(Sk, num_splits):
    return [round(s * Sk / num_splits) for s in range(num_splits + 1)]


def _fwd_range(T: _Tiles, q_t, kc, vc, t0, i0, i1, lo, hi):
    """The recurrence over keys [lo, hi): returns (o, lse) of shape [c, G*mr, Dv], [c, G*mr]."""
    c, t1 = q_t.shape[0], t0 + q_t.shape[0]
    o = l = m = None
    for j0 in range(lo, hi, T.bn):
        j1 = min(j0 + T.bn, hi)
        s, _ = T.scores(q_t, kc[t0:t1, j0:j1], t0, i0, i1, j0, j1)  # [c, G*mr, n]
        m_tile = s.amax(dim=-1)  # [c, G*mr]
        m_new = m_tile if m is None else torch.maximum(m, m_tile)
        m_use = m_new.clamp(min=torch.finfo(T.acc).min)  # the fully-masked guard: a finite shift
        p = s.sub_(m_use.unsqueeze(-1)).exp2_()
        l_tile = p.sum(dim=-1)  # the softmax's denominator ignores dropout
        if T.p.dropout_p > 0:
            p.mul_(T.keep(t0, c, i0, i1, j0, j1))  # keep / (1 - dropout_p)
        if o is None:
            o, l = torch.bmm(p, vc[t0:t1, j0:j1]), l_tile  # [c, G*mr, Dv]
        else:
            alpha = (m - m_use).exp2_()  # [c, G*mr]
            l = l.mul_(alpha).add_(l_tile)
            o = o.mul_(alpha.unsqueeze(-1)).baddbmm_(p, vc[t0:t1, j0:j1])
        m = m_new
    if o is None:
        return None
    # A row that saw no key has l = 0, o = 0 and m = -inf: o / max(l, tiny) = 0, and
    # ln(2) m + log l = -inf (a row with a finite m has l >= 1, its largest term).
    lse = l.log().add_(m, alpha=LN2)
    return o.div_(l.clamp_(min=torch.finfo(T.acc).tiny).unsqueeze(-1)), lse


def _add_sink(o_buf, lse_buf, sink, B):
    """Merge the sink states (out 0, lse sink_h) into o_buf [B*H, Sq, Dv], lse_buf [B*H, Sq], in place."""
    sink_bh = sink.to(lse_buf.dtype).repeat(B).unsqueeze(-1)  # [B*H, 1]
    lse_new = torch.logaddexp(lse_buf, sink_bh)
    o_buf.mul_((lse_buf - lse_new).exp_().unsqueeze(-1))  # exp(-inf) = 0 where the row saw no key
    lse_buf.copy_(lse_new)


def _fwd_group(q4, k4, v4, out4, lse3, slopes, sink, b0, params, num_splits, block_m, block_n, tile_elems,
               seqlen_k=None):
    """Forward for sequences of equal lengths: q4 (B, Sq, H, D), k4/v4 (B, Sk, Hk, D), of which
    the first ``seqlen_k`` keys (all when None) are attended to."""
    B, Sq, H, _ = q4.shape
    Sk, Hk, Dv = k4.shape[1] if seqlen_k is None else seqlen_k, k4.shape[2], v4.shape[-1]
    if Sq == 0:
        return
    if Sk == 0:
        out4.zero_()
        lse3.copy_(torch.full_like(lse3, float("-inf")) if sink is None else sink.view(1, H, 1).expand_as(lse3))
        return
    if _one_tile(params, B, H, Sq, Sk, slopes, num_splits, block_m, block_n, tile_elems):
        _fwd_whole(params, q4, k4, v4, sink, Sk, out4=out4, lse3=lse3)
        return
    k4, v4 = k4.narrow(1, 0, Sk), v4.narrow(1, 0, Sk)
    acc = _acc_dtype(q4.dtype)
    T = _Tiles(params, Sq, Sk, H, Hk, B * Hk, slopes, b0, acc, block_m, block_n, tile_elems)
    qc = _heads_first(q4, acc, T.qscale)  # [B*H, Sq, D]
    kc, vc = _heads_first(k4, acc), _heads_first(v4, acc)  # [B*Hk, Sk, D]
    o_buf = torch.zeros(B * H, Sq, Dv, dtype=acc, device=_CPU)
    lse_buf = torch.full((B * H, Sq), float("-inf"), dtype=acc, device=_CPU)
    bounds = _split_bounds(Sk, num_splits)
    for t0 in range(0, B * Hk, T.chunk):
        t1 = min(t0 + T.chunk, B * Hk)
        for i0 in range(0, Sq, T.bm):
            i1 = min(i0 + T.bm, Sq)
            q_t = _gather_q(qc, t0, t1, T.G, i0, i1)  # [c, G*mr, D]
            parts = []
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                part = _fwd_range(T, q_t, kc, vc, t0, i0, i1, *T.key_range(i0, i1, lo, hi))
                if part is not None:
                    parts.append(part)
            if not parts:
                continue
            if len(parts) == 1:
                o, lse = parts[0]
            else:  # merge_many's layout: o (N, rows, 1, Dv) with lse (N, 1, rows)
                o, lse = merge_many([o.view(-1, i1 - i0, 1, Dv) for o, _ in parts],
                                    [lse.view(-1, 1, i1 - i0) for _, lse in parts])
            _scatter_q(o_buf, o.reshape(t1 - t0, -1, Dv), t0, t1, T.G, i0, i1)
            _scatter_q(lse_buf, lse.reshape(t1 - t0, -1), t0, t1, T.G, i0, i1)
    if sink is not None:
        _add_sink(o_buf, lse_buf, sink, B)
    out4.copy_(o_buf.view(B, H, Sq, Dv).transpose(1, 2))
    lse3.copy_(lse_buf.view(B, H, Sq))


def _one_tile(params: AttnParams, B, H, Sq, Sk, slopes, num_splits, block_m, block_n, tile_elems,
              leading: int = 0) -> bool:
    """Whether ``_fwd_whole`` computes this problem (one tile, no ALiBi, dropout or splits, every
    row sees a key; ``leading``: the most keys a sequence leaves out at the start)."""
    return (num_splits == 1 and slopes is None and params.dropout_p == 0 and 1 <= Sq <= block_m
            and 1 <= Sk <= block_n and B * H * Sq * Sk <= tile_elems and not _has_empty_rows(params, Sq, Sk, leading))


def _has_empty_rows(params: AttnParams, Sq, Sk, leading: int = 0) -> bool:
    """Whether some query row sees no key at all (its window lies outside leading .. Sk - 1). The
    window of row i is [i + off - left, i + off + right]: row 0 has the smallest right end,
    row Sq - 1 the largest left end."""
    off = Sk - Sq + params.diag_shift
    return (leading >= Sk or (params.window_right >= 0 and off + params.window_right < leading)
            or (params.window_left >= 0 and Sq - 1 + off - params.window_left > Sk - 1))


_ZERO = {acc: torch.zeros((), dtype=acc, device=_CPU) for acc in (torch.float32, torch.float64)}


def _fwd_whole(params: AttnParams, q4, k4, v4, sink, Sk, leading=None, out4=None, lse3=None):
    """``_fwd_group`` for a problem that is one tile and whose rows all see some key, without
    ALiBi or dropout (decoding, short prefills), over the first Sk keys of k4/v4: the single
    step on the whole [B*Hk, G*Sq, Sk] score tile in a handful of ops (each costs more in
    Python and dispatch than in arithmetic here). The q, k, v views go to the batched matmuls
    as they are (bmm takes their strides), the window is one masked_fill of a cached ``_window_mask``,
    and the division by l writes (and casts) straight into ``out``::

        s = qscale q k^T (window: -inf);  m = rowmax(s);  p = exp2(s - m);  l = rowsum(p) (+ exp2(sink - m))
        out = (p v) / l;            lse = ln(2) m + log l

    ``leading`` (a tuple, one count per sequence) leaves each sequence's first keys out: their
    scores are set to -inf and their values to 0 in the copy that is multiplied (they may hold
    anything, NaN included, and 0 x NaN would reach the output).

    Returns (out4, lse3), written into those given, else new tensors (out in q's dtype, lse in the
    accumulation dtype, which is the contract's: fp64 for fp64 inputs, else fp32): the lse rows,
    and for decoding the batched matmul's result, are returned as they are, no copy.
    """
    (B, Sq, H, D), Hk, Dv = q4.shape, k4.shape[2], v4.shape[-1]
    G, BH, acc, cap = H // Hk, B * Hk, _acc_dtype(q4.dtype), params.softcap
    # rows (g, i) of key head hk: the [B*Hk, G*Sq, D] layout whose rows are those of head hk * G + g
    if Sq == 1:
        qh = q4.reshape(BH, G, D)
    else:
        qh = q4.view(B, Sq, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(BH, G * Sq, D)
    kh, vh = _by_key_head(k4, Sk, keys_last=True), _by_key_head(v4, Sk)  # [B*Hk, D, Sk], [B*Hk, Sk, Dv]
    if q4.dtype != acc:
        qh, kh, vh = qh.to(acc), kh.to(acc), vh.to(acc)
    if cap > 0:
        s = torch.bmm(qh, kh).mul_(params.softmax_scale / cap).tanh_().mul_(cap * LOG2E)
    else:  # [B*Hk, G*Sq, Sk] in log2 units; beta=0: the zero input is never read
        s = torch.baddbmm(_ZERO[acc], qh, kh, beta=0.0, alpha=params.softmax_scale * LOG2E)
    if leading is not None:
        hidden = _leading_keys(leading, Sk)  # (B, Sk)
        s.view(B, -1, Sk).masked_fill_(hidden.unsqueeze(1), float("-inf"))
        vh = vh.view(B, Hk, Sk, Dv).masked_fill(hidden.view(B, 1, Sk, 1), 0.0).view(BH, Sk, Dv)
    off = Sk - Sq + params.diag_shift
    if _needs_mask(params, off, 0, Sq, 0, Sk):
        s.view(BH, G, Sq, Sk).masked_fill_(_window_mask(params, off, 0, Sq, 0, Sk), float("-inf"))
    m = torch.amax(s, -1, True)  # [B*Hk, G*Sq, 1], finite: every row sees a key
    p = s.sub_(m).exp2_()
    l = torch.sum(p, -1, True)
    if sink is not None:  # the state (out 0, lse sink_h) joins the denominator
        sink2 = sink.to(acc).mul(LOG2E).view(1, Hk, G, 1, 1).expand(B, Hk, G, Sq, 1).reshape(BH, G * Sq, 1)
        l.add_((sink2 - m).exp2_())
    if Sq == 1 and q4.dtype == acc and (out4 is None or out4.is_contiguous()):  # rows (hk, g) are out's heads
        out4 = torch.bmm(p, vh, out=None if out4 is None else out4.view(BH, G, Dv)).div_(l).view(B, Sq, H, Dv)
    else:  # out4 (B, Sq, H, Dv) = p v / l, rows (hk, g, i) to out's (i, hk, g)
        if out4 is None:
            out4 = q4.new_empty((B, Sq, H, Dv))
        torch.div(torch.bmm(p, vh).view(B, Hk, G, Sq, Dv).permute(0, 3, 1, 2, 4),
                  l.view(B, Hk, G, Sq, 1).permute(0, 3, 1, 2, 4), out=out4.view(B, Sq, Hk, G, Dv))
    lse = l.log_().add_(m, alpha=LN2).view(B, H, Sq)  # rows (hk, g, i) are lse's (h, i)
    if lse3 is None:
        return out4, lse
    lse3.copy_(lse)
    return out4, lse3


_LEADING: dict = {}


def _leading_keys(leading: tuple, Sk: int) -> torch.Tensor:
    """(B, Sk) bool, true at the first leading[b] keys of sequence b; kept per (leading, Sk), as
    every layer of a decoding step asks for the same one."""
    key = (leading, Sk)
    hidden = _LEADING.get(key)
    if hidden is None:
        if len(_LEADING) >= 64:
            _LEADING.clear()
        hidden = _LEADING[key] = torch.arange(Sk, device=_CPU) < torch.tensor(leading, device=_CPU).unsqueeze(1)
    return hidden


def _by_key_head(x, S: int, keys_last: bool = False):
    """The first S keys of x (B, >= S, Hk, D), any strides, as [B*Hk, S, D], or its transposed
    view [B*Hk, D, S] when ``keys_last``: for one sequence a single strided view, else a copy that
    keeps D innermost (a transposing copy to [B*Hk, D, S] costs three times as much)."""
    B, _, Hk, D = x.shape
    if B == 1:
        _, slot, head, feature = x.stride()
        if keys_last:  # as_strided keeps x's storage offset
            return x.as_strided((Hk, D, S), (head, feature, slot))
        return x.as_strided((Hk, S, D), (head, slot, feature))
    y = (x if S == x.shape[1] else x.narrow(1, 0, S)).transpose(1, 2).reshape(B * Hk, S, D)
    return y.transpose(1, 2) if keys_last else y


def _common_length(k, seqused_k) -> int | None:
    """The keys each sequence of a dense batch attends to when that is one number: all of k's
    without ``seqused_k``, else the length every sequence of a contiguous cache holds (one
    decoding batch in step); None when the lengths differ."""
    used = None if seqused_k is None else seqused_k.tolist()
    if not used:
        return k.shape[1]
    return used[0] if used.count(used[0]) == len(used) else None


def fwd_one_tile(q, k, v, params: AttnParams, seqused_k, learnable_sink):
    """``attn_fwd``'s (out, lse) for a dense batch without ALiBi, dropout, splits, block table or
    descales when ``_fwd_whole`` computes it (one tile: decoding, short prefills), in outputs
    that step allocates; None, having done nothing, for any other problem. The CPU fast lane
    (``prepared.PreparedFwd``) tries it first for the signatures it fits."""
    Sk = _common_length(k, seqused_k)
    B, Sq, H, _ = q.shape
    if Sk is None or not _one_tile(params, B, H, Sq, Sk, None, 1, BLOCK_M, BLOCK_N, TILE_ELEMS):
        return None
    return _fwd_whole(params, q, k, v, learnable_sink, Sk)


class RowStep:
    """``_fwd_whole`` for one query row of one sequence (a decoding step of batch 1, or a dense call of
    that shape), its layout bound once per call signature: ``RowStep.bind(q, k, v, params)`` for tensors
    whose shapes, strides and dtypes every later call shares (a memo entry's, ``prepared.PreparedFwd``),
    then ``step(q, k, v, seqused_k)`` -> (out, lse) for each call, or None (nothing done) when this
    call's key count is not one tile (none, or more than ``BLOCK_N``).

    The arithmetic is ``_fwd_whole``'s for Sq = 1, op for op (the results are bitwise the same); what
    it saves is the per-call Python around it (about an eighth of a tiny decoding call's time): the
    views' sizes and strides, the scale and the checks that read only metadata are worked out once,
    leaving the lengths' read and the op calls. ``bind`` returns None for a signature it does not
    serve: a batch of more than one, several query rows, a dtype other than fp32/fp64 (the
    accumulation dtypes: no cast), softcap, or a window that can hide keys from the row (a left
    bound, or a right one the diagonal shift moves left of the row's own key). ALiBi, dropout,
    splits, block tables, descales and sinks are ``prepare_fwd``'s to exclude."""

    __slots__ = ("q_size", "q_stride", "k_stride", "v_stride", "alpha", "zero", "max_keys", "out_shape",
                 "lse_shape", "dims")

    @classmethod
    def bind(cls, q, k, v, params: AttnParams) -> "RowStep | None":
        (B, Sq, H, D), Hk, Dv = q.shape, k.shape[2], v.shape[-1]
        acc = _acc_dtype(q.dtype)
        if (B != 1 or Sq != 1 or q.dtype != acc or k.dtype != acc or v.dtype != acc or params.softcap > 0
                or params.dropout_p > 0 or params.window_left >= 0
                or (params.window_right >= 0 and params.window_right + params.diag_shift < 0)):
            return None
        step = cls()
        G, (_, _, head, feature) = H // Hk, q.stride()
        step.q_size, step.q_stride = (Hk, G, D), (G * head, head, feature)  # rows (hk, g) are head hk * G + g
        _, slot, head, feature = k.stride()
        step.k_stride = (head, feature, slot)  # [Hk, D, Sk]: keys last, as _by_key_head's view
        _, slot, head, feature = v.stride()
        step.v_stride = (head, slot, feature)  # [Hk, Sk, Dv]
        step.alpha, step.zero = params.softmax_scale * LOG2E, _ZERO[acc]
        step.max_keys = min(BLOCK_N, TILE_ELEMS // H)  # _one_tile's bounds for B = Sq = 1
        step.out_shape, step.lse_shape, step.dims = (1, 1, H, Dv), (1, H, 1), (Hk, D, Dv)
        return step

    def __call__(self, q, k, v, seqused_k):
        # Python-level choices made here cost as much as an op: views get their sizes as separate
        # ints (a tuple takes a slower parse) and as_strided keeps the input's storage offset
        # (passing it costs more than reading it); torch.amax / torch.sum parse faster than methods.
        Sk = k.shape[1] if seqused_k is None else seqused_k.tolist()[0]
        if not 1 <= Sk <= self.max_keys:
            return None
        Hk, D, Dv = self.dims
        s = torch.baddbmm(self.zero, q.as_strided(self.q_size, self.q_stride), k.as_strided((Hk, D, Sk), self.k_stride),
                          beta=0.0, alpha=self.alpha)  # [Hk, G, Sk] in log2 units
        m = torch.amax(s, -1, True)  # [Hk, G, 1]
        p = s.sub_(m).exp2_()
        l = torch.sum(p, -1, True)
        out = torch.bmm(p, v.as_strided((Hk, Sk, Dv), self.v_stride)).div_(l)
        return out.view(*self.out_shape), l.log_().add_(m, alpha=LN2).view(*self.lse_shape)


@without_autocast
def attn_fwd(q, k, v, out, lse, *, params: AttnParams, alibi_slopes=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             seqused_k=None, block_table=None, num_splits=1, learnable_sink=None, k_descale=None, v_descale=None,
             block_m=BLOCK_M, block_n=BLOCK_N, tile_elems=TILE_ELEMS) -> None:
    """Attention forward into ``out`` and ``lse`` (layouts: ``tileattn.contract``).

    ``num_splits`` > 1 runs the recurrence on that many key ranges and merges the partial
    states with ``tileattn.ops.merge.merge_many``; 0 means 1. ``block_m``, ``block_n`` and
    ``tile_elems`` size the tiles; any values give the same answer up to rounding. The keys and
    values of an FP8 cache (``k_descale``/``v_descale`` given) are dequantised per sequence.
    """
    assert num_splits >= 0, "inputs are validated by tileattn.ops"
    num_splits = max(1, num_splits)
    if cu_seqlens_q is None and block_table is None and k_descale is None:
        # a dense batch, or a contiguous cache whose sequences all hold the same number of keys
        # (one decoding batch in step): one group, with no per-sequence views
        seqlen_k = _common_length(k, seqused_k)
        if seqlen_k is not None:
            _fwd_group(q, k, v, out, lse, alibi_slopes, learnable_sink, 0, params, num_splits, block_m, block_n,
                       tile_elems, seqlen_k)
            return
    nbatch = q.shape[0] if cu_seqlens_q is None else len(cu_seqlens_q) - 1
    batch = _Batch(nbatch, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
    acc = _acc_dtype(q.dtype)

    def keys(x, descale, bs):  # (nb, Sk, Hk, D): stored x descale[b, h] for an FP8 cache
        x = batch.keys(x, bs)
        return x if descale is None else x.to(acc) * descale[bs].to(acc)[:, None, :, None]

    lengths = batch.uniform()
    if lengths is not None and k_descale is None:  # a packed batch of equal sequences: one dense group
        _fwd_group(batch.dense(q, lengths), batch.dense(k, lengths, keys=True), batch.dense(v, lengths, keys=True),
                   batch.dense(out, lengths), batch.dense_lse(lse, lengths), alibi_slopes, learnable_sink, 0, params,
                   num_splits, block_m, block_n, tile_elems)
        return
    aligned = None if k_descale is not None else batch.ends_aligned()
    if aligned is not None:  # keys that end evenly spaced (a left-padded batch): one tile over a dense view
        Sq, Sk, pitch, first = aligned
        leading = tuple(Sk - n for n in batch.used)
        if _one_tile(params, nbatch, q.shape[1], Sq, Sk, alibi_slopes, num_splits, block_m, block_n, tile_elems,
                     max(leading)):
            k4, v4 = (x.as_strided((nbatch, Sk, *x.shape[1:]), (pitch * x.stride(0), *x.stride()),
                                   x.storage_offset() + first * x.stride(0)) for x in (k, v))
            lengths = (Sq, Sk)
            _fwd_whole(params, batch.dense(q, lengths), k4, v4, learnable_sink, Sk, leading,
                       out4=batch.dense(out, lengths), lse3=batch.dense_lse(lse, lengths))
            return
    for bs in batch.groups():
        slopes = None if alibi_slopes is None else alibi_slopes[bs]
        _fwd_group(batch.rows(q, bs), keys(k, k_descale, bs), keys(v, v_descale, bs), batch.rows(out, bs),
                   batch.lse_rows(lse, bs), slopes, learnable_sink, bs.start, params, num_splits, block_m, block_n,
                   tile_elems)


# --------------------------------------------------------------------------- backward


def _bwd_group(do4, q4, k4, v4, o4, lse3, dlse3, dq4, dk4, dv4, dsink, slopes, sink, b0, params, block_m, block_n,
               tile_elems):
    """Backward for sequences of equal lengths (shapes as in :func:`_fwd_group`); adds this
    group's share of d sink to ``dsink`` (H,) when there are sinks."""
    B, Sq, H, D = q4.shape
    Sk, Hk, Dv = k4.shape[1], k4.shape[2], v4.shape[-1]
    acc = _acc_dtype(q4.dtype)
    if Sq > 0:
        doc = _heads_first(do4, acc)  # [B*H, Sq, Dv]
        delta = (doc * _heads_first(o4, acc)).sum(dim=-1)  # [B*H, Sq]
        lse_n = lse3.reshape(B * H, Sq).to(acc)
        if dlse3 is not None:  # d lse / d s_j = p_j: ds gains p * dlse, i.e. delta loses dlse
            delta -= torch.where(lse_n.isneginf(), 0.0, dlse3.reshape(B * H, Sq).to(acc))
        if sink is not None:  # d lse / d sink = exp(sink - lse), d out / d sink = -exp(sink - lse) out
            p_sink = (sink.to(acc).repeat(B).unsqueeze(-1) - lse_n).exp()  # [B*H, Sq]
            dsink -= (p_sink * delta).view(B, H, Sq).sum(dim=(0, 2)).to(dsink.dtype)
    if Sq == 0 or Sk == 0:
        dq4.zero_()
        dk4.zero_()
        dv4.zero_()
        return
    T = _Tiles(params, Sq, Sk, H, Hk, B * Hk, slopes, b0, acc, block_m, block_n, tile_elems)
    qc = _heads_first(q4, acc, T.qscale)  # [B*H, Sq, D]
    kc, vc = _heads_first(k4, acc), _heads_first(v4, acc)  # [B*Hk, Sk, D]
    lse_c = lse_n * LOG2E
    lse_c = lse_c.masked_fill(lse_c.isneginf(), float("inf"))  # rows with no key: p = 0
    dq_buf = torch.zeros(B * H, Sq, D, dtype=acc, device=_CPU)
    dk_buf = torch.zeros(B * Hk, Sk, D, dtype=acc, device=_CPU)
    dv_buf = torch.zeros(B * Hk, Sk, Dv, dtype=acc, device=_CPU)
    for t0 in range(0, B * Hk, T.chunk):
        t1 = min(t0 + T.chunk, B * Hk)
        for i0 in range(0, Sq, T.bm):
            i1 = min(i0 + T.bm, Sq)
            q_t = _gather_q(qc, t0, t1, T.G, i0, i1)  # [c, G*mr, D]
            do_t = _gather_q(doc, t0, t1, T.G, i0, i1)  # [c, G*mr, Dv]
            lse_t = _gather_q(lse_c.unsqueeze(-1), t0, t1, T.G, i0, i1).transpose(1, 2)  # [c, 1, G*mr]
            delta_t = _gather_q(delta.unsqueeze(-1), t0, t1, T.G, i0, i1).transpose(1, 2)  # [c, 1, G*mr]
            dq_t = torch.zeros_like(q_t)
            lo, hi = T.key_range(i0, i1, 0, Sk)
            for j0 in range(lo, hi, T.bn):
                j1 = min(j0 + T.bn, hi)
                k_t, v_t = kc[t0:t1, j0:j1], vc[t0:t1, j0:j1]  # [c, n, D]
                # tiles are transposed (keys first): p^T, dp^T, ds^T are [c, n, G*mr]
                s, th = T.scores(q_t, k_t, t0, i0, i1, j0, j1, keep_tanh=True, keys_first=True)
                p = s.sub_(lse_t).exp2_()  # normalised probabilities
                dp = torch.bmm(v_t, do_t.transpose(1, 2), out=T.buffer("dp", s.shape))
                kv_shape = (t1 - t0, j1 - j0, Dv)
                if params.dropout_p > 0:
                    z = T.keep(t0, t1 - t0, i0, i1, j0, j1).transpose(1, 2)
                    dv_t = torch.bmm(p * z, do_t, out=T.buffer("dkv", kv_shape))
                    dp.mul_(z)
                else:
                    dv_t = torch.bmm(p, do_t, out=T.buffer("dkv", kv_shape))
                # a batched matmul needs a contiguous output: the slices of dk/dv_buf are not
                dv_buf[t0:t1, j0:j1] += dv_t
                ds = dp.sub_(delta_t).mul_(p)
                if th is not None:
                    ds.mul_(th.square_().neg_().add_(1.0))
                dq_t.baddbmm_(ds.transpose(1, 2), k_t)
                dk_buf[t0:t1, j0:j1] += torch.bmm(ds, q_t, out=T.buffer("dkv", (t1 - t0, j1 - j0, D)))
            _scatter_q(dq_buf, dq_t, t0, t1, T.G, i0, i1)
    # q was multiplied by qscale: dk = scale ds^T q = (scale / qscale) ds^T (qscale q)
    dq4.copy_(dq_buf.mul_(params.softmax_scale).view(B, H, Sq, D).transpose(1, 2))
    dk4.copy_(dk_buf.mul_(params.softmax_scale / T.qscale).view(B, Hk, Sk, D).transpose(1, 2))
    dv4.copy_(dv_buf.view(B, Hk, Sk, Dv).transpose(1, 2))


@without_autocast
def attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, params: AttnParams, alibi_slopes=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             deterministic=False, dlse=None, learnable_sink=None, dsink=None,
             block_m=BLOCK_M, block_n=BLOCK_N, tile_elems=TILE_ELEMS) -> None:
    """Gradients of ``sum(out * dout) + sum(lse * dlse)`` into ``dq``, ``dk``, ``dv`` and, with
    ``learnable_sink``, ``dsink`` (layouts: ``tileattn.contract``).

    Always deterministic (one thread of tiles in a fixed order), so ``deterministic`` is
    accepted and changes nothing.
    """
    assert (learnable_sink is None) == (dsink is None), "learnable_sink and dsink come together"
    packed = cu_seqlens_q is not None
    assert packed == (cu_seqlens_k is not None), "inputs are validated by tileattn.ops"
    nbatch = q.shape[0] if not packed else len(cu_seqlens_q) - 1
    batch = _Batch(nbatch, cu_seqlens_q, cu_seqlens_k, None, None)
    if packed:  # tokens outside every sequence get a zero gradient
        dq.zero_()
        dk.zero_()
        dv.zero_()
    if dsink is not None:
        dsink.zero_()
    for bs in batch.groups():
        slopes = None if alibi_slopes is None else alibi_slopes[bs]
        _bwd_group(batch.rows(dout, bs), batch.rows(q, bs), batch.keys(k, bs), batch.keys(v, bs),
                   batch.rows(out, bs), batch.lse_rows(lse, bs), None if dlse is None else batch.lse_rows(dlse, bs),
                   batch.rows(dq, bs), batch.keys(dk, bs), batch.keys(dv, bs), dsink, slopes, learnable_sink,
                   bs.start, params, block_m, block_n, tile_elems)


@without_autocast
def merge_parts(o_parts, lse_parts, out, lse) -> None:
    """Merge partial states (S, B, Sq, H, Dv) / (S, B, H, Sq) over disjoint key sets into ``out``
    and ``lse`` (``tileattn.contract``), with ``tileattn.ops.merge.merge_many``."""
    o, l_ = merge_many(list(o_parts), list(lse_parts))
    out.copy_(o)
    lse.copy_(l_)
