"""The graph lane (``tileattn.ops._custom.GraphLane``, ``tileattn.gpu.backward.prepare_bwd``): a
training signature's options, forward and backward decided once. It must be taken (counted), give
each step its own gradients (new values every step), send what it was not prepared for (another
gradient layout, a gradient reaching the LSE, forgotten plans) to ``attn_bwd``, ask the Hopper
rules on every call, and leave dropout to the full path.

On the Triton backend: CUDA tensors on a GPU, else CPU tensors in Triton's interpreter; without a
GPU the lane's own tests also run on the CPU tiles (no prepared backward there)."""

import pytest
import torch

import tileattn
from tileattn import reference as R
from tileattn.gpu import backward as B
from tileattn.gpu import prepared
from tileattn.ops import attention as dense_ops
from tileattn.ops._custom import GraphLane
from tolerance import GRAD_FACTOR, assert_within, plain_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = ((1, 37, 4, 16), (1, 45, 2, 16))  # q, and k / v: GQA 2, lengths that cut tiles oddly


@pytest.fixture(autouse=True, params=["triton", "cpu"] if DEV == "cpu" else ["triton"])
def backend(request, monkeypatch):
    """The Triton kernels (the interpreter without a GPU) or, without a GPU, also the CPU tiles;
    a fresh memo."""
    if DEV == "cpu":
        monkeypatch.setenv("TILEATTN_BACKEND", request.param)
    dense_ops._CHECKED.clear()
    return request.param


TRITON_ONLY = pytest.mark.parametrize("backend", ["triton"], indirect=True)


def lane():
    """The graph lane of the memo's one signature that records a graph."""
    (entry,) = [e for e in dense_ops._CHECKED.entries.values() if isinstance(e.lane, GraphLane)]
    return entry.lane


def leaves(gen, dtype=torch.bfloat16):
    q = torch.randn(SHAPES[0], generator=gen).to(dtype)
    k, v = (torch.randn(SHAPES[1], generator=gen).to(dtype) for _ in range(2))
    return [t.to(DEV).requires_grad_() for t in (q, k, v)]


def step(q, k, v, dout, **opts):
    """One training step as prefill.py times it: gradients dropped, forward, backward."""
    for t in (q, k, v):
        t.grad = None
    out = tileattn.flash_attn_func(q, k, v, **opts)
    out.backward(dout)
    return out, [t.grad.clone() for t in (q, k, v)]


def assert_gradients(grads, q, k, v, dout, **opts):
    """dq, dk, dv against the float64 reference, within the rule of TESTING.md."""
    cpu = [t.detach().cpu() for t in (q, k, v, dout)]
    ref = R.attention_naive_grad(*(t.double().numpy() for t in cpu), **opts)
    qp, kp, vp = (t.clone().requires_grad_() for t in cpu[:3])
    plain_attention(qp, kp, vp, **opts)[0].backward(cpu[3])
    for name, fast, plain, r in zip("qkv", grads, (qp.grad, kp.grad, vp.grad), ref):
        assert_within(f"d{name}", fast.cpu(), plain, r, factor=GRAD_FACTOR)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(6, 3), softcap=2.0)])
def test_graph_lane_is_taken_and_each_step_gets_its_gradients(backend, opts):
    """Four steps on the same leaves with new values: each its own gradients; the lane serves all
    but the first call, the prepared backward (Triton) all but the lane's first backward."""
    gen = torch.Generator().manual_seed(101)
    q, k, v = leaves(gen)
    for _ in range(4):
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        dout = torch.randn(SHAPES[0], generator=gen).to(torch.bfloat16).to(DEV)
        _, grads = step(q, k, v, dout, **opts)
        assert_gradients(grads, q, k, v, dout, **opts)
    assert lane().calls == 3
    bwd = lane().call.bwd
    if backend == "triton":
        assert isinstance(bwd, B.PreparedBwd) and bwd.calls == 2
    else:
        assert bwd is False  # the CPU tiles prepare no backward


def gradients(q, k, v, backward, **opts):
    """dq, dk, dv of a step whose backward is ``backward(out, lse)`` (lse returned: the signature
    with ``return_attn_probs``)."""
    for t in (q, k, v):
        t.grad = None
    out, lse, _ = tileattn.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    backward(out, lse)
    return [t.grad for t in (q, k, v)]


@TRITON_ONLY
def test_prepared_backward_sends_new_gradient_layouts_to_attn_bwd():
    """After the prepared backward is made (contiguous dO, no LSE gradient): a dO laid out heads
    first and a gradient that also reaches the LSE are not what it was prepared for and go to
    ``attn_bwd``; a sum's expanded dO is made contiguous first and takes it. Every gradient
    equals the full path's (an empty memo: no lane), bitwise."""
    gen = torch.Generator().manual_seed(102)
    q, k, v = leaves(gen)
    dout = torch.randn(SHAPES[0], generator=gen).to(torch.bfloat16).to(DEV)
    for _ in range(3):
        gradients(q, k, v, lambda o, lse: o.backward(dout), causal=True)
    prepared_bwd = lane().call.bwd
    assert prepared_bwd.calls == 1
    dout_t = dout.transpose(1, 2).contiguous().transpose(1, 2)  # heads first in memory, last dim unit
    dlse = torch.randn(SHAPES[0][0], SHAPES[0][2], SHAPES[0][1], generator=gen).to(DEV)
    cases = {"heads-first dO": (lambda o, lse: o.backward(dout_t), False),
             "LSE gradient": (lambda o, lse: torch.autograd.backward([o, lse], [dout, dlse]), False),
             "expanded dO": (lambda o, lse: o.sum().backward(), True)}
    for name, (backward, taken) in cases.items():
        calls = prepared_bwd.calls
        got = gradients(q, k, v, backward, causal=True)
        assert prepared_bwd.calls == calls + taken, name
        entries = dict(dense_ops._CHECKED.entries)
        dense_ops._CHECKED.clear()
        expect = gradients(q, k, v, backward, causal=True)
        dense_ops._CHECKED.entries.update(entries)  # the lane back, prepared as before
        for g, e in zip(got, expect):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=name)


@TRITON_ONLY
def test_prepared_backward_after_clear_plans_plans_again():
    """New tile constants come with ``clear_plans``: the prepared backward must not launch a plan
    made before; it plans again and gives the same gradients."""
    gen = torch.Generator().manual_seed(103)
    q, k, v = leaves(gen)
    dout = torch.randn(SHAPES[0], generator=gen).to(torch.bfloat16).to(DEV)
    for _ in range(3):
        _, before = step(q, k, v, dout)
    prepared_bwd = lane().call.bwd
    (old,) = [p for p in prepared_bwd.plans if p is not None]
    B.clear_plans()
    _, after = step(q, k, v, dout)
    (new,) = [p for p in prepared_bwd.plans if p is not None]
    assert new is not old and prepared_bwd.calls == 2
    for g, e in zip(after, before):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@TRITON_ONLY
@pytest.mark.skipif(DEV != "cpu", reason="stands in for the Gluon launchers")
def test_prepared_launches_ask_the_hopper_rules_on_every_call(monkeypatch):
    """The lane's forward and backward ask the Hopper rules each call, as ``attn_fwd`` and
    ``attn_bwd`` do: a yes goes to the Hopper launchers (recorded here), a no to the portable
    kernels, in any order, and the backward keeps a plan for each answer."""
    rows = prepared.MIN_SEQLEN_Q  # a prefill shape: the forward's rule is asked too
    gen = torch.Generator().manual_seed(104)
    q, k, v = (torch.randn(1, rows, 2, 16, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(1, rows, 2, 16, generator=gen)
    answer, launched = {"yes": False}, []
    monkeypatch.setattr(prepared, "hopper_fwd_reason", lambda *a, **kw: None if answer["yes"] else "no")
    monkeypatch.setattr(B, "hopper_bwd_reason", lambda *a, **kw: None if answer["yes"] else "no")
    monkeypatch.setattr(prepared, "hopper_attn_fwd", lambda q, k, v, out, lse, **kw: launched.append(("fwd", kw)))
    monkeypatch.setattr(B, "hopper_attn_bwd", lambda *a, **kw: launched.append(("bwd", kw)))
    _, expect = step(q, k, v, dout, causal=True)  # the full path (and the prepared launches' first call)
    for yes in (False, True, False, True, False):
        answer["yes"] = yes
        launched.clear()
        _, grads = step(q, k, v, dout, causal=True)
        if yes:
            (fwd, fwd_kw), (bwd, bwd_kw) = launched
            assert (fwd, bwd) == ("fwd", "bwd") and fwd_kw["params"].window_right == 0
            assert (fwd_kw["max_seqlen_q"], fwd_kw["max_seqlen_k"], fwd_kw["learnable_sink"]) == (rows, rows, None)
            assert bwd_kw["params"] == fwd_kw["params"] and bwd_kw["cu_seqlens_q"] is None
        else:
            assert launched == []
            for g, e in zip(grads, expect):
                torch.testing.assert_close(g, e, rtol=0, atol=0)
    prepared_bwd = lane().call.bwd
    assert lane().call.fwd.hopper and all(p is not None for p in prepared_bwd.plans)
    assert prepared_bwd.plans[True].hopper and not prepared_bwd.plans[False].hopper


def test_dropout_takes_no_graph_lane():
    """A seed per call: a training signature with dropout keeps the full path."""
    gen = torch.Generator().manual_seed(105)
    q, k, v = leaves(gen, torch.float32)
    dout = torch.randn(SHAPES[0], generator=gen).to(DEV)
    for _ in range(2):
        step(q, k, v, dout, dropout_p=0.25)
    (entry,) = dense_ops._CHECKED.entries.values()
    assert entry.lane is False


def test_bad_input_after_graph_lane_steps_still_raises():
    """A kept training signature does not let a call of other shapes or options past the checks."""
    gen = torch.Generator().manual_seed(106)
    q, k, v = leaves(gen)
    dout = torch.randn(SHAPES[0], generator=gen).to(torch.bfloat16).to(DEV)
    for _ in range(2):
        step(q, k, v, dout)
    assert lane().calls == 1
    with pytest.raises(ValueError, match="batch size"):
        tileattn.flash_attn_func(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(TypeError, match="causal must be a bool"):
        tileattn.flash_attn_func(q, k, v, causal=1)
    assert lane().calls == 1


@TRITON_ONLY
@pytest.mark.parametrize("opts", [dict(causal=True, sink=True), dict(alibi=True, window_size=(8, -1)),
                                  dict(deterministic=True, softmax_scale=0.3)])
def test_lane_steps_equal_the_full_path_bitwise(opts):
    """Sinks (their gradient too), ALiBi slopes given per call, deterministic: each of five steps
    through the lane (its prepared forward and backward from the third) gives bitwise the
    gradients of the same step through the full path (an empty memo)."""
    gen = torch.Generator().manual_seed(107)
    opts = dict(opts)
    sink = torch.randn(SHAPES[0][2], generator=gen).to(DEV).requires_grad_() if opts.pop("sink", False) else None
    slopes = torch.rand(SHAPES[0][2], generator=gen).to(DEV) if opts.pop("alibi", False) else None
    q, k, v = leaves(gen)
    leaves_ = [t for t in (q, k, v, sink) if t is not None]

    def grads():
        for t in leaves_:
            t.grad = None
        out = tileattn.flash_attn_func(q, k, v, alibi_slopes=slopes, learnable_sink=sink, **opts)
        out.backward(dout)
        return [t.grad.clone() for t in leaves_]

    for _ in range(5):
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        dout = torch.randn(SHAPES[0], generator=gen).to(torch.bfloat16).to(DEV)
        got = grads()
        entries = dict(dense_ops._CHECKED.entries)
        dense_ops._CHECKED.clear()
        expect = grads()
        dense_ops._CHECKED.entries.clear()
        dense_ops._CHECKED.entries.update(entries)
        for g, e in zip(got, expect):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert lane().calls == 4 and lane().call.bwd.calls == 3
