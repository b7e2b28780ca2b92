"""flash-attn's padding helpers (``tileattn.bert_padding``): packing a padded batch for the
varlen call and back, gradients, sample packing, and the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tileattn
from tileattn import reference
from tileattn.bert_padding import (
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)
from tolerance import assert_within, plain_attention


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=4))
def test_unpad_then_pad_gives_back_the_real_tokens(rows):
    """Any mask (left, right or scattered padding, empty rows): the packed rows are the real
    tokens in order, cu_seqlens counts them, and padding back restores them with zeros elsewhere."""
    mask = torch.tensor(rows, dtype=torch.bool)
    hidden = torch.randn(*mask.shape, 3, 2, generator=torch.Generator().manual_seed(len(rows)))
    packed, indices, cu, max_len, used = unpad_input(hidden, mask.int())
    assert torch.equal(packed, hidden[mask])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *mask.sum(1).cumsum(0).tolist()]
    assert max_len == int(mask.sum(1).max()) and torch.equal(used, mask.sum(1).int())
    back = pad_input(packed, indices, *mask.shape)
    assert torch.equal(back, hidden * mask[..., None, None])


def test_gradients_flow_through_unpad_and_pad():
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    packed, indices, *_ = unpad_input(hidden, mask)
    weights = torch.randn(2, 5, 4)
    (pad_input(packed * 3, indices, 2, 5) * weights).sum().backward()
    assert torch.equal(hidden.grad, 3 * weights * mask[..., None])


@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_through_the_varlen_call(device, causal):
    """A padded batch packed by unpad_input, attended by flash_attn_varlen_func and padded back:
    each sequence's rows equal attention over that sequence alone (the float64 reference)."""
    gen = torch.Generator().manual_seed(3 + causal)
    lengths = [7, 0, 12, 3]
    batch, seqlen, nheads, d = len(lengths), 12, 4, 32
    mask = torch.arange(seqlen)[None, :] >= seqlen - torch.tensor(lengths)[:, None]  # left padding
    q, k, v = (torch.randn(batch, seqlen, nheads, d, generator=gen).to(torch.bfloat16) for _ in range(3))
    (qp, idx, cu, max_len, _), kp, vp = unpad_input(q, mask), unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    dev = lambda t: t.to(device)  # noqa: E731
    out = tileattn.flash_attn_varlen_func(dev(qp), dev(kp), dev(vp), dev(cu), dev(cu), max_len, max_len,
                                          causal=causal)
    out = pad_input(out.cpu(), idx, batch, seqlen)
    for b, n in enumerate(lengths):
        rows = slice(seqlen - n, seqlen)
        assert torch.equal(out[b, :seqlen - n], torch.zeros_like(out[b, :seqlen - n]))
        if n == 0:
            continue
        qb, kb, vb = (t[b:b + 1, rows] for t in (q, k, v))
        ref_o, _ = reference.attention_naive(*(t.double().numpy() for t in (qb, kb, vb)), causal=causal)
        plain_o, _ = plain_attention(qb, kb, vb, causal=causal)
        assert_within(f"sequence {b}", out[b:b + 1, rows], plain_o, ref_o)


def test_unused_tokens_are_packed_but_not_counted():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    packed, indices, cu, max_len, used = unpad_input(hidden, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6] and cu.tolist() == [0, 3, 6] and max_len == 3
    assert used.tolist() == [2, 1] and torch.equal(packed, hidden.flatten(0, 1)[indices])


def test_sample_packing_splits_each_row_into_its_sequences():
    hidden = torch.randn(2, 6, 2)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [4, 1, 1, 0, 0, 0]])
    packed, indices, cu, max_len = unpad_input_for_concatenated_sequences(hidden, lengths)
    assert cu.tolist() == [0, 2, 5, 9, 10, 11] and max_len == 4
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert torch.equal(packed, hidden.flatten(0, 1)[indices])


@pytest.mark.parametrize("call,error,words", [
    (lambda h: unpad_input(h, torch.ones(2, 4)), TypeError, "0/1 as bool or integers"),
    (lambda h: unpad_input(h, torch.ones(2, 3, dtype=torch.int64)), ValueError, "hidden_states starts with"),
    (lambda h: unpad_input(h, torch.full((2, 4), 2)), ValueError, "only 0 and 1"),
    (lambda h: unpad_input(h, torch.tensor([[1, -1, 0, 1], [1, 1, 0, 0]])), ValueError, r"found \[-1\]"),
    (lambda h: unpad_input(h, torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool)), ValueError,
     "overlap"),
    (lambda h: pad_input(h[0], torch.tensor([0, 1, 2, 8]), 2, 4), IndexError, "within 0..7"),
    (lambda h: pad_input(h[0], torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, 4), TypeError, "int64"),
    (lambda h: index_put_first_axis(h[0], torch.tensor([0, 1]), 8), ValueError, "2 entries for 4 rows"),
    (lambda h: unpad_input_for_concatenated_sequences(h, torch.tensor([[3, 2, 0, 0], [1, 0, 0, 0]])), ValueError,
     "more than its 4 tokens"),
])
def test_bad_padding_input_raises(call, error, words):
    with pytest.raises(error, match=words):
        call(torch.randn(2, 4, 3))
