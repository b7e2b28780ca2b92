"""The Hopper (Gluon: TMA + wgmma) backward kernels against the float64 reference, on an H100/H200.

Gluon kernels have no interpreter: these tests need the GPU (marker ``gpu``). They run the
backward through ``attn_bwd`` after asserting that the dispatch really picks the Hopper
kernels, so a case the rule sends elsewhere fails instead of testing the portable kernels twice. The forward's
(out, lse) come from the float64 reference; gradients are poisoned with NaN and must lie within
GRAD_FACTOR times the error of plain PyTorch autograd in the same dtype (tests/tolerance.py).
The compile check for machines without a GPU is in tests/hopper_compile.py; the dispatch
plumbing is also checked on the CPU in tests/test_hopper_bwd_dispatch.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tileattn import reference
from tileattn.contract import AttnParams
from tileattn.gpu import backward
from tileattn.gpu.backward import attn_bwd
from tileattn.gpu.hopper_bwd import hopper_bwd_reason

from tolerance import GRAD_FACTOR, assert_within, plain_attention

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def reductions_at_every_length(monkeypatch):
    """dQ by reductions (not deterministic) at every length, not only past
    ``REDUCE_MIN_ROWS`` query rows: the short cases below test that path too."""
    from tileattn.gpu import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "REDUCE_MIN_ROWS", 0)


def _np(*tensors):
    return [None if t is None else t.detach().cpu().double().numpy() for t in tensors]


def _plain_grads(q, k, v, dout, **opts):
    """Autograd gradients of plain_attention in the inputs' dtype and device: the budget (or, in
    float64, the oracle)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = plain_attention(*leaves, **opts)
    out.backward(dout)
    return [t.grad for t in leaves]


def _backward(dout, q, k, v, out, lse, params, grad_dtype=None, **kwargs):
    """attn_bwd into NaN-poisoned gradients (in ``grad_dtype``, default the inputs'), after
    checking that the Hopper kernels take the call."""
    dq, dk, dv = (torch.full_like(t, float("nan"), dtype=grad_dtype) for t in (q, k, v))
    why = hopper_bwd_reason(dout, q, k, v, dq, dk, dv, params, varlen="cu_seqlens_q" in kwargs)
    assert why is None, f"the dispatch does not pick the Hopper backward: {why}"
    attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, params=params, **kwargs)
    torch.cuda.synchronize()
    return dq, dk, dv


def _run(seed, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, causal=False, window=(-1, -1),
         layout="bshd", sink=False, grad_dtype=None, deterministic=False):
    gen = torch.Generator().manual_seed(seed)

    def t(s, h):
        x = torch.randn(batch, s, h, head_dim, generator=gen).to(dtype).cuda()
        if layout == "bhsd":  # a (B, S, H, D) view of a (B, H, S, D) tensor: strides of a transpose
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x

    q, k, v, dout = t(seqlen_q, nheads), t(seqlen_k, nheads_k), t(seqlen_k, nheads_k), t(seqlen_q, nheads)
    learnable_sink = torch.randn(nheads, generator=gen) * 3 if sink else None
    opts = dict(causal=causal, window_size=window)
    np_sink = None if learnable_sink is None else _np(learnable_sink)[0]
    out64, lse64 = reference.attention_naive(*_np(q, k, v), learnable_sink=np_sink, **opts)
    out = torch.from_numpy(out64).to(dtype).cuda()
    lse = torch.from_numpy(lse64).float().cuda()
    params = AttnParams(head_dim**-0.5, window[0], 0 if causal else window[1])
    kwargs = dict(deterministic=deterministic)
    if sink:
        kwargs.update(learnable_sink=learnable_sink.cuda(), dsink=torch.full((nheads,), float("nan"), device="cuda"))
    fast = _backward(dout, q, k, v, out, lse, params, grad_dtype, **kwargs)
    ref = reference.attention_naive_grad(*_np(q, k, v, dout), learnable_sink=np_sink, **opts)
    plain = _plain_grads(*(x.cpu() for x in (q, k, v, dout)), learnable_sink=learnable_sink, **opts)
    for name, f, p, r in zip(("dq", "dk", "dv"), fast, plain, ref):
        assert_within(name, f, p, r, factor=GRAD_FACTOR)
    if sink:  # dsink is the shared preprocess's (tests/test_sinks.py checks its value)
        assert torch.isfinite(kwargs["dsink"]).all()
    return fast


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (129, 129), (1000, 1000), (300, 1000), (1000, 300),
                                               (129, 257), (1, 200)])
def test_hopper_backward(head_dim, dtype, causal, seqlen_q, seqlen_k):
    """Lengths 1, odd, one past a 128-row block, seqlen_q != seqlen_k both ways (causal rows with
    no key, keys no query sees)."""
    _run(seqlen_q * 7 + seqlen_k + head_dim, 2, seqlen_q, seqlen_k, 4, 4, head_dim, dtype, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_rows_without_keys(head_dim):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key, so their
    dq is exactly 0 (P = 0: lse2 = +inf), and every gradient is finite."""
    dq, dk, dv = _run(head_dim, 2, 300, 100, 4, 2, head_dim, torch.bfloat16, causal=True)
    assert torch.equal(dq[:, :200], torch.zeros_like(dq[:, :200]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_hopper_gqa(group, causal, deterministic):
    """A key/value head's dK/dV program walks the query tiles of its whole group (and, at head
    dim 128 unless deterministic, reduces each query head's dQ share into its columns); a query
    head's dQ program reads its group's key/value head."""
    _run(group + 10 * causal, 2, 300, 300, 8, 8 // group, 128, torch.bfloat16, causal=causal,
         deterministic=deterministic)


@pytest.mark.parametrize("window", [(64, 0), (100, 20), (-1, 50), (300, -1)])
def test_hopper_window(window):
    """Sliding windows: key blocks no query sees (and query tiles a key block skips) at both ends."""
    _run(sum(window), 2, 513, 700, 4, 2, 64, torch.bfloat16, window=window)


def test_hopper_sinks_and_views():
    """Learnable sinks (only the preprocess knows them: dsink) with inputs laid out as (B, H, S, D)
    and viewed as (B, S, H, D): the TMA descriptors take strides."""
    _run(5, 2, 400, 400, 4, 2, 128, torch.bfloat16, causal=True, layout="bhsd", sink=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_fp32_gradients(head_dim):
    """fp32 gradient outputs (the ring's accumulators) are taken and stored unrounded: within the
    budget, and not all representable in the inputs' dtype."""
    fast = _run(head_dim + 1, 2, 300, 350, 4, 2, head_dim, torch.bfloat16, causal=True, grad_dtype=torch.float32)
    for g in fast:
        assert g.dtype == torch.float32 and (g != g.to(torch.bfloat16).float()).any()


def test_hopper_deterministic():
    """``deterministic=True``: no reductions, one tile config: two runs give bitwise the same
    gradients, the second launched straight to the compiled kernels (``GluonLaunch``: dK/dV and
    dQ); without it, head dim 128 is one launch (dK/dV with dQ's reductions)."""
    from tileattn.gpu import _launch
    from tileattn.kernels.attn_bwd_hopper import _attn_bwd_hopper_kernel

    def fast_calls():
        return sum(launch.fast_calls for key, launch in _launch._LAUNCHES.items() if key[0] is _attn_bwd_hopper_kernel)

    first = _run(31, 1, 777, 777, 8, 2, 128, torch.bfloat16, causal=True, deterministic=True)
    before = fast_calls()
    second = _run(31, 1, 777, 777, 8, 2, 128, torch.bfloat16, causal=True, deterministic=True)
    assert fast_calls() == before + 2, "the second backward went through JITFunction.run"
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    _run(31, 1, 777, 777, 8, 2, 128, torch.bfloat16, causal=True)
    before = fast_calls()
    _run(31, 1, 777, 777, 8, 2, 128, torch.bfloat16, causal=True)
    assert fast_calls() == before + 1, "dQ's reductions: one launch"


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_long(causal):
    """4k tokens: the rings wrap many times. Oracle: plain attention in float64 on the GPU (the
    NumPy reference's textbook formula, too slow on the CPU at this size)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn(1, 4096, h, 128, device="cuda", generator=gen).to(torch.bfloat16)
                     for h in (4, 2, 2, 4))
    out64, lse64 = plain_attention(q.double(), k.double(), v.double(), causal=causal)
    params = AttnParams(128**-0.5, -1, 0 if causal else -1)
    fast = _backward(dout, q, k, v, out64.to(q.dtype), lse64.float().contiguous(), params)
    ref = _plain_grads(q.double(), k.double(), v.double(), dout.double(), causal=causal)
    plain = _plain_grads(q, k, v, dout, causal=causal)
    for name, f, p, r in zip(("dq", "dk", "dv"), fast, plain, ref):
        assert_within(name, f, p, r, factor=GRAD_FACTOR)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal, group", [(False, 1), (True, 1), (True, 4)])
def test_hopper_varlen(causal, group, deterministic):
    """Packed sequences (zero-length ones, lengths 1 and prime, keys longer and shorter than
    queries): tiles running past a sequence's end read the next one's rows, which must not leak
    in (dK/dV: their lse2 is +inf, so P = 0; dQ: the last key tile is masked; dQ's reductions: the
    next sequence's keys get dS = 0), and no program may write another sequence's rows. Per-sequence references."""
    gen = torch.Generator().manual_seed(group + 10 * causal)
    lens_q = [300, 0, 129, 1023, 1, 640, 5]
    lens_k = [300, 5, 257, 1023, 0, 200, 0]
    nheads, head_dim, dtype = 4, 128, torch.bfloat16
    cu_q = torch.tensor([0] + list(np.cumsum(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lens_k)), dtype=torch.int32)
    q, dout = (torch.randn(int(cu_q[-1]), nheads, head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(int(cu_k[-1]), nheads // group, head_dim, generator=gen).to(dtype) for _ in range(2))
    out = torch.zeros_like(q)
    lse = torch.full((nheads, q.shape[0]), float("-inf"))
    ref = [np.zeros(t.shape) for t in (q, k, v)]
    plain = [torch.zeros(t.shape, dtype=dtype) for t in (q, k, v)]
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lq == 0 or lk == 0:
            continue  # out 0 and lse -inf (no key) / nothing to do: gradients 0
        seq = [t[None] for t in (q[rq], k[rk], v[rk], dout[rq])]
        out64, lse64 = reference.attention_naive(*_np(*seq[:3]), causal=causal)
        out[rq], lse[:, rq] = torch.from_numpy(out64[0]).to(dtype), torch.from_numpy(lse64[0]).float()
        grads = reference.attention_naive_grad(*_np(*seq), causal=causal)
        budget = _plain_grads(*seq, causal=causal)
        for i, rows in enumerate((rq, rk, rk)):
            ref[i][rows], plain[i][rows] = grads[i][0], budget[i][0]
    params = AttnParams(head_dim**-0.5, -1, 0 if causal else -1)
    fast = _backward(dout.cuda(), q.cuda(), k.cuda(), v.cuda(), out.cuda(), lse.cuda(), params,
                     cu_seqlens_q=cu_q.cuda(), cu_seqlens_k=cu_k.cuda(), max_seqlen_q=max(lens_q),
                     max_seqlen_k=max(lens_k), deterministic=deterministic)
    for name, f, p, r in zip(("dq", "dk", "dv"), fast, plain, ref):
        assert_within(name, f, p, r, factor=GRAD_FACTOR)


def test_hopper_dispatch(monkeypatch):
    """attn_bwd (and so flash_attn_func's backward) goes to hopper_attn_bwd by default; with
    ``TILEATTN_HOPPER=0`` the portable kernels run."""
    import tileattn

    calls = []
    real = backward.hopper_attn_bwd
    monkeypatch.setattr(backward, "hopper_attn_bwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    backward.clear_plans()
    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    tileattn.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert calls == [1] and torch.isfinite(q.grad).all()
    monkeypatch.setenv("TILEATTN_HOPPER", "0")
    backward.clear_plans()
    tileattn.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert calls == [1]
