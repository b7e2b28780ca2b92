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


class _Record:
    """Stands in for a Gluon kernel: ``kernel[grid](*args, **kwargs)`` records (nothing compiled)."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel.fn.__name__, grid, args, kwargs))

    def __getattr__(self, name):  # arg_names, params, do_not_specialize: the launch path reads them
        return getattr(self.kernel, name)


def _meta(arg):
    """What a recorded launch argument must match across two calls: a descriptor's fields but its
    base, a tensor's layout, else the value."""
    if isinstance(arg, torch.Tensor):
        return ("tensor", arg.shape, arg.stride(), arg.dtype)
    if hasattr(arg, "block_shape"):
        return ("descriptor", arg.base.shape, arg.base.stride(), arg.block_shape, arg.shape, arg.strides, arg.layout)
    return arg


@TRITON_ONLY
@pytest.mark.skipif(DEV != "cpu", reason="stands in for the Gluon kernels")
def test_prepared_launches_ask_the_hopper_rules_on_every_call(monkeypatch):
    """The lane's forward and backward ask the part of the Hopper rules a call can change on every
    call (the environment's switches, the pointers' alignment), as ``attn_fwd`` and ``attn_bwd``
    ask the whole rules: with the device stood in for, ``TILEATTN_HOPPER=1`` sends a call to the
    Gluon kernels (recorded here: the signature's kept launches, with the launches and arguments of
    the full path, an empty memo), ``TILEATTN_HOPPER=0`` or a q 2 bytes off alignment to the
    portable kernels, bitwise the full path's gradients, in any order; the backward keeps a plan
    for each answer."""
    from tileattn.gpu import hopper, hopper_bwd
    from tileattn.kernels import attn_bwd_hopper, attn_fwd_hopper

    rows, shape = prepared.MIN_SEQLEN_Q, (1, prepared.MIN_SEQLEN_Q, 2, 64)  # a prefill shape the Gluon kernels take
    gen = torch.Generator().manual_seed(104)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    flat = torch.zeros(q.numel() + 8, dtype=torch.bfloat16, requires_grad=True)
    odd = flat[1:1 + q.numel()].view(shape)  # q's values and layout, 2 bytes past an aligned base
    with torch.no_grad():
        odd.copy_(q)
    launched = []
    for module, name in ((attn_fwd_hopper, "_attn_fwd_hopper_kernel"), (attn_bwd_hopper, "_attn_bwd_hopper_kernel")):
        monkeypatch.setattr(module, name, _Record(getattr(module, name), launched))
    for module in (hopper, hopper_bwd):  # the device as an H200's, compiled kernels (not the interpreter)
        monkeypatch.setattr(module, "device_kind_reason", lambda q: None)
    monkeypatch.setattr(hopper, "interpreting", lambda: False)

    def grads(q_):
        out = tileattn.flash_attn_func(q_, k, v)
        return torch.autograd.grad(out, (q_, k, v), dout)

    def full_path(q_):
        entries = dict(dense_ops._CHECKED.entries)
        dense_ops._CHECKED.clear()
        try:
            return grads(q_)
        finally:
            dense_ops._CHECKED.entries.update(entries)  # the lane back, prepared as before

    monkeypatch.setenv("TILEATTN_HOPPER", "0")
    expect = grads(q)  # the full path (and the prepared launches' first call), portable
    for case in ("off", "on", "off", "odd", "on", "on", "odd"):
        monkeypatch.setenv("TILEATTN_HOPPER", "0" if case == "off" else "1")
        launched.clear()
        got = grads(odd if case == "odd" else q)
        if case == "on":
            assert launched[0][2][0].base.data_ptr() == q.data_ptr()  # the forward's q descriptor: this call's q
            lane_launches = list(launched)
            launched.clear()
            full_path(q)
            assert [(n, g, kw) for n, g, _, kw in lane_launches] == [(n, g, kw) for n, g, _, kw in launched]
            assert [[_meta(a) for a in args] for _, _, args, _ in lane_launches] == [
                [_meta(a) for a in args] for _, _, args, _ in launched]
            assert [name for name, *_ in lane_launches] == ["_attn_fwd_hopper_kernel"] + ["_attn_bwd_hopper_kernel"] * 2
        else:
            assert launched == [], case
            for g, e in zip(got, expect):
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=case)
    fwd, bwd = lane().call.fwd, lane().call.bwd
    assert lane().calls == 7 and bwd.calls == 6
    assert isinstance(fwd.hopper, hopper.HopperFwd) and fwd.hopper.launch.launch is not None
    assert all(launch.launch is not None for launch in bwd.hopper.launches)
    assert bwd.plans[True].hopper and not bwd.plans[False].hopper


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
