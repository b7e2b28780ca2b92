"""How a sequence (or a packed batch of documents) is cut across the W ranks of a ring.

Dense sequences of S tokens (the sequence on ``dim``, default 1 of (batch, seqlen, heads, dim)):

* contiguous: rank r holds tokens [r S/W, (r+1) S/W)  (``contiguous_shard``);
* zigzag: the sequence is cut into 2W chunks of S/(2W) tokens; rank r holds chunks r and
  2W-1-r, in that order (``zigzag_shard``). With a causal mask every rank then does the
  same work.

Packed batches (tokens on dim 0, documents delimited by ``cu_seqlens``, int32, batch + 1):

* llama3 (``llama3_flash_attn_varlen_func``): the packed tokens are cut contiguously, rank r
  holding packed rows [r T/W, (r+1) T/W) whatever the document borders
  (``contiguous_shard(x, rank, W, dim=0)``); ``llama3_flash_attn_prepare_cu_seqlens`` says
  which documents (or parts) each rank's queries and keys belong to.
* contiguous (``ring_flash_attn_varlen_func``): every document is cut in W equal chunks, rank r
  holding chunk r of each, documents in order (``contiguous_shard_varlen``; local ``cu_seqlens``
  = global // W);
* zigzag (``zigzag_ring_flash_attn_varlen_func``): every document is zigzag-cut on its own
  (its length divisible by 2W), and rank r holds, document after document, chunks r and 2W-1-r
  of each (``zigzag_shard_varlen``); its local ``cu_seqlens`` are the global ones divided by W.
"""

from __future__ import annotations

import torch

from ..ops._validate import fail

__all__ = [
    "zigzag_shard", "zigzag_unshard", "contiguous_shard", "contiguous_unshard",
    "contiguous_shard_varlen", "contiguous_unshard_varlen", "zigzag_shard_varlen", "zigzag_unshard_varlen",
    "llama3_flash_attn_prepare_cu_seqlens",
]


def _chunks(x: torch.Tensor, parts: int, dim: int) -> tuple[torch.Tensor, ...]:
    if x.shape[dim] % parts:
        fail(ValueError, f"sequence length {x.shape[dim]} (dim {dim}) must be divisible by {parts}")
    return x.chunk(parts, dim=dim)


def check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or not isinstance(rank, int) or world_size < 1 or not 0 <= rank < world_size:
        fail(ValueError, f"rank must be in [0, world_size), got rank {rank!r}, world_size {world_size!r}")


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard: chunks ``rank`` and ``2W-1-rank`` of 2W equal chunks of ``dim``."""
    check_rank(rank, world_size)
    chunks = _chunks(x, 2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the list of every rank's zigzag shard (rank order)."""
    world_size = len(shards)
    halves = [_chunks(s, 2, dim) for s in shards]
    ordered = [halves[r][0] for r in range(world_size)] + [halves[r][1] for r in reversed(range(world_size))]
    return torch.cat(ordered, dim=dim)


def contiguous_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s contiguous shard: chunk ``rank`` of W equal chunks of ``dim``."""
    check_rank(rank, world_size)
    return _chunks(x, world_size, dim)[rank]


def contiguous_unshard(shards, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the list of every rank's contiguous shard (rank order)."""
    return torch.cat(list(shards), dim=dim)


def _doc_bounds(cu_seqlens, world_size: int, chunks_per_rank: int = 2) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        fail(ValueError, "cu_seqlens must be a 1-D integer tensor of length batch + 1 (>= 2)")
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or min(lengths) < 0:
        fail(ValueError, f"cu_seqlens must start at 0 and never decrease, got {bounds}")
    parts = chunks_per_rank * world_size
    bad = [n for n in lengths if n % parts]
    if bad:
        fail(ValueError, f"a ring of {world_size} ranks cuts every document into {parts} equal chunks: document "
                         f"lengths must be divisible by {parts}, got {bad}")
    return bounds


def contiguous_shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world_size: int,
                            dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s part of a packed batch for ``ring_flash_attn_varlen_func``: chunk ``rank`` of
    W equal chunks of each document, documents in order; its ``cu_seqlens`` are the global // W."""
    check_rank(rank, world_size)
    bounds = _doc_bounds(cu_seqlens, world_size, 1)
    parts = [contiguous_shard(x.narrow(dim, a, b - a), rank, world_size, dim) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=dim)


def contiguous_unshard_varlen(shards, cu_seqlens: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The packed batch from every rank's ``contiguous_shard_varlen`` (rank order)."""
    world_size = len(shards)
    bounds = _doc_bounds(cu_seqlens, world_size, 1)
    docs = [torch.cat([s.narrow(dim, a // world_size, (b - a) // world_size) for s in shards], dim=dim)
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(docs, dim=dim)


def zigzag_shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world_size: int,
                        dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s part of a packed batch: each document zigzag-cut, documents in order.

    ``cu_seqlens`` are the global offsets; the shard's own are ``cu_seqlens // world_size``.
    """
    check_rank(rank, world_size)
    bounds = _doc_bounds(cu_seqlens, world_size)
    parts = [zigzag_shard(x.narrow(dim, a, b - a), rank, world_size, dim) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=dim)


def zigzag_unshard_varlen(shards, cu_seqlens: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The packed batch from every rank's ``zigzag_shard_varlen`` (rank order)."""
    world_size = len(shards)
    bounds = _doc_bounds(cu_seqlens, world_size)
    docs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lo, n = a // world_size, (b - a) // world_size
        docs.append(zigzag_unshard([s.narrow(dim, lo, n) for s in shards], dim))
    return torch.cat(docs, dim=dim)


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int):
    """What rank ``rank`` of a llama3 ring computes, for a packed batch cut contiguously.

    ``cu_seqlens`` (int32, batch + 1) are the offsets of the whole packed batch, whose
    ``T = cu_seqlens[-1]`` tokens are divisible by ``world_size``; rank r holds packed rows
    [r T/W, (r+1) T/W). Returns ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    local_k_slice)``: the documents that meet rank r's rows, in order — queries: their parts
    among r's rows; keys: from each document's start up to the end of r's rows (``causal``,
    nothing later is seen) or to the document's end — and ``local_k_slice``, the rows of the
    all-gathered keys (global packed rows) that these key ranges cover, ``cu_seqlens_k`` counting
    from its start. Documents of length zero are left out. Arguments and results as in
    ring-flash-attention.
    """
    check_rank(rank, world_size)
    if not isinstance(causal, bool):
        fail(TypeError, f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        fail(ValueError, "cu_seqlens must be a 1-D integer tensor of length batch + 1 (>= 2)")
    bounds = cu_seqlens.tolist()
    total = bounds[-1]
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        fail(ValueError, f"cu_seqlens must start at 0 and never decrease, got {bounds}")
    if total % world_size:
        fail(ValueError, f"the packed tokens ({total}) must be divisible by world_size ({world_size})")
    per_rank = total // world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    docs = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a and a < hi and b > lo]
    k_start = docs[0][0] if docs else lo
    cu_q, cu_k = [0], [0]
    for a, b in docs:
        cu_q.append(min(b, hi) - lo)
        cu_k.append((min(b, hi) if causal else b) - k_start)
    device = cu_seqlens.device
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=device)
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=device)
    max_q = max((b - a for a, b in zip(cu_q[:-1], cu_q[1:])), default=0)
    max_k = max((b - a for a, b in zip(cu_k[:-1], cu_k[1:])), default=0)
    return cu_q_t, cu_k_t, max_q, max_k, slice(k_start, k_start + cu_k[-1])
