"""``PagedKVCache``: a block pool for users without an allocator of their own.

Every layer has a key pool and a value pool of shape (num_blocks, block_size, nheads_k,
headdim); all layers share one allocation per sequence, so a sequence's block list (its row
of the block table) is the same for every layer. Book-keeping (free list, block lists,
lengths) lives on the host; the tensors the kernels take — ``block_table`` (batch,
max_blocks) int32 and ``cache_seqlens`` (batch,) int32 — are produced on the pool's device,
optionally into caller-owned buffers (``out=``) so a CUDA graph can replay them, copied from
pinned host memory without a synchronisation.

The cache vouches for the tensors it produces (``tileattn.ops._validate.vouch``): as long as
they are not modified, ``flash_attn_with_kvcache`` checks their values against what the
host knows (the longest sequence, the least room, the largest block id) instead of reading
them on the device. Every method checks its arguments first (known, distinct sequence ids;
token counts that are ints >= 0) and leaves the cache as it was when one is wrong.

A decoding step with it::

    ids = [seq_a, seq_b]
    cache.reserve(ids, 1)                       # room for one more token each
    table, lens = cache.block_table(ids), cache.seqlens(ids)
    for layer in range(num_layers):
        o = flash_attn_with_kvcache(q, cache.k_cache[layer], cache.v_cache[layer], k=k_new, v=v_new,
                                    cache_seqlens=lens, block_table=table, causal=True)
    cache.advance(ids, 1)                       # the token is now part of each sequence
"""

from __future__ import annotations

import itertools

import torch

from ._validate import check_packed_tokens, vouch
from .fp8 import FP8_DTYPE, quantize

__all__ = ["PagedKVCache"]

_CACHES = itertools.count()


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, nheads_k: int, headdim: int, *,
                 dtype=torch.float16, device="cpu"):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("nheads_k", nheads_k), ("headdim", headdim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {value!r}")
        shape = (num_blocks, block_size, nheads_k, headdim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low block ids first
        self._blocks: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0
        self._epoch = 0  # counts changes of lengths and block lists: vouched-for tensors name the state
        self._uid = next(_CACHES)  # unlike id(), never reused by a later cache

    @property
    def device(self) -> torch.device:
        return self.k_cache[0].device

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A new, empty sequence; returns its id."""
        seq_id = self._next_id
        self._next_id += 1
        self._blocks[seq_id] = []
        self._lengths[seq_id] = 0
        return seq_id

    def free(self, seq_id: int) -> None:
        """Return the sequence's blocks to the pool."""
        self._check(seq_id)
        self._epoch += 1
        self._free.extend(reversed(self._blocks.pop(seq_id)))
        del self._lengths[seq_id]

    def length(self, seq_id: int) -> int:
        self._check(seq_id)
        return self._lengths[seq_id]

    def reserve(self, seq_ids, n: int) -> None:
        """Make room for ``n`` more tokens in each sequence, allocating blocks as needed.

        Raises MemoryError (and allocates nothing) when the pool has too few free blocks.
        """
        ids = self._ids(seq_ids)
        n = self._count(n)
        needs = {}
        for seq_id in ids:
            want = -(-(self._lengths[seq_id] + n) // self.block_size)
            needs[seq_id] = max(0, want - len(self._blocks[seq_id]))
        if sum(needs.values()) > len(self._free):
            raise MemoryError(f"PagedKVCache: {sum(needs.values())} blocks needed, {len(self._free)} free")
        self._epoch += 1
        for seq_id, count in needs.items():
            self._blocks[seq_id].extend(self._free.pop() for _ in range(count))

    def advance(self, seq_ids, n: int) -> None:
        """Record that ``n`` tokens were written after each sequence's current length."""
        ids = self._ids(seq_ids)
        n = self._count(n)
        for seq_id in ids:
            if self._lengths[seq_id] + n > len(self._blocks[seq_id]) * self.block_size:
                raise ValueError(f"PagedKVCache: sequence {seq_id} has no room for {n} more tokens; reserve first")
        self._epoch += 1
        for seq_id in ids:
            self._lengths[seq_id] += n

    def block_table(self, seq_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """int32 (len(seq_ids), max_blocks): each row the sequence's blocks, padded with 0."""
        ids = self._ids(seq_ids)
        rows = [self._blocks[s] for s in ids]
        width = max((len(r) for r in rows), default=0) if out is None else out.shape[1]
        table = torch.zeros((len(rows), max(width, 1)), dtype=torch.int32, device="cpu")
        for i, row in enumerate(rows):
            if len(row) > table.shape[1]:
                raise ValueError(f"block_table buffer has {table.shape[1]} columns, sequence needs {len(row)}")
            table[i, :len(row)] = torch.tensor(row, dtype=torch.int32, device="cpu")
        top = max((max(r) for r in rows if r), default=0)
        return vouch(self._into(table, out), (self._state(ids), top))

    def seqlens(self, seq_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """int32 (len(seq_ids),): the number of tokens each sequence holds."""
        ids = self._ids(seq_ids)
        lengths = [self._lengths[s] for s in ids]
        room = min((len(self._blocks[s]) * self.block_size - self._lengths[s] for s in ids), default=0)
        host = torch.tensor(lengths, dtype=torch.int32, device="cpu")
        return vouch(self._into(host, out), (self._state(ids), max(lengths, default=0), room))

    def write_packed(self, layer: int, seq_ids, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
                     k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None) -> None:
        """Scatter packed tokens k, v (total, nheads_k, headdim) after each sequence's length.

        Sequence ``seq_ids[b]`` receives rows cu_seqlens[b]:cu_seqlens[b+1] (a list or a CPU
        tensor of integers from 0 to k.shape[0]; a CUDA tensor costs a device-to-host copy); k and v
        come in the pool's dtype (any floating dtype for an FP8 pool) and shape per token. Call ``reserve`` before and
        ``advance`` after writing all layers. A float8_e4m3fn pool needs ``k_descale`` and
        ``v_descale`` (len(seq_ids), nheads_k) fp32: row b quantises sequence b's tokens
        (``tileattn.ops.fp8.quantize``) and is what attention over them must be given.
        """
        ids = self._ids(seq_ids)
        offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if len(offsets) != len(ids) + 1:
            raise ValueError(f"write_packed: cu_seqlens must have len(seq_ids) + 1 = {len(ids) + 1} entries, got "
                             f"{len(offsets)}")
        check_packed_tokens(layer, self.k_cache, self.v_cache, k, v, offsets)
        fp8 = self.k_cache[layer].dtype == FP8_DTYPE
        want = (len(ids), self.k_cache[layer].shape[2])
        for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
            if (d is not None) != fp8:
                raise ValueError(f"write_packed: a {FP8_DTYPE} pool needs k_descale and v_descale, another pool "
                                 f"neither ({name} was {'not ' if d is None else ''}given)")
            if d is not None and (d.dtype != torch.float32 or tuple(d.shape) != want or d.device != self.device):
                raise ValueError(f"write_packed: {name} must be float32 of shape {want} on {self.device}, got "
                                 f"{d.dtype} {tuple(d.shape)} on {d.device}")
        blocks, slots = [], []
        for seq_id, start, end in zip(ids, offsets[:-1], offsets[1:]):
            if end < start:
                raise ValueError(f"write_packed: cu_seqlens must be non-decreasing, got {offsets}")
            length, table = self._lengths[seq_id], self._blocks[seq_id]
            if length + end - start > len(table) * self.block_size:
                raise ValueError(f"PagedKVCache: sequence {seq_id} has no room for {end - start} tokens; reserve first")
            for pos in range(length, length + end - start):
                blocks.append(table[pos // self.block_size])
                slots.append(pos % self.block_size)
        blk = self._into(torch.tensor(blocks, dtype=torch.long, device="cpu"), None)
        slot = self._into(torch.tensor(slots, dtype=torch.long, device="cpu"), None)
        if fp8:  # each token quantised with its sequence's descales
            lengths = torch.tensor(offsets[1:], device="cpu") - torch.tensor(offsets[:-1], device="cpu")
            owner = torch.repeat_interleave(torch.arange(len(ids), device="cpu"), lengths)  # token -> b
            owner = self._into(owner, None)
            k, v = (quantize(x[:, None], d[owner])[:, 0] for x, d in ((k, k_descale), (v, v_descale)))
        self.k_cache[layer][blk, slot] = k
        self.v_cache[layer][blk, slot] = v

    def _into(self, host: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``host`` on the pool's device, or copied into ``out``; from pinned memory without a
        synchronisation when the device is a GPU."""
        if out is not None and out.shape != host.shape:
            raise ValueError(f"out buffer has shape {tuple(out.shape)}, expected {tuple(host.shape)}")
        if self.device.type == "cuda":
            host = host.pin_memory()
        if out is None:
            return host.to(self.device, non_blocking=True)
        out.copy_(host, non_blocking=True)
        return out

    def _state(self, ids: list[int]) -> tuple:
        """What a vouched-for tensor's values depend on: this cache, its state, the sequences, the block size."""
        return (self._uid, self._epoch, tuple(ids), self.block_size)

    def _ids(self, seq_ids) -> list[int]:
        ids = list(seq_ids)
        for seq_id in ids:
            self._check(seq_id)
        if len(set(ids)) != len(ids):
            raise ValueError(f"PagedKVCache: a sequence is named twice in {ids}")
        return ids

    @staticmethod
    def _count(n) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"PagedKVCache: the number of tokens must be an int >= 0, got {n!r}")
        return n

    def _check(self, seq_id: int) -> int:
        if seq_id not in self._blocks:
            raise KeyError(f"PagedKVCache: no sequence with id {seq_id}")
        return seq_id
