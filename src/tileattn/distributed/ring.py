"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Every rank holds one shard of the sequence — its queries and its keys/values, layout
(batch, seqlen_local, nheads, headdim). The key/value shards travel around the ring
(rank r sends to r + 1 and receives from r - 1, ``torch.distributed`` point-to-point ops),
the transfer of the next shard overlapping the attention of the current one. After step s
rank r holds the keys/values of rank ``src = (r - s) mod W``; its queries attend to them with
the backend contract of ``tileattn.contract`` and the partial state of that block is merged
into the running one with the library's single merge (``tileattn.ops.merge.merge_states``)::

    lse = log(exp(lse_run) + exp(lse_blk)),   o = exp(lse_run - lse) o_run + exp(lse_blk - lse) o_blk

so after W steps every rank holds ``softmax(q K^T * scale) V`` over the whole sequence for its
own queries, and the LSE (natural log, fp32, (batch, nheads, seqlen_local)).

Backward (the FlashAttention trick, per block): with the FINAL output O and LSE, the
probabilities of a block are ``P = exp(S - lse)`` and ``delta = rowsum(dO * O)`` is the same for
every block, so each block's (dq, dk, dv) is exactly its share of the gradient. The keys/values
travel the ring once more; dq accumulates locally (fp32); dk/dv accumulate in fp32 in a buffer
that travels WITH the keys/values it belongs to, and one last hop returns it to its owner.

Layouts (the sequence of S tokens, W ranks):

* ``"contiguous"``: rank r holds tokens [r S/W, (r+1) S/W).
* ``"zigzag"``: the sequence is cut into 2W chunks of c = S / (2W) tokens; rank r holds chunks
  r and 2W-1-r (in that order). With ``causal=True`` every rank then does the same work.

Causal masks per block (global query i sees key j iff j <= i). Contiguous: src == r is the
diagonal block (causal, seqlen_q == seqlen_k); src < r is full attention; src > r is skipped.
Zigzag, W = 2 (chunks c0..c3; rank 0 holds c0, c3; rank 1 holds c1, c2), the global mask::

                      keys: c0  c1  c2  c3
        rank 0, q c0      [ ◣   .   .   .  ]     ◣  causal (diagonal)
        rank 1, q c1      [ ■   ◣   .   .  ]     ■  full
        rank 1, q c2      [ ■   ■   ◣   .  ]     .  skipped
        rank 0, q c3      [ ■   ■   ■   ◣  ]

and the three kinds of block on rank r, local rows/keys [0, c) = chunk r or src, [c, 2c) =
chunk 2W-1-r or 2W-1-src::

    src == r:  q (2c) x kv (2c), causal         kv: r  2W-1-r      the local causal mask is
                                            q r     [ ◣    .  ]    the global one
                                            q 2W-1-r[ ■    ◣  ]
    src <  r:  q (2c) x kv[:c], full            kv: src  2W-1-src  chunk src < r < 2W-1-r is seen
                                            q r     [ ■    .  ]    by both query chunks;
                                            q 2W-1-r[ ■    .  ]    chunk 2W-1-src > 2W-1-r by none
    src >  r:  q[c:] x kv (2c), full            kv: src  2W-1-src  query chunk r < src sees nothing;
                                            q r     [ .    .  ]    chunk 2W-1-r > 2W-1-src > src
                                            q 2W-1-r[ ■    ■  ]    sees all of it

Both off-diagonal kinds cost 2c^2 score entries, so each rank does (2W-1) c^2 work in all.
Without ``causal`` every block is full attention, whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops._validate import check_flags, check_qkv, last_dim_contiguous, make_params
from ..contract import AttnParams
from ..ops.backend import backend_for
from ..ops.merge import merge_states

__all__ = [
    "ring_flash_attn_func",
    "zigzag_shard",
    "zigzag_unshard",
    "contiguous_shard",
    "contiguous_unshard",
    "LAYOUTS",
]

LAYOUTS = ("zigzag", "contiguous")
_TAG_KV, _TAG_DKV = 0, 1  # distinct tags keep the two messages to a neighbour apart (gloo)


# ----------------------------------------------------------------------------- sharding


def _chunks(x: torch.Tensor, parts: int, dim: int) -> tuple[torch.Tensor, ...]:
    if x.shape[dim] % parts:
        raise ValueError(f"sequence length {x.shape[dim]} (dim {dim}) must be divisible by {parts}")
    return x.chunk(parts, dim=dim)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard: chunks ``rank`` and ``2W-1-rank`` of 2W equal chunks of ``dim``."""
    _check_rank(rank, world_size)
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
    _check_rank(rank, world_size)
    return _chunks(x, world_size, dim)[rank]


def contiguous_unshard(shards, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the list of every rank's contiguous shard (rank order)."""
    return torch.cat(list(shards), dim=dim)


# ----------------------------------------------------------------------------- the ring


class _Transfer:
    """A send to the next rank and a receive from the previous one, in flight."""

    def __init__(self, sent: torch.Tensor, received: torch.Tensor, works):
        self._sent, self._received, self._works = sent, received, works

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._sent = None  # the send buffer may be freed now
        return self._received


class _Ring:
    """The neighbours of this rank in ``group``: sends go to rank + 1, receives come from rank - 1."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self._next = to_global((self.rank + 1) % self.world_size)
        self._prev = to_global((self.rank - 1) % self.world_size)

    def shift(self, tensor: torch.Tensor, tag: int) -> _Transfer:
        """Start sending ``tensor`` onward and receiving its predecessor's tensor of the same shape."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self._next, self.group, tag),
               dist.P2POp(dist.irecv, received, self._prev, self.group, tag)]
        return _Transfer(tensor, received, dist.batch_isend_irecv(ops))


@dataclass(frozen=True)
class _Block:
    """The part of a (local queries, held keys/values) pair that is attended, and its mask."""

    q: slice
    kv: slice
    causal: bool


def _block(rank: int, src: int, seqlen: int, causal: bool, layout: str) -> _Block | None:
    """Which rows of local q attend which rows of the keys/values of rank ``src`` (None: none)."""
    every, half = slice(0, seqlen), seqlen // 2
    if not causal:
        return _Block(every, every, False)
    if src == rank:
        return _Block(every, every, True)
    if layout == "contiguous":
        return _Block(every, every, False) if src < rank else None
    if src < rank:
        return _Block(every, slice(0, half), False)
    return _Block(slice(half, seqlen), every, False)


def _params(scale: float, causal: bool) -> AttnParams:
    return AttnParams(softmax_scale=scale, window_right=0 if causal else -1)


# ----------------------------------------------------------------------------- forward, backward


def _ring_fwd(q, k, v, *, scale: float, causal: bool, layout: str, ring):
    """Run the ring forward; returns (out in q's dtype, lse fp32 (B, H, S))."""
    backend = backend_for(q.device)
    batch, seqlen, nheads, headdim = q.shape
    out = torch.zeros(batch, seqlen, nheads, headdim, device=q.device, dtype=torch.float32)
    lse = torch.full((batch, nheads, seqlen), float("-inf"), device=q.device, dtype=torch.float32)
    kv = torch.stack([k, v])  # [2, B, S, Hk, D]: one message per step
    for step in range(ring.world_size):
        incoming = ring.shift(kv, _TAG_KV) if step + 1 < ring.world_size else None
        blk = _block(ring.rank, (ring.rank - step) % ring.world_size, seqlen, causal, layout)
        if blk is not None:
            q_blk = q[:, blk.q]
            o_blk = torch.empty_like(q_blk)
            lse_blk = torch.empty(batch, nheads, q_blk.shape[1], device=q.device, dtype=torch.float32)
            backend.attn_fwd(q_blk, kv[0, :, blk.kv], kv[1, :, blk.kv], o_blk, lse_blk,
                             params=_params(scale, blk.causal))
            out[:, blk.q], lse[:, :, blk.q] = merge_states(out[:, blk.q], lse[:, :, blk.q], o_blk, lse_blk)
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_bwd(dout, q, k, v, out, lse, *, scale: float, causal: bool, layout: str, deterministic: bool, ring):
    """Gradients (dq, dk, dv) of sum(out * dout), with the final ``out`` and ``lse`` of the forward."""
    backend = backend_for(q.device)
    seqlen = q.shape[1]
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    kv = torch.stack([k, v])  # [2, B, S, Hk, D]
    dkv = torch.zeros(kv.shape, device=q.device, dtype=torch.float32)  # grads of the held kv
    dkv_incoming = None
    for step in range(ring.world_size):
        incoming = ring.shift(kv, _TAG_KV) if step + 1 < ring.world_size else None
        blk = _block(ring.rank, (ring.rank - step) % ring.world_size, seqlen, causal, layout)
        if blk is not None:
            dq_blk = torch.empty_like(q[:, blk.q])
            dk_blk = torch.empty_like(kv[0, :, blk.kv])
            dv_blk = torch.empty_like(dk_blk)
            backend.attn_bwd(dout[:, blk.q], q[:, blk.q], kv[0, :, blk.kv], kv[1, :, blk.kv], out[:, blk.q],
                             lse[:, :, blk.q], dq_blk, dk_blk, dv_blk, params=_params(scale, blk.causal),
                             deterministic=deterministic)
            dq[:, blk.q] += dq_blk
        if dkv_incoming is not None:
            dkv = dkv_incoming.wait()  # the gradient so far of the kv we hold, from the previous rank
        if blk is not None:
            dkv[0, :, blk.kv] += dk_blk
            dkv[1, :, blk.kv] += dv_blk
        if ring.world_size > 1:  # pass it on; after the last step it arrives at its owner
            dkv_incoming = ring.shift(dkv, _TAG_DKV)
        if incoming is not None:
            kv = incoming.wait()
    if dkv_incoming is not None:
        dkv = dkv_incoming.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingFlashAttnFunc(torch.autograd.Function):
    """Autograd wiring: forward and backward both run around the ring of ``group``."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, deterministic, group):
        ring = _Ring(group)
        out, lse = _ring_fwd(q, k, v, scale=scale, causal=causal, layout=layout, ring=ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(scale=scale, causal=causal, layout=layout, deterministic=deterministic)
        ctx.group = group
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = last_dim_contiguous(dout)
        dq, dk, dv = _ring_bwd(dout, q, k, v, out, lse, ring=_Ring(ctx.group), **ctx.options)
        return dq, dk, dv, None, None, None, None, None


def ring_flash_attn_func(q, k, v, causal=False, softmax_scale=None, group=None, return_lse=False,
                         layout="zigzag", deterministic=False):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world).

    q (batch, seqlen_local, nheads, headdim), k and v (batch, seqlen_local, nheads_k, headdim)
    hold this rank's shard of the sequence, cut as ``layout`` says (``zigzag_shard`` or
    ``contiguous_shard``; see the module docstring). Returns this rank's rows of
    ``softmax(q K^T * softmax_scale) V`` over all ranks' keys (causal: global query i sees
    global key j <= i), and with ``return_lse`` also the LSE (batch, nheads, seqlen_local) fp32.
    Differentiable in q, k, v; every rank of ``group`` must call it with the same shapes and
    options. nheads % nheads_k == 0 (GQA/MQA). Runs on gloo (CPU tensors) and NCCL (CUDA).
    """
    check_qkv(q, k, v, packed=False)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if k.shape[:2] != q.shape[:2]:
        raise ValueError(f"q and k/v shards must have the same (batch, seqlen_local), got "
                         f"{tuple(q.shape[:2])} and {tuple(k.shape[:2])}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: seqlen_local must be even, got {q.shape[1]}")
    params = make_params(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=(-1, -1),
                         softcap=0.0, dropout_p=0.0)
    check_flags(deterministic=deterministic, return_lse=return_lse)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_flash_attn_func needs torch.distributed: call "
                           "torch.distributed.init_process_group first (a world of one rank works)")
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    out, lse = RingFlashAttnFunc.apply(q, k, v, params.softmax_scale, causal, layout, deterministic, group)
    return (out, lse) if return_lse else out
