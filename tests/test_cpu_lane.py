"""The CPU lane's one-row step (``tileattn.cpu.attention.RowStep``, taken by ``cpu.prepared.PreparedFwd``):
a decoding call of batch 1 whose layout is bound at the signature's first call. Its later calls must
give what the unbound one-tile step gives (bitwise: the same ops in the same order), read each call's
own values, lengths and storage offsets, and hand what it does not serve (no keys, more than one tile)
back to the full path."""

import pytest
import torch

import tileattn
import tileattn.reference as R
from tileattn.cpu.attention import BLOCK_N, RowStep
from tileattn.ops import attention as dense_ops
from tileattn.ops import kvcache as kv_ops
from test_memo import assert_attention


@pytest.fixture(autouse=True)
def cpu_backend(monkeypatch):
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    kv_ops._CHECKED.clear()
    dense_ops._CHECKED.clear()


def lane_of(memo):
    (entry,) = memo.entries.values()
    return entry.lane


def check(out, lse, q, k, v, causal):
    """float64: within 1e-12 of the reference, relative to its largest entry; else the tolerance rule."""
    if q.dtype != torch.float64:
        assert_attention(out, lse, q, k, v, causal=causal)
        return
    for x, ref in zip((out, lse), R.attention_naive(q.numpy(), k.numpy(), v.numpy(), causal=causal)):
        ref = torch.from_numpy(ref)
        assert (x - ref).abs().max() <= 1e-12 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,heads_k,dim", [(8, 2, 64), (4, 4, 40), (6, 3, 80), (4, 1, 96)])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_lane_each_call_against_reference(dtype, heads, heads_k, dim, causal):
    """Layer views of one stacked cache (a new storage offset each call), lengths from 1 to the
    capacity, a q sliced out of a wider tensor: every call against the float64 reference, and the
    lane's answer bitwise equal to the full path's on the same inputs."""
    gen = torch.Generator().manual_seed(17)
    cap, layers = 203, 3
    stack_k, stack_v = (torch.randn(layers, 1, cap, heads_k, dim, generator=gen, dtype=dtype) for _ in range(2))
    wide_q = torch.randn(1, 1, heads + 2, dim, generator=gen, dtype=dtype)
    lens = torch.empty(1, dtype=torch.int32)
    for step, n in enumerate([1, 2, 17, 113, 203, 64]):
        k_cache, v_cache = stack_k[step % layers], stack_v[step % layers]
        wide_q.normal_(generator=gen)
        q = wide_q[:, :, 1:heads + 1]  # strided heads, storage offset dim
        lens.fill_(n)
        kv_ops._CHECKED.clear()  # the signature's first call takes the full path and prepares the lane
        full = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=causal,
                                                return_softmax_lse=True)
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=causal,
                                                    return_softmax_lse=True)
        lane = lane_of(kv_ops._CHECKED)
        assert lane.calls == 1 and isinstance(lane.row, RowStep)
        assert torch.equal(out, full[0]) and torch.equal(lse, full[1])
        check(out, lse, q, k_cache[:, :n], v_cache[:, :n], causal)
    # one lane over every layer and length: each call's own offsets and values
    kv_ops._CHECKED.clear()
    for step, n in enumerate([5, 203, 1, 64]):
        k_cache, v_cache = stack_k[step % layers], stack_v[step % layers]
        wide_q.normal_(generator=gen)
        lens.fill_(n)
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=causal,
                                                    return_softmax_lse=True)
        check(out, lse, q, k_cache[:, :n], v_cache[:, :n], causal)
    assert lane_of(kv_ops._CHECKED).calls == 3


def test_decode_lane_hands_back_no_keys_and_long_caches():
    """Zero cached keys (out 0, lse -inf) and more keys than one tile take the full path from the lane."""
    gen = torch.Generator().manual_seed(18)
    cap = BLOCK_N + 40
    k_cache, v_cache = (torch.randn(1, cap, 2, 32, generator=gen) for _ in range(2))
    q = torch.randn(1, 1, 4, 32, generator=gen)
    lens = torch.tensor([5], dtype=torch.int32)
    tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True)
    lane = lane_of(kv_ops._CHECKED)
    assert isinstance(lane.row, RowStep)
    for n in (0, BLOCK_N, BLOCK_N + 1, cap, 3):
        lens.fill_(n)
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True)
        if n == 0:
            assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        else:
            assert_attention(out, lse, q, k_cache[:, :n], v_cache[:, :n])
    assert lane.calls == 5


@pytest.mark.parametrize("opts", [dict(window_size=(7, 0)), dict(softcap=5.0), dict(causal=True), dict()])
@pytest.mark.parametrize("dim_v", [48, 32])
def test_dense_decode_lane_and_what_it_does_not_bind(opts, dim_v):
    """flash_attn_func with one query row of batch 1 (values of their own head dim too): a left
    window or softcap leaves the row step unbound (the generic one-tile step serves them); each
    call against the reference."""
    gen = torch.Generator().manual_seed(19)
    for step in range(3):
        q = torch.randn(1, 1, 4, 48, generator=gen)
        k, v = torch.randn(1, 30, 2, 48, generator=gen), torch.randn(1, 30, 2, dim_v, generator=gen)
        out, lse, _ = tileattn.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
        assert_attention(out, lse, q, k, v, **opts)
    bound = lane_of(dense_ops._CHECKED).row is not None
    assert bound == ("window_size" not in opts and "softcap" not in opts)


def test_row_step_declines_other_signatures():
    """Batches, several query rows and low-precision dtypes are not bound."""
    from tileattn.contract import AttnParams

    p = AttnParams(softmax_scale=0.125)
    k = torch.randn(1, 8, 2, 16)
    assert RowStep.bind(torch.randn(1, 1, 4, 16), k, k, p) is not None
    assert RowStep.bind(torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16), p) is None
    assert RowStep.bind(torch.randn(1, 2, 4, 16), k, k, p) is None
    kb = k.bfloat16()
    assert RowStep.bind(torch.randn(1, 1, 4, 16).bfloat16(), kb, kb, p) is None
