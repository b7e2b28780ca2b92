"""Where every public function computes attention: ``attention()``, and the two custom ops.

``tileattn::fwd`` computes (out, lse) for dense, packed (varlen) and KV-cache layouts;
``tileattn::bwd`` computes (dq, dk, dv, dsink). Both outputs of the forward are
differentiable: the gradient reaching the LSE (a z-loss, sinks or merges computed outside)
enters the backward as ``dlse`` (``delta = rowsum(dO * O) - dlse``). ``dsink`` is the gradient
of the learnable sinks, an empty tensor when there are none. Registering them as
torch.library custom ops with fake (meta) implementations lets ``torch.compile(fullgraph=True)`` trace a model that uses
tileattn without graph breaks; ``register_autograd`` wires the backward. In eager mode
``attention()`` runs the same op bodies without the dispatcher (directly, or inside an
``autograd.Function`` when gradients are needed). Both bodies dispatch by device to a
backend (``tileattn.ops.backend``, contract in ``tileattn.contract``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor
from torch.autograd.graph import increment_version

from ..contract import AttnParams
from .backend import backend_for

__all__ = ["attention", "lse_shape", "prepare", "GraphLane"]


def lse_shape(q: Tensor, packed: bool) -> tuple[int, ...]:
    """(batch, nheads, seqlen_q) for dense q, (nheads, total_q) for packed q."""
    if packed:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("tileattn::fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
         seqused_k: Optional[Tensor], block_table: Optional[Tensor], alibi_slopes: Optional[Tensor],
         learnable_sink: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
         window_left: int, window_right: int, softcap: float, dropout_p: float, dropout_seed: int, num_splits: int,
         deterministic: bool, k_descale: Optional[Tensor] = None,
         v_descale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    # ``deterministic`` is only read by the backward (saved in _setup_context).
    params = AttnParams(softmax_scale, window_left, window_right, softcap, dropout_p, dropout_seed)
    return _run_fwd(q, k, v, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    seqused_k, block_table, num_splits, learnable_sink, k_descale, v_descale)


def _run_fwd(q, k, v, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
             block_table, num_splits, learnable_sink, k_descale=None, v_descale=None,
             out=None, backend=None) -> tuple[Tensor, Tensor]:
    """Allocate (out, lse) and let the device's backend fill them: the body of ``tileattn::fwd``.
    A given ``out`` (unit last stride) is written in place instead of a new one; a given
    ``backend`` (the module ``backend_for(q.device)`` returns) saves looking it up."""
    if out is None:  # q's dtype and device, v's head dim (new_empty: cheaper than torch.empty with both)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=_lse_dtype(q))
    (backend or backend_for(q.device)).attn_fwd(
        q, k, v, out, lse, params=params, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        seqused_k=seqused_k, block_table=block_table, num_splits=num_splits, learnable_sink=learnable_sink,
        k_descale=k_descale, v_descale=v_descale)
    return out, lse


@_fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, learnable_sink, max_seqlen_q,
              max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, dropout_seed, num_splits,
              deterministic, k_descale=None, v_descale=None):
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    lse = q.new_empty(lse_shape(q, cu_seqlens_q is not None), dtype=_lse_dtype(q))
    return out, lse


@torch.library.custom_op("tileattn::bwd", mutates_args=())
def _bwd(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
         cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], alibi_slopes: Optional[Tensor],
         learnable_sink: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
         window_left: int, window_right: int, softcap: float, dropout_p: float, dropout_seed: int,
         deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink,
                    max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p,
                    dropout_seed, deterministic)


def _dsink_like(q: Tensor, learnable_sink: Optional[Tensor]) -> Tensor:
    """The dsink output: fp32 (nheads,) with sinks, else an empty placeholder (an op returns tensors)."""
    return q.new_empty(0 if learnable_sink is None else learnable_sink.shape[0], dtype=torch.float32)


def _run_bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink, max_seqlen_q,
             max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, dropout_seed,
             deterministic) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Allocate (dq, dk, dv, dsink) and let the device's backend fill them: the body of ``tileattn::bwd``."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = _dsink_like(q, learnable_sink)
    params = AttnParams(softmax_scale, window_left, window_right, softcap, dropout_p, dropout_seed)
    backend_for(q.device).attn_bwd(
        dout, q, k, v, out, lse, dq, dk, dv, params=params, alibi_slopes=alibi_slopes,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, deterministic=deterministic, dlse=dlse, learnable_sink=learnable_sink,
        dsink=None if learnable_sink is None else dsink)
    return dq, dk, dv, dsink


@_bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink, max_seqlen_q,
              max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, dropout_seed, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _dsink_like(q, learnable_sink)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, learnable_sink, max_seqlen_q,
     max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, dropout_seed, num_splits,
     deterministic, _k_descale, _v_descale) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink)
    ctx.has_cache = seqused_k is not None or block_table is not None
    ctx.scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                   dropout_p, dropout_seed)
    ctx.deterministic = deterministic


def _gradients(ctx, dout, dlse, bwd) -> tuple:
    """(dq, dk, dv, None x 5, dsink or None, None x 12) from what _setup_context saved, through
    ``bwd`` (the op or its body). ``dout`` or ``dlse`` may be None (that output unused)."""
    _no_cache_gradients(ctx.has_cache)
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink = ctx.saved_tensors
    dout = _grad_out(dout, out)
    dq, dk, dv, dsink = bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink,
                            *ctx.scalars, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 5 + (None if learnable_sink is None else dsink,) + (None,) * 12


def _backward(ctx, dout, dlse):
    return _gradients(ctx, dout, dlse, _bwd)


_fwd.register_autograd(_backward, setup_context=_setup_context)


def _grad_out(dout, out):
    """The output's gradient as the backends take it: zeros when the output went unused (None), a
    unit last stride (autograd hands over any gradient; an expanded one has stride 0)."""
    if dout is None:
        return torch.zeros_like(out)
    return dout if dout.stride(-1) == 1 else dout.clone(memory_format=torch.contiguous_format)  # V.last_dim_contiguous


def _no_cache_gradients(has_cache: bool) -> None:
    if has_cache:
        raise NotImplementedError("tileattn: no gradients through a KV cache (seqused_k / block_table)")


class _Call:
    """What one eager ``attention()`` call that autograd records passes besides the tensors the
    backward reads (q, k, v, the offsets, ALiBi slopes, sinks): one argument of
    ``_EagerAttention.apply`` instead of 14 (each argument of ``Function.apply`` costs host
    time: 21 of them ~4 µs more than 5 on the 2-core CPU machine), kept by its context for the
    backward. ``params`` is the ``AttnParams`` the call was given (not rebuilt from its scalars),
    ``backend`` the module ``backend_for`` returned when the caller knew it (else None: looked up).
    A ``GraphLane`` keeps one for every call of its signature: ``fwd`` is then the backend's
    prepared forward (``prepare_fwd``) or None, and ``bwd`` its prepared backward (None: not asked
    yet; False: none); otherwise they are None and False."""

    __slots__ = ("params", "max_seqlen_q", "max_seqlen_k", "seqused_k", "block_table", "num_splits", "deterministic",
                 "k_descale", "v_descale", "backend", "fwd", "bwd")

    def __init__(self, params: AttnParams, max_seqlen_q: int, max_seqlen_k: int, seqused_k, block_table,
                 num_splits: int, deterministic: bool, k_descale, v_descale, backend, fwd=None, bwd=False):
        self.params, self.max_seqlen_q, self.max_seqlen_k = params, max_seqlen_q, max_seqlen_k
        self.seqused_k, self.block_table, self.num_splits = seqused_k, block_table, num_splits
        self.deterministic, self.k_descale, self.v_descale = deterministic, k_descale, v_descale
        self.backend, self.fwd, self.bwd = backend, fwd, bwd


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the custom op's, for eager autograd without the dispatcher.

    ``torch.library`` ops pay a Python dispatch of every argument on each call (about 200 µs
    on the 2-core CPU machine, ``python benchmarks/overhead.py``-style timing of a tiny
    problem), which a short training step feels; torch.compile still sees the op. The options
    come as one ``_Call``, after q, k, v; the optional tensors (offsets, ALiBi slopes, sinks) follow
    only when one is given (``_record``: each argument of ``apply``, a None too, costs host time),
    and the backward returns a gradient per input given. A graph lane's forward takes its prepared
    launch when it has one (``_Call.fwd``), and its backward after the first goes to the prepared
    launch (``_Call.bwd``) which the first prepares.
    """

    @staticmethod
    def forward(ctx, q, k, v, call, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, learnable_sink=None):
        if call.fwd is not None:
            out, lse = call.fwd(q, k, v, alibi_slopes, learnable_sink, call.seqused_k, call.block_table,
                                call.k_descale, call.v_descale)
        else:
            out, lse = _run_fwd(q, k, v, call.params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, call.max_seqlen_q,
                                call.max_seqlen_k, call.seqused_k, call.block_table, call.num_splits, learnable_sink,
                                call.k_descale, call.v_descale, backend=call.backend)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink)
        ctx.call = call
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros to read)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        call = ctx.call
        _no_cache_gradients(call.seqused_k is not None or call.block_table is not None)
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink = ctx.saved_tensors
        dout = _grad_out(dout, out)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsink = None if learnable_sink is None else _dsink_like(q, learnable_sink)
        bwd = call.bwd
        if bwd:
            bwd(dout, dlse, q, k, v, out, lse, dq, dk, dv, alibi_slopes, learnable_sink, dsink)
        else:
            backend = call.backend or backend_for(q.device)
            options = dict(params=call.params, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k, max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k,
                           deterministic=call.deterministic, dlse=dlse, learnable_sink=learnable_sink, dsink=dsink)
            backend.attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, **options)
            if bwd is None:  # a graph lane's first backward: its later ones decided once (tuned by now)
                prepare_bwd = getattr(backend, "prepare_bwd", None)
                prepared = prepare_bwd and prepare_bwd(dout, q, k, v, out, lse, dq, dk, dv, **options)
                call.bwd = prepared or False
        if len(ctx.needs_input_grad) == 4:  # a call without the optional tensors (``_record``)
            return dq, dk, dv, None
        return dq, dk, dv, None, None, None, None, dsink


def _record(q, k, v, call, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink):
    """``_EagerAttention.apply`` with the optional tensors passed only when one is given (four None
    arguments fewer through ``Function.apply``: ~0.8 µs on the 2-core CPU machine)."""
    if cu_seqlens_q is None and cu_seqlens_k is None and alibi_slopes is None and learnable_sink is None:
        return _EagerAttention.apply(q, k, v, call)
    return _EagerAttention.apply(q, k, v, call, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink)


class GraphLane:
    """``prepare``'s lane for a signature whose calls autograd records (inputs that require grad,
    grad mode on; dense, no dropout): ``lane(q, k, v, alibi_slopes, learnable_sink, None, None,
    None, None)`` is ``attention()`` with the signature's options, which the lane holds as one
    ``_Call`` made once (the backend known, the options converted), with the backend's prepared
    forward (``prepare_fwd``, as a no-graph lane's) where it gives one; its backward, after the
    first, takes the backend's prepared launch (``prepare_bwd``). ``calls`` counts its calls."""

    __slots__ = ("call", "calls")

    def __init__(self, call: _Call):
        self.call, self.calls = call, 0

    def __call__(self, q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale, v_descale):
        self.calls += 1
        return _record(q, k, v, self.call, None, None, alibi_slopes, learnable_sink)


def attention(q: Tensor, k: Tensor, v: Tensor, params: AttnParams, *, alibi_slopes=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, seqused_k=None, block_table=None,
              num_splits=1, deterministic=False, learnable_sink=None, k_descale=None, v_descale=None,
              out=None, backend=None) -> tuple[Tensor, Tensor]:
    """(out, lse), with autograd when inputs require grad (lse and learnable_sink included).

    ``k_descale``/``v_descale`` go with an FP8 cache. A given ``out`` receives the output and is
    returned: written in place by the kernels when no graph is recorded and its last dim is
    contiguous, else copied into (the custom op allocates its own output). ``backend``: the
    module ``backend_for(q.device)`` returns, when the caller already knows it.

    When no graph is being recorded (no input needs a gradient, or grad mode is off) the
    op's body runs directly; in eager autograd ``_EagerAttention`` wraps the same forward and
    backward. Both skip the dispatcher's per-call cost, which matters to decoding and to short
    training steps. Under torch.compile the custom op (with its fake kernel) is what is traced;
    it passes ``params``' six scalars of the contract (the public functions set no others).
    A public function's memo entry may hold a prepared launch (``prepare``) that its later calls
    take instead of this function.
    """
    if getattr(_forward_ad, "_current_level", -1) >= 0:  # a forward-mode AD level is open (~0.05 us to ask)
        _no_tangents(q, k, v, alibi_slopes, learnable_sink)
    if torch.compiler.is_compiling():
        return _into(out, _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
                               learnable_sink, int(max_seqlen_q), int(max_seqlen_k), params.softmax_scale,
                               params.window_left, params.window_right, params.softcap, params.dropout_p,
                               params.dropout_seed, int(num_splits), bool(deterministic), k_descale, v_descale))
    if not _needs_graph(q, k, v, learnable_sink):
        direct = out is None or out.stride(-1) == 1
        res = _run_fwd(q, k, v, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                       int(max_seqlen_k), seqused_k, block_table, int(num_splits), learnable_sink, k_descale,
                       v_descale, out if direct else None, backend)
        if out is None:
            return res
        if direct:  # the Triton kernels wrote out through its pointer: its version counter, as an in-place op's
            increment_version(out)
            return res
        return _into(out, res)
    call = _Call(params, int(max_seqlen_q), int(max_seqlen_k), seqused_k, block_table, int(num_splits),
                 bool(deterministic), k_descale, v_descale, backend)
    return _into(out, _record(q, k, v, call, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink))


def _no_tangents(*tensors) -> None:
    """Refuse inputs that carry a forward-mode AD tangent (``torch.autograd.forward_ad``): there is
    no jvp rule, so the tangent would be dropped silently (the Triton kernels) or fail inside torch
    (the CPU tiles)."""
    for t in tensors:
        if t is not None and _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError("tileattn has no forward-mode AD (jvp): an input carries a tangent "
                                      "(torch.autograd.forward_ad.make_dual); use reverse mode (backward)")


def _needs_graph(q, k, v, learnable_sink) -> bool:
    """Whether autograd records this call: grad mode on and an input that requires grad."""
    sink_grad = learnable_sink is not None and learnable_sink.requires_grad
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or sink_grad)


def prepare(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, params: AttnParams, *, alibi_slopes,
            max_seqlen_q: int, max_seqlen_k: int, seqused_k, block_table, num_splits: int, learnable_sink, k_descale,
            backend, deterministic: bool = False):
    """``attention()`` decided once for every call with these tensors' metadata and these options
    (a memo entry's, ``_memo``), after a call of them returned (out, lse) (its plan is tuned by
    then). When autograd records the calls: a ``GraphLane`` (dense calls without dropout). Else
    the backend's prepared launch (``gpu.prepared.PreparedFwd``, ``cpu.prepared.PreparedFwd``).
    Both take ``(q, k, v, alibi_slopes, learnable_sink, seqused_k, block_table, k_descale,
    v_descale)`` and return (out, lse) allocated alike. None where a call must decide per call:
    under torch.compile, a graph over a KV cache or with dropout, on a backend without
    ``prepare_fwd`` or a call it declines. Dense tensors only."""
    if torch.compiler.is_compiling():
        return None
    graph = _needs_graph(q, k, v, learnable_sink)
    if graph and (seqused_k is not None or block_table is not None or k_descale is not None or params.dropout_p > 0):
        return None
    prepare_fwd = getattr(backend, "prepare_fwd", None)
    fwd = prepare_fwd and prepare_fwd(q, k, v, out, lse, params=params, alibi_slopes=alibi_slopes,
                                      max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                                      seqused_k=seqused_k, block_table=block_table, num_splits=int(num_splits),
                                      learnable_sink=learnable_sink, k_descale=k_descale)
    if not graph:
        return fwd
    return GraphLane(_Call(params, int(max_seqlen_q), int(max_seqlen_k), None, None, int(num_splits),
                           bool(deterministic), None, None, backend, fwd=fwd, bwd=None))


def _into(out, res):
    """``res`` = (o, lse), with o copied into ``out`` and out returned in its place when one is given."""
    if out is None:
        return res
    out.copy_(res[0])
    return out, res[1]
