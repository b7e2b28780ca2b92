"""Ring attention with ring-flash-attention's names: exact attention over sharded sequences.

Each rank of ``group`` holds its shard of the queries, keys and values (``shard.py`` says how
sequences are cut) and gets back its rows of the output of the whole sequence:

* ``ring_flash_attn_func``: contiguous shards, rank r holds tokens [r S/W, (r+1) S/W);
* ``zigzag_ring_flash_attn_func``: zigzag shards (chunks r and 2W-1-r of 2W), balanced when causal;
* ``ring_flash_attn_varlen_func`` / ``zigzag_ring_flash_attn_varlen_func``: packed documents,
  each cut contiguously / zigzag, with the local ``cu_seqlens``;
* their ``_kvpacked`` / ``_qkvpacked`` forms; ``llama3.py`` holds the all-gather form for packed
  batches.

Arguments, order and meaning as in ring-flash-attention (and flash-attn): ``dropout_p,
softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group``; the
keyword ``softcap`` is tileattn's addition. ``causal`` and ``window_size`` are about GLOBAL
positions: query i sees key j iff ``i - window_left <= j <= i + window_right`` (causal: right = 0).
Returns the output, or with ``return_attn_probs`` ``(out, softmax_lse, None)``, the LSE of the
local rows ((batch, nheads, seqlen_local); packed: (nheads, total_local)), fp32 (float64 for
float64 inputs on the CPU path, as the single call). Differentiable in q, k, v; every rank must
call with the same shapes and options: on CPU tensors (and on CUDA ones with
``TILEATTN_DEBUG_CHECKS=1``) the ranks compare their calls first and all raise if they differ
or any rank refuses its inputs (``settle``). GQA/MQA: nheads % nheads_k == 0. Runs on gloo
(CPU tensors) and NCCL (CUDA).

v may have a head dim of its own, headdim_v (MLA trains with q/k of 192 and v of 128): the
output and dv have it, dq and dk q/k's. (The ``_kvpacked`` / ``_qkvpacked`` forms take one head
dim, as their packing does.) Gradients on the Triton backend take head dims up to 256, as for
the single-GPU calls (a clear error before anything runs otherwise); the CPU tiles take any.

``learnable_sink`` ((nheads,) fp32, tileattn's addition) joins each row's softmax once: the
ring merges it into the final state. Its gradient is this rank's rows' share (sum it across the
ranks as for any replicated parameter). The returned LSE is differentiable: a gradient reaching
it enters every call's backward as ``dlse``.

``alibi_slopes`` ((nheads,) or (batch, nheads) fp32; for the varlen forms batch = documents)
measure each distance globally: every block's call moves its diagonal to where the block sits
in the sequence (``plan.window_pair``, ``AttnParams.diag_shift``).

``dropout_p`` drops the elements the single-GPU call drops with the same seed
(``flash_attn_func`` on the whole sequences, ``flash_attn_varlen_func`` on the whole packed
batch with the global ``cu_seqlens``): each call hashes the coordinates its elements have there
(batch row, or document index in the global ``cu_seqlens``; head; positions in the sequence:
``AttnParams.dropout_base``), so each pair of segments of a sequence is its own call.
The seed comes from each rank's generator of the inputs' device: seed every rank alike
(``torch.manual_seed``) for one mask across the ranks, as the single-GPU call would draw it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..ops import _validate as V
from ..ops.attention import with_dropout_seed
from .comm import Peers, agree, signature
from .engine import Call, Plan, backward_inputs, ring_bwd, ring_fwd, sink_grad
from .plan import dense_pairs, fast_blocks, is_fast

__all__ = [
    "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]


# ----------------------------------------------------------------------------- plans


class DensePlan(Plan):
    """(batch, seqlen_local, heads, dim) shards, contiguous or zigzag."""

    packed = False

    def __init__(self, world_size: int, length: int, params, zigzag: bool, alibi=None):
        self.world_size, self.length, self.params, self.zigzag, self.alibi = world_size, length, params, zigzag, alibi
        self._calls = {}

    def calls(self, rank: int, src: int) -> list[Call]:
        if (rank, src) not in self._calls:
            pairs = dense_pairs(rank, src, self.world_size, self.length, self.params, self.zigzag,
                                exact=_exact(self.params, self.alibi))
            self._calls[rank, src] = [Call(p.q, p.kv, p.params, alibi=self.alibi) for p in pairs]
        return self._calls[rank, src]


class VarlenPlan(Plan):
    """Packed documents, each cut on its own: document b's local rows [a, a + n) hold its chunk r
    of W (contiguous) or its chunks r then 2W-1-r of 2W (zigzag, n/2 rows each). Without a window
    the documents go through the backend together (zigzag halves gathered by index with
    ``cu_seqlens // 2``); with one, each document's pairs have their own moved window, so each
    is its own call, as with ALiBi or dropout (``plan.window_pair``'s exact calls; dropout hashes
    document b as the single call's batch entry b)."""

    packed = True

    def __init__(self, world_size: int, cu_seqlens: torch.Tensor, max_seqlen: int, params, zigzag: bool,
                 alibi=None):
        self.world_size, self.params, self.zigzag, self.alibi = world_size, params, zigzag, alibi
        self.bounds = cu_seqlens.tolist()
        self.length = self.bounds[-1]
        self._calls = {}
        self.parts = {"all": (slice(0, self.length), cu_seqlens, max_seqlen)}
        if zigzag and self._fast():
            device = cu_seqlens.device
            docs = list(zip(self.bounds[:-1], self.bounds[1:]))  # built on the host: not a default device
            first = [torch.arange(a, a + (b - a) // 2, device="cpu") for a, b in docs]
            second = [torch.arange(a + (b - a) // 2, b, device="cpu") for a, b in docs]
            half_cu = cu_seqlens // 2
            self.parts["first"] = (torch.cat(first).to(device), half_cu, max_seqlen // 2)
            self.parts["second"] = (torch.cat(second).to(device), half_cu, max_seqlen // 2)

    def calls(self, rank: int, src: int) -> list[Call]:
        if (rank, src) in self._calls:
            return self._calls[rank, src]
        out = []
        if self._fast():
            full = replace(self.params, window_left=-1, window_right=-1)
            causal = replace(self.params, window_left=-1, window_right=0)
            for q, kv, c in fast_blocks(rank, src, self.params, self.zigzag):
                (q_rows, cu_q, max_q), (kv_rows, cu_k, max_k) = self.parts[q], self.parts[kv]
                out.append(Call(q_rows, kv_rows, causal if c else full, cu_q, cu_k, max_q, max_k))
        else:
            exact = _exact(self.params, self.alibi)
            for doc, (a, b) in enumerate(zip(self.bounds[:-1], self.bounds[1:])):
                alibi = None if self.alibi is None else self.alibi[doc:doc + 1]
                # the single call hashes document doc's elements as batch doc (its index in cu_seqlens)
                params = replace(self.params, dropout_base=(doc, 0, 0, 0))
                for p in dense_pairs(rank, src, self.world_size, b - a, params, self.zigzag, exact=exact):
                    out.append(Call(slice(a + p.q.start, a + p.q.stop), slice(a + p.kv.start, a + p.kv.stop), p.params,
                                    alibi=alibi))
        self._calls[rank, src] = out
        return out

    def _fast(self) -> bool:
        """All documents in one call per block (no window beyond causality, no ALiBi, no dropout)."""
        return is_fast(self.params) and not _exact(self.params, self.alibi)


def _exact(params, alibi) -> bool:
    """Whether each call must know where its elements sit in the sequence: ALiBi (distances) and
    dropout (the mask hashes positions)."""
    return alibi is not None or params.dropout_p > 0


# ----------------------------------------------------------------------------- autograd


class RingFlashAttnFunc(torch.autograd.Function):
    """Forward and backward both run around the ring of ``group``, following ``plan``;
    differentiable in q, k, v, the sinks and the returned LSE."""

    @staticmethod
    def forward(ctx, q, k, v, sink, plan, group, deterministic):
        out, lse = ring_fwd(q, k, v, plan, Peers(group), sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.plan, ctx.group, ctx.deterministic = plan, group, deterministic
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout, dlse = backward_inputs(dout, dlse, out)
        dq, dk, dv = ring_bwd(dout, q, k, v, out, lse, ctx.plan, Peers(ctx.group), ctx.deterministic, dlse)
        dsink = None if sink is None else sink_grad(dout, out, lse, dlse, sink)
        return dq, dk, dv, dsink, None, None, None


# ----------------------------------------------------------------------------- validation


def ring_options(name: str, q, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs, group):
    """Scalar options of a ring call as AttnParams (with dropout, the seed drawn from the inputs'
    device generator, as the single-GPU calls draw it); refuses bad options and a missing process
    group before anything is computed or sent."""
    params = V.make_params(q.shape[-1], softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, dropout_p=dropout_p)
    V.check_flags(deterministic=deterministic, return_attn_probs=return_attn_probs)
    params = with_dropout_seed(params, q.device)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        check_group(name, group)
    return params


def check_group(name: str, group) -> None:
    """A process group this rank belongs to (None: the world), in an initialized torch.distributed.
    On a rank outside a group, ``dist.new_group`` returns ``GroupMember.NON_GROUP_MEMBER`` (an int),
    which is named as such: the members run without this rank, so it alone raises."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        if dist.is_available() and type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
            V.fail(ValueError, f"{name}: this rank is not a member of group (torch.distributed.new_group returned "
                               "GroupMember.NON_GROUP_MEMBER here): call it only on the ranks of the group")
        V.fail(TypeError, f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        V.fail(RuntimeError, f"{name} needs torch.distributed: call torch.distributed.init_process_group first "
                             "(a world of one rank works)")


def settle(name: str, group, checks, fields, q, always: bool = False, extra=None, n_extra: int = 0):
    """Run ``checks()`` (every input check of this rank; returns what the call needs) and make its
    outcome every rank's: where values are read on the host (CPU tensors; ``always``: a call that
    gathers host values anyway), the ranks all-gather (on ``q``'s device) their ``fields(result)``
    (shapes and options) and whether their checks passed (``comm.agree``), and all raise if any
    rank refused its inputs or the ranks disagree — a rank raising alone would leave the others
    waiting in the ring. On CUDA tensors (no host synchronisation; ``TILEATTN_DEBUG_CHECKS=1``
    turns it on) a rank's refusal raises on that rank only. Returns (result, every rank's
    ``extra(result)``, or None where nothing was gathered)."""
    error = result = None
    try:
        result = checks()
    except Exception as e:  # noqa: BLE001 - raised below, on every rank
        error = e
    if error is not None and (group is not None and not isinstance(group, dist.ProcessGroup)
                              or not dist.is_available() or not dist.is_initialized()):
        raise error  # no ring to tell
    check_group(name, group)
    if not isinstance(q, torch.Tensor) or not always and V.value_mode(q) != "host":
        if error is not None:
            raise error
        return result, None
    own_fields = None if error is not None else fields(result)
    own_extra = None if error is not None or extra is None else extra(result)
    return result, agree(name, Peers(group), own_fields, error, q.device, own_extra, n_extra)


def _options(name, q, params, alibi, sink, deterministic):
    """The fields every rank's call must share (``comm.signature``), beside the shapes."""
    return dict(function=_FUNCTIONS.index(name), nheads=q.shape[-2], dtype=q.dtype, softmax_scale=params.softmax_scale,
                window_left=params.window_left, window_right=params.window_right, softcap=params.softcap,
                dropout_p=params.dropout_p, alibi_slopes=alibi is not None, learnable_sink=sink is not None,
                deterministic=deterministic)


_FUNCTIONS = ("ring_flash_attn_func", "zigzag_ring_flash_attn_func", "ring_flash_attn_varlen_func",
              "zigzag_ring_flash_attn_varlen_func", "llama3_flash_attn_varlen_func")


def _ring_dense(name, q, k, v, zigzag, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                return_attn_probs, group, softcap, learnable_sink):
    def checks():
        return _check_dense(name, q, k, v, zigzag, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                            deterministic, return_attn_probs, group, softcap, learnable_sink)

    def fields(checked):
        params, sink, alibi = checked
        return signature(**_options(name, q, params, alibi, sink, deterministic), batch=q.shape[0],
                         seqlen_local=q.shape[1], nheads_k=k.shape[2], headdim=q.shape[3], headdim_v=v.shape[3])

    (params, sink, alibi), _ = settle(name, group, checks, fields, q)
    plan = DensePlan(dist.get_world_size(group), q.shape[1], params, zigzag, alibi)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    out, lse = RingFlashAttnFunc.apply(q, k, v, sink, plan, group, deterministic)
    return (out, lse, None) if return_attn_probs else out


def _check_dense(name, q, k, v, zigzag, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                 return_attn_probs, group, softcap, learnable_sink):
    V.check_qkv(q, k, v, packed=False, headdim_v=True)
    if k.shape[:2] != q.shape[:2]:
        V.fail(ValueError, f"{name}: q and k/v shards must have the same (batch, seqlen_local), got "
                           f"{tuple(q.shape[:2])} and {tuple(k.shape[:2])}")
    if zigzag and q.shape[1] % 2:
        V.fail(ValueError, f"{name}: a zigzag shard holds two equal chunks, seqlen_local must be even, "
                           f"got {q.shape[1]}")
    params = ring_options(name, q, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, return_attn_probs=return_attn_probs, group=group)
    sink = V.check_sink(learnable_sink, q, q.shape[2])
    V.check_backward(q.shape[0], q, k, v, sink)
    alibi = V.check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    return params, sink, alibi


def _unpack(name: str, packed, parts: int, dims: int):
    """Split a qkv (parts 3) or kv (parts 2) tensor on its packing axis (dim dims - 3)."""
    what = "qkv" if parts == 3 else "kv"
    axis = dims - 3
    if not isinstance(packed, torch.Tensor) or packed.dim() != dims or packed.shape[axis] != parts:
        layout = ("(batch, seqlen, " if dims == 5 else "(total, ") + f"{parts}, nheads, headdim)"
        V.fail(ValueError, f"{name}: {what} must be {layout}, got {getattr(packed, 'shape', packed)}")
    return packed.unbind(axis)


# ----------------------------------------------------------------------------- public: dense shards


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                         softcap=0.0, learnable_sink=None):
    """Attention over a sequence cut in CONTIGUOUS shards: rank r holds tokens [r S/W, (r+1) S/W).

    q (batch, seqlen_local, nheads, headdim), k, v (batch, seqlen_local, nheads_k, headdim): this
    rank's shard (``contiguous_shard``). See the module docstring for options and results.
    """
    return _ring_dense("ring_flash_attn_func", q, k, v, False, dropout_p, softmax_scale, causal, window_size,
                       alibi_slopes, deterministic, return_attn_probs, group, softcap, learnable_sink)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                  softcap=0.0, learnable_sink=None):
    """``ring_flash_attn_func`` with kv (batch, seqlen_local, 2, nheads_k, headdim)."""
    k, v = _unpack("ring_flash_attn_kvpacked_func", kv, 2, 5)
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                return_attn_probs, group, softcap=softcap, learnable_sink=learnable_sink)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                   softcap=0.0, learnable_sink=None):
    """``ring_flash_attn_func`` with qkv (batch, seqlen_local, 3, nheads, headdim)."""
    q, k, v = _unpack("ring_flash_attn_qkvpacked_func", qkv, 3, 5)
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                return_attn_probs, group, softcap=softcap, learnable_sink=learnable_sink)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                softcap=0.0, learnable_sink=None):
    """Attention over a sequence cut in ZIGZAG shards: rank r holds chunks r and 2W-1-r of 2W.

    q (batch, seqlen_local, nheads, headdim), k, v (batch, seqlen_local, nheads_k, headdim): this
    rank's shard (``zigzag_shard``; seqlen_local even). See the module docstring.
    """
    return _ring_dense("zigzag_ring_flash_attn_func", q, k, v, True, dropout_p, softmax_scale, causal, window_size,
                       alibi_slopes, deterministic, return_attn_probs, group, softcap, learnable_sink)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
    """``zigzag_ring_flash_attn_func`` with kv (batch, seqlen_local, 2, nheads_k, headdim)."""
    k, v = _unpack("zigzag_ring_flash_attn_kvpacked_func", kv, 2, 5)
    return zigzag_ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                       deterministic, return_attn_probs, group,
                                       softcap=softcap, learnable_sink=learnable_sink)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
    """``zigzag_ring_flash_attn_func`` with qkv (batch, seqlen_local, 3, nheads, headdim)."""
    q, k, v = _unpack("zigzag_ring_flash_attn_qkvpacked_func", qkv, 3, 5)
    return zigzag_ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                       deterministic, return_attn_probs, group,
                                       softcap=softcap, learnable_sink=learnable_sink)


# ----------------------------------------------------------------------------- public: packed, zigzag


def _ring_varlen(name, q, k, v, cu_seqlens, max_seqlen, zigzag, dropout_p, softmax_scale, causal, window_size,
                 alibi_slopes, deterministic, return_attn_probs, group, softcap, learnable_sink):
    def checks():
        return _check_varlen(name, q, k, v, cu_seqlens, max_seqlen, zigzag, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap,
                             learnable_sink)

    def fields(checked):  # the local offsets are the global ones // W: the same on every rank
        params, sink, alibi, max_len = checked
        return signature(**_options(name, q, params, alibi, sink, deterministic), total_local=q.shape[0],
                         nheads_k=k.shape[1], headdim=q.shape[2], headdim_v=v.shape[2], max_seqlen=max_len,
                         cu_seqlens=cu_seqlens.tolist())

    (params, sink, alibi, max_seqlen), _ = settle(name, group, checks, fields, q)
    plan = VarlenPlan(dist.get_world_size(group), cu_seqlens, max_seqlen, params, zigzag, alibi)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    out, lse = RingFlashAttnFunc.apply(q, k, v, sink, plan, group, deterministic)
    return (out, lse, None) if return_attn_probs else out


def _check_varlen(name, q, k, v, cu_seqlens, max_seqlen, zigzag, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group, softcap, learnable_sink):
    V.check_qkv(q, k, v, packed=True, headdim_v=True)
    if k.shape[0] != q.shape[0]:
        V.fail(ValueError, f"{name}: q and k/v shards must have the same number of tokens, got {q.shape[0]} "
                           f"and {k.shape[0]}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        V.fail(ValueError, f"{name}: cu_seqlens must be a 1-D int32 tensor of length batch + 1 (>= 2)")
    V.check_int32_vector("cu_seqlens", cu_seqlens, cu_seqlens.shape[0], q.device)
    max_seqlen = V.integer("max_seqlen", max_seqlen, minimum=0)
    V.check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[0], max_seqlen)
    if zigzag:
        bounds = cu_seqlens.tolist()
        odd = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if (b - a) % 2]
        if odd:
            V.fail(ValueError, f"{name}: each document's local rows are two equal chunks, so local lengths must "
                               f"be even, got {odd}")
    params = ring_options(name, q, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                          deterministic=deterministic, return_attn_probs=return_attn_probs, group=group)
    sink = V.check_sink(learnable_sink, q, q.shape[1])
    V.check_backward(cu_seqlens.shape[0] - 1, q, k, v, sink)
    alibi = V.check_alibi(alibi_slopes, cu_seqlens.shape[0] - 1, q.shape[1], q.device)
    return params, sink, alibi, max_seqlen


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
    """Attention over packed documents, each cut in W contiguous chunks (``contiguous_shard_varlen``).

    q (total_local, nheads, headdim), k, v (total_local, nheads_k, headdim): document after
    document, this rank's chunk r of each; ``cu_seqlens`` int32 (batch + 1) the LOCAL offsets
    (the global ones // W) and ``max_seqlen`` the largest local length. LSE (nheads, total_local).
    See the module docstring.
    """
    return _ring_varlen("ring_flash_attn_varlen_func", q, k, v, cu_seqlens, max_seqlen, False, dropout_p,
                        softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                        softcap, learnable_sink)


def ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
    """``ring_flash_attn_varlen_func`` with kv (total_local, 2, nheads_k, headdim)."""
    k, v = _unpack("ring_flash_attn_varlen_kvpacked_func", kv, 2, 4)
    return ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                       window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                       softcap=softcap, learnable_sink=learnable_sink)


def ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                          causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
    """``ring_flash_attn_varlen_func`` with qkv (total_local, 3, nheads, headdim)."""
    q, k, v = _unpack("ring_flash_attn_varlen_qkvpacked_func", qkv, 3, 4)
    return ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                       window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                       softcap=softcap, learnable_sink=learnable_sink)


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None, *, softcap=0.0, learnable_sink=None):
    """Attention over packed documents, each zigzag-cut across the ranks (``zigzag_shard_varlen``).

    q (total_local, nheads, headdim), k, v (total_local, nheads_k, headdim); ``cu_seqlens``
    int32 (batch + 1) the LOCAL offsets (the global ones // W; every local length even) and
    ``max_seqlen`` the largest local length. Document b's local rows hold its chunk r, then its
    chunk 2W-1-r. LSE (nheads, total_local). See the module docstring.
    """
    return _ring_varlen("zigzag_ring_flash_attn_varlen_func", q, k, v, cu_seqlens, max_seqlen, True, dropout_p,
                        softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                        softcap, learnable_sink)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                deterministic=False, return_attn_probs=False, group=None, *,
                                                softcap=0.0, learnable_sink=None):
    """``zigzag_ring_flash_attn_varlen_func`` with kv (total_local, 2, nheads_k, headdim)."""
    k, v = _unpack("zigzag_ring_flash_attn_varlen_kvpacked_func", kv, 2, 4)
    return zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                              window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                              softcap=softcap, learnable_sink=learnable_sink)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                 causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                 deterministic=False, return_attn_probs=False, group=None, *,
                                                 softcap=0.0, learnable_sink=None):
    """``zigzag_ring_flash_attn_varlen_func`` with qkv (total_local, 3, nheads, headdim)."""
    q, k, v = _unpack("zigzag_ring_flash_attn_varlen_qkvpacked_func", qkv, 3, 4)
    return zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                              window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                              softcap=softcap, learnable_sink=learnable_sink)
