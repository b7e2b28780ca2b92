"""Which attention calls a rank makes with the keys/values of another rank: the ring's plan.

Rank r's local queries and the keys/values of rank ``src`` are each made of *segments*:
ranges of consecutive positions of one sequence (a contiguous shard is one segment, a zigzag
shard two, chunk r then chunk 2W-1-r). The backend's masks are bottom-right aligned: in a
call with seqlen_q rows and seqlen_k keys, row i and key j are ``i + seqlen_k - seqlen_q - j``
apart. A pair of segments whose global positions start at ``q0`` and ``k0`` is really
``i + q0 - k0 - j`` apart, so the window that the ring passes to the backend is the user's
window moved by ``shift = (q0 - k0) - (seqlen_k - seqlen_q)`` = (end of the queries) - (end
of the keys), in global positions::

    key j visible  <=>  q0 + i - window_left  <=  k0 + j  <=  q0 + i + window_right
                   <=>  i + off - (window_left - shift) <= j <= i + off + (window_right + shift)

``window_pair`` first trims both ranges to what the window lets them see (keys no query of the
pair reaches, queries that reach no key), which skips blocks wholly outside the window — no
call, no transfer — and keeps both moved bounds >= 0; a pair whose every (query, key) is
visible is passed with no window at all (no mask work). With ALiBi the distance itself enters
the scores, and with dropout the positions enter the mask's hash: such a call keeps the user's
window and moves its diagonal by ``shift`` instead (``AttnParams.diag_shift``), which masks the
same keys and gives ALiBi the global distance, and names its first row and key's positions for
the dropout hash (``AttnParams.dropout_base``); every pair of segments is then its own call.

Without a window (full attention, or causal: only the order of positions matters) a rank's
local order is the global order, so the pairs of one (rank, src) merge into ONE call
(``fast_blocks``): fewer, larger blocks. With W = 2 and zigzag (chunks c0..c3; rank 0 holds
c0, c3; rank 1 holds c1, c2), the causal mask::

                      keys: c0  c1  c2  c3
        rank 0, q c0      [ ◣   .   .   .  ]     ◣  causal (diagonal)
        rank 1, q c1      [ ■   ◣   .   .  ]     ■  full
        rank 1, q c2      [ ■   ■   ◣   .  ]     .  skipped
        rank 0, q c3      [ ■   ■   ■   ◣  ]

so on rank r, with local rows/keys [0, c) = chunk r or src and [c, 2c) = chunk 2W-1-r or 2W-1-src:
src == r: all x all, causal; src < r: all queries x first half of the keys, full (chunk src is
seen by both query chunks, chunk 2W-1-src by neither); src > r: second half of the queries x all
keys, full. Each off-diagonal block costs 2c^2 score entries: every rank does (2W-1) c^2 work.
Contiguous: src == r causal, src < r full, src > r skipped (and never sent).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..contract import AttnParams

__all__ = ["Segment", "Pair", "window_pair", "segments", "fast_blocks", "is_fast", "dense_pairs"]


@dataclass(frozen=True)
class Segment:
    """Positions [start, start + length) of a sequence, held at local rows [local, local + length)."""

    local: int
    start: int
    length: int


@dataclass(frozen=True)
class Pair:
    """Local query rows ``q`` attend held key rows ``kv`` with ``params`` (window moved)."""

    q: slice
    kv: slice
    params: AttnParams


def window_pair(qs: Segment, ks: Segment, params: AttnParams, exact: bool = False) -> Pair | None:
    """The call for query segment ``qs`` against key segment ``ks`` (None: nothing is visible).

    ``exact`` (ALiBi, whose bias needs the distance itself, or dropout, whose mask hashes the
    positions): the call keeps the user's window and moves its diagonal instead
    (``AttnParams.diag_shift``), which masks the same keys, and names where its rows and keys
    sit in the sequence (``AttnParams.dropout_base``)."""
    wl, wr = params.window_left, params.window_right
    q_lo, q_hi = qs.start, qs.start + qs.length
    k_lo, k_hi = ks.start, ks.start + ks.length
    if wr >= 0:
        k_hi = min(k_hi, q_hi + wr)  # the last query sees up to q_hi - 1 + wr
    if wl >= 0:
        k_lo = max(k_lo, q_lo - wl)
    if k_lo >= k_hi:
        return None
    if wr >= 0:
        q_lo = max(q_lo, k_lo - wr)  # queries before this see no key of [k_lo, k_hi)
    if wl >= 0:
        q_hi = min(q_hi, k_hi + wl)
    if q_lo >= q_hi:
        return None
    every = (wr < 0 or k_hi - 1 <= q_lo + wr) and (wl < 0 or k_lo >= q_hi - 1 - wl)
    shift = q_hi - k_hi
    if exact:
        moved = replace(params, diag_shift=shift, dropout_base=(*params.dropout_base[:2], q_lo, k_lo))
        if every:
            moved = replace(moved, window_left=-1, window_right=-1)
    elif every:
        moved = replace(params, window_left=-1, window_right=-1)
    else:
        moved = replace(params, window_left=wl - shift if wl >= 0 else -1,
                        window_right=wr + shift if wr >= 0 else -1)
    q = slice(qs.local + q_lo - qs.start, qs.local + q_hi - qs.start)
    kv = slice(ks.local + k_lo - ks.start, ks.local + k_hi - ks.start)
    return Pair(q, kv, moved)


def segments(rank: int, world_size: int, length: int, zigzag: bool) -> list[Segment]:
    """The segments of rank ``rank``'s shard of a sequence of ``length`` local tokens."""
    if not zigzag:
        return [Segment(0, rank * length, length)]
    c = length // 2
    return [Segment(0, rank * c, c), Segment(c, (2 * world_size - 1 - rank) * c, c)]


def is_fast(params: AttnParams) -> bool:
    """No window beyond causality: pairs of one (rank, src) merge into one call by local order."""
    return params.window_left < 0 and params.window_right in (-1, 0)


def fast_blocks(rank: int, src: int, params: AttnParams, zigzag: bool) -> list[tuple[str, str, bool]]:
    """For ``is_fast`` params: [(query part, key part, causal)] with parts 'all', 'first', 'second'
    (halves of a zigzag shard); empty when rank's queries see nothing of src."""
    if params.window_right < 0:
        return [("all", "all", False)]
    if src == rank:
        return [("all", "all", True)]
    if not zigzag:
        return [("all", "all", False)] if src < rank else []
    return [("all", "first", False)] if src < rank else [("second", "all", False)]


def dense_pairs(rank: int, src: int, world_size: int, length: int, params: AttnParams, zigzag: bool,
                exact: bool = False) -> list[Pair]:
    """Every call of rank ``rank`` against ``src``'s shard of a sequence (``length`` local tokens);
    ``exact`` (ALiBi, dropout): one per pair of segments, each at its own global place."""
    if is_fast(params) and not exact:
        half = length // 2
        rows = {"all": slice(0, length), "first": slice(0, half), "second": slice(half, length)}
        full = replace(params, window_left=-1, window_right=-1)
        causal = replace(params, window_left=-1, window_right=0)
        return [Pair(rows[q], rows[k], causal if c else full) for q, k, c in fast_blocks(rank, src, params, zigzag)]
    pairs = []
    for qs in segments(rank, world_size, length, zigzag):
        for ks in segments(src, world_size, length, zigzag):
            pair = window_pair(qs, ks, params, exact)
            if pair is not None:
                pairs.append(pair)
    return pairs
