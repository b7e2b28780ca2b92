"""Checks once per call signature (``tileattn.ops._memo``): a kept signature never gives a stale
answer (new values, options, strides, grad mode), and a bad input still raises its exception,
before anything is written, after a good call of the same shapes."""

import pytest
import torch

import tileattn
from tileattn import reference as R
from tileattn.ops import _memo
from tileattn.ops import _validate as V
from tileattn.ops import attention as dense_ops
from tileattn.ops import kvcache as kv_ops
from tolerance import assert_within, plain_attention


def assert_attention(out, lse, q, k, v, **opts):
    """out and lse of q over k, v (dense (B, S, H, D)) against the float64 reference."""
    ref_o, ref_lse = R.attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(), **opts)
    plain_o, plain_lse = plain_attention(q, k, v, **opts)
    assert_within("out", out, plain_o, ref_o)
    assert_within("lse", lse, plain_lse, ref_lse)


OPTIONS = [dict(), dict(causal=True), dict(softmax_scale=0.3), dict(softcap=4.0, causal=True),
           dict(window_size=(3, 0)), dict()]


def test_kvcache_same_signature_new_values_lengths_and_options(device):
    """One signature called again and again: each call's values, lengths and options count."""
    gen = torch.Generator().manual_seed(71)
    batch, cap, seqlen_q = 2, 24, 2
    k_cache, v_cache = torch.randn(batch, cap, 2, 16, generator=gen), torch.randn(batch, cap, 2, 16, generator=gen)
    q = torch.empty(batch, seqlen_q, 4, 16)
    lens = torch.empty(batch, dtype=torch.int32)
    for step, opts in enumerate(OPTIONS):
        q.normal_(generator=gen)  # new values in the same tensors: the same signature
        k_cache.normal_(generator=gen)
        v_cache.normal_(generator=gen)
        lens.copy_(torch.tensor([5 + step, 20 - step], dtype=torch.int32))
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True,
                                                    **opts)
        for b in range(batch):
            n = int(lens[b])
            assert_attention(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                             **opts)


def test_dense_same_shapes_new_strides_options_and_grad(device):
    """flash_attn_func over one shape: contiguous, then views with other strides, other options,
    and inputs that require grad after calls that did not (the gradient must flow)."""
    gen = torch.Generator().manual_seed(72)
    shape = (2, 9, 4, 16)
    for opts in OPTIONS:
        q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
        out, lse, _ = tileattn.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
        assert_attention(out, lse, q, k, v, **opts)
        # the same shapes as views of heads-first tensors: other strides, the same values
        qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        out_t = tileattn.flash_attn_func(qt, kt, vt, **opts)
        torch.testing.assert_close(out_t, out, rtol=1e-5, atol=1e-6)
    q, k, v = (torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        tileattn.flash_attn_func(q, k, v)
    out = tileattn.flash_attn_func(q, k, v)
    assert out.requires_grad
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _decode_args():
    gen = torch.Generator().manual_seed(73)
    return dict(q=torch.randn(2, 1, 4, 16, generator=gen), k_cache=torch.randn(2, 8, 2, 16, generator=gen),
                v_cache=torch.randn(2, 8, 2, 16, generator=gen), k=torch.randn(2, 1, 2, 16, generator=gen),
                v=torch.randn(2, 1, 2, 16, generator=gen), cache_seqlens=torch.tensor([3, 6], dtype=torch.int32))


def _paged(args):
    """The same call over a paged pool of 4 blocks of 4 (2 per sequence)."""
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    return {**args, "k_cache": args["k_cache"].view(4, 4, 2, 16), "v_cache": args["v_cache"].view(4, 4, 2, 16),
            "block_table": table}


def _strided_last(t):
    """t's shape and values with a last-dim stride of 2."""
    return torch.stack([t, t], dim=-1)[..., 0]


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "cache_seqlens": torch.tensor([3, 8], dtype=torch.int32)}, IndexError, "room"),
    # options equal to the good call's (True == 1, False == 0) but of another type
    (lambda a: {**a, "causal": 1, "good": {"causal": True}}, TypeError, "causal must be a bool"),
    (lambda a: {**a, "return_softmax_lse": 0, "good": {"return_softmax_lse": False}}, TypeError,
     "return_softmax_lse must be a bool"),
    (lambda a: {**a, "num_splits": True, "good": {"num_splits": 1}}, ValueError, "num_splits"),
    (lambda a: {**a, "cache_seqlens": torch.tensor([3, 6], dtype=torch.int64)}, TypeError, "int32"),
    (lambda a: {**a, "causal": 1}, TypeError, "causal must be a bool"),
    (lambda a: {**a, "window_size": (True, -1)}, TypeError, "window_size"),
    (lambda a: {**a, "return_softmax_lse": 1}, TypeError, "return_softmax_lse must be a bool"),
    (lambda a: {**a, "num_splits": True}, ValueError, "num_splits"),
    (lambda a: {**a, "softmax_scale": float("nan")}, ValueError, "finite"),
    (lambda a: {**a, "softcap": -1.0}, ValueError, "softcap"),
    (lambda a: {**a, "q": a["q"].double()}, TypeError, "share a dtype"),
    (lambda a: {**a, "k": a["k"].double()}, TypeError, "new k"),
    (lambda a: {**a, "k_cache": _strided_last(a["k_cache"])}, ValueError, "contiguous in their last dimension"),
    (lambda a: {**_paged(a), "block_table": torch.tensor([[2, 0], [1, 4]], dtype=torch.int32)}, IndexError,
     "block_table"),
    (lambda a: {**_paged(a), "block_table": torch.tensor([[2, 0], [1, 3]], dtype=torch.int64)}, TypeError,
     "block_table"),
])
def test_kvcache_bad_input_after_a_good_call_raises(change, error, words):
    """The good call (same shapes; paged where the bad one is) makes the signature known; the
    bad one must still raise, and leave the cache as it was."""
    good = _decode_args()
    bad = change(_decode_args())
    if "block_table" in bad:
        good = _paged(good)
    tileattn.flash_attn_with_kvcache(**good, **bad.pop("good", {}))
    before = bad["k_cache"].clone()
    with pytest.raises(error, match=words):
        tileattn.flash_attn_with_kvcache(**bad)
    assert torch.equal(bad["k_cache"], before), "a rejected call wrote into the cache"


@pytest.mark.parametrize("change,error,words", [
    (lambda a: {**a, "causal": 1}, TypeError, "causal must be a bool"),
    (lambda a: {**a, "causal": 1, "good": {"causal": True}}, TypeError, "causal must be a bool"),
    (lambda a: {**a, "deterministic": 0, "good": {"deterministic": False}}, TypeError, "deterministic must be a bool"),
    (lambda a: {**a, "dropout_p": 1.0}, ValueError, "dropout_p"),
    (lambda a: {**a, "window_size": (-1, True)}, TypeError, "window_size"),
    (lambda a: {**a, "v": a["v"].double()}, TypeError, "share a dtype"),
    (lambda a: {**a, "alibi_slopes": torch.ones(4, dtype=torch.float64)}, TypeError, "alibi_slopes must be float32"),
])
def test_dense_bad_input_after_a_good_call_raises(change, error, words):
    gen = torch.Generator().manual_seed(74)
    args = dict(zip("qkv", (torch.randn(1, 5, 4, 16, generator=gen) for _ in range(3))))
    bad = change({**args, "alibi_slopes": torch.ones(4)})
    tileattn.flash_attn_func(**args, alibi_slopes=torch.ones(4), **bad.pop("good", {}))
    with pytest.raises(error, match=words):
        tileattn.flash_attn_func(**bad)


def test_dense_gradient_limit_checked_when_grad_is_asked_after_calls_without(monkeypatch):
    """The Triton backward stops at head dim 256: after forward-only calls of head dim 288 (no
    input requires grad, or grad mode off), the same shapes requiring grad must raise."""
    if torch.cuda.is_available():
        q = torch.randn(1, 2, 2, 288, device="cuda", dtype=torch.bfloat16)
    else:  # the Triton kernels in the interpreter
        monkeypatch.setenv("TILEATTN_BACKEND", "triton")
        q = torch.randn(1, 2, 2, 288)
    tileattn.flash_attn_func(q, q, q)
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        tileattn.flash_attn_func(qg, q, q)
    with pytest.raises(NotImplementedError, match="head dims up to 256"):
        tileattn.flash_attn_func(qg, q, q)


def test_backend_variable_read_on_every_call(monkeypatch):
    """TILEATTN_BACKEND is part of the signature: a bad value after good calls still raises."""
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    args = _decode_args()
    tileattn.flash_attn_with_kvcache(**args)
    monkeypatch.setenv("TILEATTN_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="TILEATTN_BACKEND"):
        tileattn.flash_attn_with_kvcache(**args)


def test_metadata_checks_run_once_per_signature(monkeypatch):
    """A repeated call skips check_qkv; a new option, a new stride or a tensor subclass does not."""
    calls = []
    real = V.check_qkv
    monkeypatch.setattr(V, "check_qkv", lambda *a, **k: calls.append(1) or real(*a, **k))
    kv_ops._CHECKED.clear()
    dense_ops._CHECKED.clear()
    args = _decode_args()
    for _ in range(3):
        tileattn.flash_attn_with_kvcache(**args)
    assert len(calls) == 1
    tileattn.flash_attn_with_kvcache(**args, causal=True)
    assert len(calls) == 2
    q = torch.randn(1, 3, 4, 16)
    tileattn.flash_attn_func(q, q, q)
    tileattn.flash_attn_func(q, q, q)
    assert len(calls) == 3
    tileattn.flash_attn_func(q.transpose(1, 2).contiguous().transpose(1, 2), q, q)
    assert len(calls) == 4
    p = torch.nn.Parameter(q.clone(), requires_grad=False)  # a subclass: checked on every call
    tileattn.flash_attn_func(p, q, q)
    tileattn.flash_attn_func(p, q, q)
    assert len(calls) == 6
    tileattn.flash_attn_with_kvcache(**{**args, "cache_seqlens": 3})  # an int length: checked every call
    tileattn.flash_attn_with_kvcache(**{**args, "cache_seqlens": 3})
    assert len(calls) == 8


def test_signature_tells_apart_what_compares_equal():
    q = torch.zeros(1, 2, 2, 8)
    key = _memo.signature((q, None), (True, 0.5), (-1, -1))
    assert key == _memo.signature((q.clone(), None), (True, 0.5), (-1, -1))
    assert key != _memo.signature((q, None), (1, 0.5), (-1, -1))  # True == 1, but only one is a bool
    assert key != _memo.signature((None, q), (True, 0.5), (-1, -1))
    assert key != _memo.signature((q.double(), None), (True, 0.5), (-1, -1))
    assert key != _memo.signature((q.transpose(1, 2).contiguous().transpose(1, 2), None), (True, 0.5), (-1, -1))
    assert _memo.signature((q, None), (True, 0.5), [-1, -1]) is None  # not a tuple
    assert _memo.signature((q, None), (True, [0.5]), (-1, -1)) is None
    assert _memo.signature((q, 3), (True, 0.5), (-1, -1)) is None
    memo = _memo.Memo(size=2)
    for i in range(3):
        memo.put((i,), i)
    assert len(memo.entries) <= 2 and memo.get((2,)) == 2
    memo.put(None, 1)
    assert memo.get(None) is None


def test_forward_ad_tangents_refused_after_kept_calls(device):
    """A forward-mode AD input (``forward_ad.make_dual``) after calls that kept the signature's lane:
    a clear refusal, as on its first call (the CPU lane returned a zero tangent, the Triton one none,
    where a fresh CPU call failed inside torch); calls without tangents inside the level still run."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(75)
    q, k, v = (torch.randn(1, 1, 4, 16, generator=gen) for _ in range(3))
    lens = torch.tensor([1], dtype=torch.int32)
    want = tileattn.flash_attn_func(q, k, v)
    want_kv = tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    for _ in range(2):  # the second call of each signature takes its lane
        assert torch.equal(tileattn.flash_attn_func(q, k, v), want)
        assert torch.equal(tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens), want_kv)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn(q.shape, generator=gen))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            tileattn.flash_attn_func(dual, k, v)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            tileattn.flash_attn_with_kvcache(dual, k, v, cache_seqlens=lens)
        assert torch.equal(tileattn.flash_attn_func(q, k, v), want)
