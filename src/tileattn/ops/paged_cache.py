"""``PagedKVCache``: a block pool for users without an allocator of their own.

Every layer has a key pool and a value pool of shape (num_blocks, block_size, nheads_k,
headdim); all layers share one allocation per sequence, so a sequence's block list (its row
of the block table) is the same for every layer. Book-keeping (free list, block lists,
lengths) lives on the host; the tensors the kernels take — ``block_table`` (batch,
max_blocks) int32 and ``cache_seqlens`` (batch,) int32 — are produced on the pool's device,
optionally into caller-owned buffers (``out=``) so a CUDA graph can replay them.

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

import torch

__all__ = ["PagedKVCache"]


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
        self._free.extend(reversed(self._blocks.pop(seq_id)))
        del self._lengths[seq_id]

    def length(self, seq_id: int) -> int:
        self._check(seq_id)
        return self._lengths[seq_id]

    def reserve(self, seq_ids, n: int) -> None:
        """Make room for ``n`` more tokens in each sequence, allocating blocks as needed.

        Raises MemoryError (and allocates nothing) when the pool has too few free blocks.
        """
        needs = {}
        for seq_id in seq_ids:
            self._check(seq_id)
            want = -(-(self._lengths[seq_id] + n) // self.block_size)
            needs[seq_id] = max(0, want - len(self._blocks[seq_id]))
        if sum(needs.values()) > len(self._free):
            raise MemoryError(f"PagedKVCache: {sum(needs.values())} blocks needed, {len(self._free)} free")
        for seq_id, count in needs.items():
            self._blocks[seq_id].extend(self._free.pop() for _ in range(count))

    def advance(self, seq_ids, n: int) -> None:
        """Record that ``n`` tokens were written after each sequence's current length."""
        for seq_id in seq_ids:
            self._check(seq_id)
            if self._lengths[seq_id] + n > len(self._blocks[seq_id]) * self.block_size:
                raise ValueError(f"PagedKVCache: sequence {seq_id} has no room for {n} more tokens; reserve first")
        for seq_id in seq_ids:
            self._lengths[seq_id] += n

    def block_table(self, seq_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """int32 (len(seq_ids), max_blocks): each row the sequence's blocks, padded with 0."""
        rows = [self._blocks[self._check(s)] for s in seq_ids]
        width = max((len(r) for r in rows), default=0) if out is None else out.shape[1]
        table = torch.zeros((len(rows), max(width, 1)), dtype=torch.int32)
        for i, row in enumerate(rows):
            if len(row) > table.shape[1]:
                raise ValueError(f"block_table buffer has {table.shape[1]} columns, sequence needs {len(row)}")
            table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        return self._into(table, out)

    def seqlens(self, seq_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """int32 (len(seq_ids),): the number of tokens each sequence holds."""
        lengths = torch.tensor([self._lengths[self._check(s)] for s in seq_ids], dtype=torch.int32)
        return self._into(lengths, out)

    def write_packed(self, layer: int, seq_ids, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """Scatter packed tokens k, v (total, nheads_k, headdim) after each sequence's length.

        Sequence ``seq_ids[b]`` receives rows cu_seqlens[b]:cu_seqlens[b+1]. Call ``reserve``
        before and ``advance`` after writing all layers.
        """
        offsets = cu_seqlens.tolist()
        if len(offsets) != len(seq_ids) + 1 or offsets[-1] != k.shape[0] or k.shape != v.shape:
            raise ValueError("write_packed: cu_seqlens must have len(seq_ids) + 1 entries ending at k.shape[0], "
                             "and k, v one shape")
        blocks, slots = [], []
        for seq_id, start, end in zip(seq_ids, offsets[:-1], offsets[1:]):
            self._check(seq_id)
            pos = torch.arange(self._lengths[seq_id], self._lengths[seq_id] + end - start)
            table = self._blocks[seq_id]
            if end - start and int(pos[-1]) // self.block_size >= len(table):
                raise ValueError(f"PagedKVCache: sequence {seq_id} has no room for {end - start} tokens; reserve first")
            blocks.append(torch.tensor(table, dtype=torch.long)[pos // self.block_size] if len(pos) else pos)
            slots.append(pos % self.block_size)
        blk = torch.cat(blocks).to(self.device)
        slot = torch.cat(slots).to(self.device)
        self.k_cache[layer][blk, slot] = k
        self.v_cache[layer][blk, slot] = v

    def _into(self, host: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return host.to(self.device)
        if out.shape != host.shape:
            raise ValueError(f"out buffer has shape {tuple(out.shape)}, expected {tuple(host.shape)}")
        out.copy_(host, non_blocking=True)
        return out

    def _check(self, seq_id: int) -> int:
        if seq_id not in self._blocks:
            raise KeyError(f"PagedKVCache: no sequence with id {seq_id}")
        return seq_id
