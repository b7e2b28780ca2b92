"""Launcher of the device-side value check of a KV cache (``tileattn.kernels.checks``).

``cache_values_ok`` returns a one-element boolean tensor on the cache's device without reading
anything on the host. One launch replaces the ~4 (contiguous) to ~10 (paged) elementwise and
reduction kernels the same check costs written with torch operations. A small batch is one
program; a large paged one, a grid of programs over its rows, the flag set to true first
(``kernels/checks.py``). ``CacheCheck`` is the same check with its launch worked out once, for a
caller that checks tensors of one signature again and again (``tileattn.ops._validate``, and
the ops layer's memo entry of ``flash_attn_with_kvcache``); with ``asserting`` (CUDA tensors) the
kernel asserts on the device instead of writing a flag: one launch and no allocation per check.
"""

from __future__ import annotations

import torch

from ..kernels.checks import _cache_check_kernel
from ._launch import Launch, next_power_of_2

__all__ = ["cache_values_ok", "CacheCheck"]

_MAX_TILE = 4096  # block-table entries the program looks at per step
_MAX_ROWS = 1024  # sequences per step without a block table
_GRID_STEPS = 2  # a paged table needing more steps than this gets a program per step
_LAUNCHES: dict[tuple, Launch] = {}  # (kernel, device, dtypes, tiles) -> Launch; no integer is specialised


def cache_values_ok(seqlens: torch.Tensor, top: int, *, leftpad=None, block_table=None, new_tokens: int = 0,
                    block_size: int = 1, num_blocks: int = 0) -> torch.Tensor:
    """True (a one-element bool tensor on seqlens' device) when every length lies in 0..``top``,
    every ``leftpad`` in 0..its length and every ``block_table`` entry of a page in use after
    appending ``new_tokens`` in 0..``num_blocks - 1``. int32 vectors (batch,) and an int32
    (batch, pages) table, any strides, on one device."""
    return CacheCheck(seqlens, top, leftpad, block_table, new_tokens, block_size, num_blocks)(seqlens, leftpad,
                                                                                               block_table)


class CacheCheck:
    """``cache_values_ok`` with its launch worked out once: ``check(seqlens, leftpad, block_table)``
    for tensors with the shapes, strides, dtypes and device of those it was made with (the
    integers and tiles follow from them and from ``top`` ... ``num_blocks``). With ``asserting``
    a call returns None and a bad value fails a device assertion (compiled in by Triton's
    ``debug`` option; ``sanitize_overflow`` stays off, so the assertion is the check's own)."""

    __slots__ = ("launch", "grid", "ints", "paged", "one_program", "asserting")

    def __init__(self, seqlens, top: int, leftpad, block_table, new_tokens: int, block_size: int, num_blocks: int,
                 asserting: bool = False):
        batch = seqlens.shape[0]
        self.paged = paged = block_table is not None and block_table.numel() > 0
        if paged:
            pages = block_table.shape[1]
            block_p = min(next_power_of_2(pages), _MAX_TILE)
            block_b = min(next_power_of_2(batch), max(1, _MAX_TILE // block_p))
            strides = block_table.stride()
        else:
            pages, strides = 0, (0, 0)
            block_p, block_b = 1, min(next_power_of_2(batch), _MAX_ROWS)
        # one program steps through every row unless a paged table needs more than GRID_STEPS steps;
        # then one program per step of rows (kernels/checks.py)
        programs = -(-batch // block_b) if paged and -(-batch // block_b) > _GRID_STEPS else 1
        self.one_program, self.grid = programs == 1, (programs, 1, 1)
        self.ints = (batch, block_b if programs > 1 else batch, pages, seqlens.stride(0),
                     0 if leftpad is None else leftpad.stride(0), *strides, top, new_tokens, block_size, num_blocks)
        # the kernel specialises none of its integers (do_not_specialize), and Launch checks their
        # i32 range per call: the dtypes and constexprs alone pick the compiled kernel
        key = (_cache_check_kernel, seqlens.device, seqlens.dtype, leftpad is not None and leftpad.dtype,
               paged and block_table.dtype, block_b, block_p, programs == 1, asserting)
        launch = _LAUNCHES.get(key)
        if launch is None:
            options = dict(num_warps=4, debug=True, sanitize_overflow=False) if asserting else dict(num_warps=4)
            launch = _LAUNCHES[key] = Launch(_cache_check_kernel, dict(HAS_LEFTPAD=leftpad is not None, PAGED=paged,
                                                                       BLOCK_B=block_b, BLOCK_P=block_p,
                                                                       ONE_PROGRAM=programs == 1, ASSERT=asserting),
                                             options)
        self.launch, self.asserting = launch, asserting

    def __call__(self, seqlens, leftpad, block_table) -> torch.Tensor | None:
        if self.asserting:
            self.launch(self.grid, seqlens, leftpad, block_table if self.paged else None, None, *self.ints)
            return None
        if self.one_program:
            ok = torch.empty(1, dtype=torch.bool, device=seqlens.device)
        else:  # the programs only clear it
            ok = torch.ones(1, dtype=torch.bool, device=seqlens.device)
        self.launch(self.grid, seqlens, leftpad, block_table if self.paged else None, ok, *self.ints)
        return ok
