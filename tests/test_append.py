"""The one-launch append of new keys and values to a KV cache (``tileattn.gpu.append_kv``).

Run in Triton's interpreter on the CPU (or on the GPU when there is one) against torch indexing
and ``tileattn.ops.rotary.apply_rotary``. Every cache slot starts as NaN: the slots the append
must write are checked against the expected values, every other slot must still be NaN.
"""

from __future__ import annotations

import pytest
import torch

from tileattn import gpu
from tileattn.ops.rotary import apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected_slots(lens, new, block_size, table):
    """(cache row or page, slot) of new token i of sequence b, for every (b, i)."""
    pos = lens.long()[:, None] + torch.arange(new)
    if table is None:
        return torch.arange(len(lens))[:, None].expand_as(pos), pos
    return table.long().gather(1, pos // block_size), pos % block_size


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
def test_append_writes_exactly_the_new_slots(paged, rotary):
    gen = torch.Generator().manual_seed(71)
    batch, new, nheads_k, nheads, head_dim, dtype = 3, 3, 2, 6, 40, torch.float16
    lens = torch.tensor([0, 5, 13], dtype=torch.int32)
    k, v = (torch.randn(batch, new, nheads_k, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(batch, new, nheads, head_dim, generator=gen).to(dtype)
    if paged:
        block_size, table = 4, torch.randperm(20, generator=gen)[:12].view(batch, 4).to(torch.int32)
        shape = (20, block_size, nheads_k, head_dim)
    else:
        block_size, table, shape = 16, None, (batch, 16, nheads_k, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    cos = sin = None
    if rotary:
        angles = torch.rand(32, 12, generator=gen) * 6.3  # rotary_dim 24 of head_dim 40
        cos, sin = angles.cos(), angles.sin()
    seqused = torch.full((batch,), -1, dtype=torch.int32)
    dev = [t.to(DEVICE) if t is not None else None for t in (k_cache, v_cache, k, v, lens, table, cos, sin, q)]
    q_rot = gpu.append_kv(*dev[:6], rotary_cos=dev[6], rotary_sin=dev[7], interleaved=rotary == "interleaved",
                          q=dev[8] if rotary else None, q_per_token=True, seqused_out=seqused.to(DEVICE))
    k_cache, v_cache = dev[0].cpu(), dev[1].cpu()

    rows, slots = _expected_slots(lens, new, block_size, table)
    pos = lens.long()[:, None] + torch.arange(new)
    k_want = apply_rotary(k, cos, sin, pos, rotary == "interleaved") if rotary else k
    torch.testing.assert_close(k_cache[rows, slots], k_want, rtol=0, atol=1e-3 if rotary else 0)
    torch.testing.assert_close(v_cache[rows, slots], v, rtol=0, atol=0)
    for cache in (k_cache, v_cache):
        untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
        untouched[rows, slots] = False
        assert cache[untouched].isnan().all()
    if rotary:
        torch.testing.assert_close(q_rot.cpu(), apply_rotary(q, cos, sin, pos, rotary == "interleaved"), rtol=0,
                                   atol=1e-3)
    else:
        assert q_rot is None


def test_rotated_q_at_the_cache_length_and_new_lengths():
    """q at position cache_seqlens[b] for every token (not causal, not local); the lengths after
    the append come back; a view of a contiguous cache (cache_batch_idx as a one-page table)."""
    gen = torch.Generator().manual_seed(72)
    batch, new, head_dim = 2, 2, 32
    lens = torch.tensor([3, 7], dtype=torch.int32)
    k, v = (torch.randn(batch, new, 1, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(batch, new, 4, head_dim, generator=gen)[..., :head_dim]
    k_cache, v_cache = (torch.full((3, 10, 1, head_dim), float("nan")) for _ in range(2))
    rows = torch.tensor([2, 0], dtype=torch.int32)
    angles = torch.rand(16, head_dim // 2, generator=gen) * 6.3
    seqused = torch.full((batch,), -1, dtype=torch.int32)
    lens, k, v, q, k_cache, v_cache, rows, angles, seqused = (
        t.to(DEVICE) for t in (lens, k, v, q, k_cache, v_cache, rows, angles, seqused))
    q_rot = gpu.append_kv(k_cache, v_cache, k, v, lens, rows.view(batch, 1), rotary_cos=angles.cos(),
                          rotary_sin=angles.sin(), interleaved=False, q=q, q_per_token=False, seqused_out=seqused)
    torch.testing.assert_close(seqused, lens + new, rtol=0, atol=0)
    at_len = lens.long()[:, None].expand(batch, new)
    torch.testing.assert_close(q_rot, apply_rotary(q, angles.cos(), angles.sin(), at_len, False), rtol=0, atol=1e-5)
    pos = lens.long()[:, None] + torch.arange(new, device=DEVICE)
    torch.testing.assert_close(v_cache[rows.long()[:, None], pos], v, rtol=0, atol=0)
    assert v_cache[1].isnan().all()


def test_nothing_new_leaves_the_cache_and_reports_the_lengths():
    k_cache = torch.full((2, 8, 1, 16), float("nan"))
    lens = torch.tensor([2, 8], dtype=torch.int32)
    seqused = torch.full((2,), -1, dtype=torch.int32)
    empty = torch.empty(2, 0, 1, 16)
    gpu.append_kv(k_cache, k_cache, empty, empty, lens, seqused_out=seqused)
    assert k_cache.isnan().all()
    torch.testing.assert_close(seqused, lens, rtol=0, atol=0)
