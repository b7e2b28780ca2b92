"""The device-side check of a KV cache's values (``kernels/checks.py``, ``gpu/checks.py``) against
the rule written in NumPy, on random lengths, left pads and block tables: in the interpreter on a
CPU, compiled on a GPU. Small tile limits make the one program take several row and page steps on
small inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tileattn.gpu import checks

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(lens, top, pads, table, new_tokens, block_size, num_blocks) -> bool:
    good = all(0 <= n <= top for n in lens)
    if pads is not None:
        good &= all(0 <= p <= n for p, n in zip(pads, lens))
    if table is not None:
        for row, n in zip(table, lens):
            used = [p for p in range(len(row)) if p * block_size < n + new_tokens]
            good &= all(0 <= row[p] < num_blocks for p in used)
    return good


@st.composite
def _cases(draw):
    batch = draw(st.integers(1, 40))
    capacity = draw(st.integers(0, 64))
    new_tokens = draw(st.integers(0, 3))
    top = capacity - new_tokens
    # mostly in range, sometimes one past either end
    lens = draw(st.lists(st.integers(-1, capacity + 1).filter(lambda n: True), min_size=batch, max_size=batch))
    if draw(st.booleans()):
        lens = [min(max(n, 0), max(top, 0)) for n in lens]
    pads = table = None
    block_size, num_blocks = 1, 0
    kind = draw(st.sampled_from(["plain", "leftpad", "paged"]))
    if kind == "leftpad":
        pads = [draw(st.integers(-1, max(n, 0) + 1)) if draw(st.integers(0, 4)) == 0 else draw(st.integers(0, max(n, 0)))
                for n in lens]
    elif kind == "paged":
        block_size = draw(st.sampled_from([1, 4, 16]))
        pages = -(-capacity // block_size) or 1
        num_blocks = draw(st.integers(1, 50))
        wild = draw(st.booleans())
        table = [[draw(st.integers(-1, num_blocks)) if wild else draw(st.integers(0, num_blocks - 1))
                  for _ in range(pages)] for _ in range(batch)]
    return lens, top, pads, table, new_tokens, block_size, num_blocks


@pytest.mark.parametrize("tiles", ["default", "small"])
@settings(max_examples=60, deadline=None)
@given(case=_cases())
def test_cache_check_matches_the_rule(tiles, case):
    lens, top, pads, table, new_tokens, block_size, num_blocks = case
    patch = pytest.MonkeyPatch()
    if tiles == "small":  # 2 rows x 4 pages per step: several row steps and page steps
        patch.setattr(checks, "_MAX_TILE", 8)
        patch.setattr(checks, "_MAX_ROWS", 2)
    try:
        as_tensor = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
        # lengths as a strided view: the kernel reads through strides
        lens_t = torch.tensor([v for n in lens for v in (n, -7)], dtype=torch.int32, device=DEV)[::2]
        ok = checks.cache_values_ok(lens_t, top, leftpad=as_tensor(pads), block_table=as_tensor(table),
                                    new_tokens=new_tokens, block_size=block_size, num_blocks=num_blocks)
    finally:
        patch.undo()
    assert ok.shape == (1,)
    assert ok.dtype == torch.bool and ok.device.type == DEV
    assert bool(ok.cpu()) == _expected(lens, top, pads, table, new_tokens, block_size, num_blocks)


@pytest.mark.parametrize("row", [3, 60])
def test_cache_check_reads_only_pages_in_use(row):
    """A decoding batch (64 sequences, 256 pages each: a grid of programs over the rows, the bad
    entry in the first or the last one): an entry past a sequence's last page may hold anything;
    one in use may not."""
    lens = torch.full((64,), 1000, dtype=torch.int32, device=DEV)
    table = torch.arange(64 * 256, dtype=torch.int32, device=DEV).view(64, 256) % 300
    ok = checks.cache_values_ok(lens, 4096, block_table=table, block_size=16, num_blocks=300)
    assert ok.shape == (1,) and bool(ok.cpu())
    table[row, 62] = 300  # page 62 holds keys 992..1007 of the sequence: in use
    assert not bool(checks.cache_values_ok(lens, 4096, block_table=table, block_size=16, num_blocks=300).cpu())
    table[row, 62], table[row, 63] = 0, -5  # page 63 starts at key 1008: past the sequence, never read
    assert bool(checks.cache_values_ok(lens, 4096, block_table=table, block_size=16, num_blocks=300).cpu())
