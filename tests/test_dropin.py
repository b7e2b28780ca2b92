"""A true drop-in (issue #15): what flash-attn's callers pass works here, with flash-attn's meaning.

Arguments as flash-attn's own tests and configs hand them over (integer tensors and numpy
integers for windows and lengths), every bad option refused before the cache is touched,
PagedKVCache refusing what would corrupt it, dropout seeded by the inputs' device, and
messages that name the argument the caller passed. (Rotary positions: test_rotary.py.)
"""

import numpy as np
import pytest
import torch

import tileattn
from tileattn import reference as R
from tolerance import assert_within, plain_attention


def cu(lengths):
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


# ------------------------------------------------------------------ 1: integer-likes


@pytest.mark.parametrize("window", [
    torch.tensor([3, 0]),  # flash-attn's tests: torch.randint(0, seqlen_k, (2,))
    np.array([3, 0]),
    (np.int64(3), np.int32(0)),
    [torch.tensor(3), 0],
])
def test_window_size_as_any_pair_of_integers(device, window):
    gen = torch.Generator().manual_seed(71)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=gen) for _ in range(3))
    out = tileattn.flash_attn_func(q.to(device), k.to(device), v.to(device), window_size=window)
    ref_o, _ = R.attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(), window_size=(3, 0))
    plain_o, _ = plain_attention(q, k, v, window_size=(3, 0))
    assert_within("out", out, plain_o, ref_o)


def test_max_seqlen_as_numpy_int_or_0d_tensor(device):
    gen = torch.Generator().manual_seed(72)
    lens = [3, 5]
    q, k, v = (torch.randn(8, 2, 16, generator=gen).to(device) for _ in range(3))
    c = cu(lens).to(device)
    expect = tileattn.flash_attn_varlen_func(q, k, v, c, c, 5, 5, causal=True, window_size=(2, 0))
    out = tileattn.flash_attn_varlen_func(q, k, v, c, c, np.int64(5), torch.tensor(5), causal=True,
                                          window_size=torch.tensor([2, 0], dtype=torch.int32))
    assert torch.equal(out, expect)


@pytest.mark.parametrize("window,error", [
    ((3.0, 0), TypeError),
    (torch.tensor([3.0, 0.0]), TypeError),
    (np.array([3.5, 0.0]), TypeError),
    ((1, 2, 3), TypeError),
    (torch.tensor([1, 2, 3]), TypeError),
    ((True, 0), TypeError),
    (torch.tensor([True, False]), TypeError),
    ((-2, 0), ValueError),
    (torch.tensor([0, -5]), ValueError),
])
def test_window_size_still_refuses_what_is_not_a_window(window, error):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(error, match="window_size"):
        tileattn.flash_attn_func(q, q, q, window_size=window)


@pytest.mark.parametrize("value,error", [(5.0, TypeError), (True, TypeError), (torch.tensor([5]), TypeError),
                                         (np.int64(-1), ValueError)])
def test_max_seqlen_refuses_non_integers(value, error):
    c = cu([3, 5])
    q = torch.randn(8, 2, 16)
    with pytest.raises(error, match="max_seqlen_k"):
        tileattn.flash_attn_varlen_func(q, q, q, c, c, 5, value)


# ------------------------------------------------------------------ 4: checks before writes


def _cache_call():
    gen = torch.Generator().manual_seed(73)
    return dict(q=torch.randn(2, 2, 4, 16, generator=gen), k_cache=torch.randn(2, 8, 2, 16, generator=gen),
                v_cache=torch.randn(2, 8, 2, 16, generator=gen), k=torch.randn(2, 2, 2, 16, generator=gen),
                v=torch.randn(2, 2, 2, 16, generator=gen), cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
                rotary_cos=torch.ones(16, 4), rotary_sin=torch.zeros(16, 4), causal=True)


@pytest.mark.parametrize("change,error", [
    (dict(softcap=-1.0), ValueError),
    (dict(softcap=float("nan")), ValueError),
    (dict(num_splits=-1), ValueError),
    (dict(num_splits=1.5), ValueError),
    (dict(window_size=(-3, 0)), ValueError),
    (dict(window_size=(1, 2, 3)), TypeError),
    (dict(alibi_slopes=torch.ones(3)), ValueError),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError),
    (dict(softmax_scale=float("inf")), ValueError),
    (dict(causal="yes"), TypeError),
    (dict(rotary_interleaved=None), TypeError),
    (dict(return_softmax_lse=1), TypeError),
    (dict(cache_seqlens=torch.tensor([3, 7], dtype=torch.int32)), IndexError),
    (dict(rotary_cos=torch.ones(6, 4), rotary_sin=torch.zeros(6, 4)), IndexError),
    (dict(cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)), IndexError),
])
def test_a_bad_option_leaves_the_cache_untouched(device, change, error):
    args = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in _cache_call().items()}
    change = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in change.items()}
    before_k, before_v = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(error):
        tileattn.flash_attn_with_kvcache(**{**args, **change})
    assert torch.equal(args["k_cache"].view(torch.int32), before_k.view(torch.int32))
    assert torch.equal(args["v_cache"].view(torch.int32), before_v.view(torch.int32))


# ------------------------------------------------------------------ 7: PagedKVCache


def _state(cache, ids):
    return (cache.free_blocks, cache.seqlens(ids).tolist(), cache.block_table(ids).tolist())


@pytest.mark.parametrize("misuse,words", [
    (lambda c, a, b: c.advance([a], -6), "int >= 0"),
    (lambda c, a, b: c.advance([a, a], 4), "named twice"),
    (lambda c, a, b: c.reserve([a], -3), "int >= 0"),
    (lambda c, a, b: c.reserve([b, b], 4), "named twice"),
    (lambda c, a, b: c.advance([a, b], 2.0), "int >= 0"),
    (lambda c, a, b: c.advance([a], 6), "reserve first"),
])
def test_paged_cache_refuses_what_corrupts_it(misuse, words):
    cache = tileattn.PagedKVCache(1, num_blocks=8, block_size=4, nheads_k=1, headdim=8, dtype=torch.float32)
    a, b = cache.allocate(), cache.allocate()
    cache.reserve([a, b], 6)
    cache.advance([a, b], 3)
    before = _state(cache, [a, b])
    with pytest.raises(ValueError, match=words):
        misuse(cache, a, b)
    assert _state(cache, [a, b]) == before


def test_paged_cache_append_past_the_reserved_blocks_is_refused(device):
    """A sequence whose blocks are full, batched with a longer one: its row of the table is padded
    with block 0, a valid id, so only what the cache knows (its room) can stop the write."""
    cache = tileattn.PagedKVCache(1, num_blocks=8, block_size=4, nheads_k=1, headdim=8, dtype=torch.float32,
                                  device=device)
    a, b = cache.allocate(), cache.allocate()
    cache.reserve([b], 4)
    cache.advance([b], 4)  # b fills its only block
    cache.reserve([a], 9)
    cache.advance([a], 9)  # a has three blocks: the table is 3 wide, b's row is [blk, 0, 0]
    table, lens = cache.block_table([a, b]), cache.seqlens([a, b])
    q, new = torch.randn(2, 1, 2, 8, device=device), torch.randn(2, 1, 1, 8, device=device)
    before = cache.k_cache[0].clone()
    with pytest.raises(ValueError, match="reserve first"):
        tileattn.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0], k=new, v=new, cache_seqlens=lens,
                                         block_table=table)
    assert torch.equal(cache.k_cache[0], before)
    cache.reserve([a, b], 1)  # with room, the same step goes through
    table, lens = cache.block_table([a, b]), cache.seqlens([a, b])
    tileattn.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0], k=new, v=new, cache_seqlens=lens,
                                     block_table=table)
    assert torch.equal(cache.k_cache[0][table[1, 1].item(), 0], new[1, 0])


def test_a_modified_vouched_tensor_is_checked_again():
    cache = tileattn.PagedKVCache(1, num_blocks=4, block_size=4, nheads_k=1, headdim=8, dtype=torch.float32)
    a = cache.allocate()
    cache.reserve([a], 5)
    cache.advance([a], 5)
    table, lens = cache.block_table([a]), cache.seqlens([a])
    lens += 10  # no longer what the cache vouched for: the values are read and checked
    with pytest.raises(IndexError, match="cache_seqlens"):
        tileattn.flash_attn_with_kvcache(torch.randn(1, 1, 1, 8), cache.k_cache[0], cache.v_cache[0],
                                         cache_seqlens=lens, block_table=table)


def test_vouched_offsets_are_not_read_until_changed(monkeypatch):
    """Offsets a producer built on the host (the transformers integration) carry their facts: the
    varlen call's value check reads nothing; after an in-place change, or with another total,
    the check runs again and names the problem."""
    from tileattn.ops import _validate as V

    cu = V.vouch(torch.tensor([0, 3, 7], dtype=torch.int32), ("cu_seqlens", 7, 4))
    reads = []
    value_mode = V.value_mode
    monkeypatch.setattr(V, "value_mode", lambda t: reads.append(1) or value_mode(t))
    V.check_cu_seqlens("cu_seqlens_q", cu, 7, 4)
    assert not reads
    with pytest.raises(ValueError, match="more than max_seqlen 3"):
        V.check_cu_seqlens("cu_seqlens_q", cu, 7, 3)
    with pytest.raises(ValueError, match="end at the number of packed tokens"):
        V.check_cu_seqlens("cu_seqlens_q", cu, 8, 4)
    cu[2] = 9  # changed in place: read again
    with pytest.raises(ValueError, match="end at the number of packed tokens"):
        V.check_cu_seqlens("cu_seqlens_q", cu, 7, 4)
    assert len(reads) == 3


# ------------------------------------------------------------------ 8: dropout seed


@pytest.mark.gpu
def test_dropout_follows_the_cuda_generator():
    gen = torch.Generator(device="cuda").manual_seed(74)
    q, k, v = (torch.randn(2, 64, 2, 32, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    torch.cuda.manual_seed(11)
    first = tileattn.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.rand(5)  # the CPU generator moves; tileattn must not care
    torch.cuda.manual_seed(11)
    again = tileattn.flash_attn_func(q, k, v, dropout_p=0.3)
    other = tileattn.flash_attn_func(q, k, v, dropout_p=0.3)  # the generator advanced: a new mask
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# ------------------------------------------------------------------ 9: messages


def test_paged_varlen_names_cu_seqlens_k():
    q = torch.randn(6, 2, 16)
    pool = torch.randn(4, 4, 2, 16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    bad = torch.tensor([0, 5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        tileattn.flash_attn_varlen_func(q, pool, pool, cu([3, 3]), bad, 3, 5, block_table=table)
    long = torch.tensor([0, 9, 12], dtype=torch.int32)
    with pytest.raises(IndexError, match="a sequence in cu_seqlens_k has 9 keys, the block table holds 8"):
        tileattn.flash_attn_varlen_func(q, pool, pool, cu([3, 3]), long, 3, 9, block_table=table)


def test_cu_seqlens_batch_mismatch_names_both():
    q = torch.randn(6, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens_q has 3 .*cu_seqlens_k has 4"):
        tileattn.flash_attn_varlen_func(q, q, q, cu([3, 3]), cu([2, 2, 2]), 3, 3)


def test_a_cache_strided_in_its_last_dimension_is_refused():
    cache = torch.randn(2, 8, 16, 2).transpose(-1, -2)  # (2, 8, 2, 16) with stride 2 on headdim
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        tileattn.flash_attn_with_kvcache(torch.randn(2, 1, 2, 16), cache, cache)
