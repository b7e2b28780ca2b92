"""Launcher of the Triton backward kernels (``tileattn.kernels.attn_bwd``).

Implements ``attn_bwd`` of the contract in ``tileattn.contract``: given dO, q, k, v, the
forward's out and lse, it writes dq, dk, dv (in their own dtype; accumulation is fp32).
"""

from __future__ import annotations

import functools

import torch
import triton

from ..dropout_mask import keep_threshold
from ..kernels.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess
from ._launch import (cdiv, config_options, contiguous_strides, index_offsets_fit_int32, int_class, launch_for,
                      next_power_of_2, plan_for)
from ._tuning import SMEM_LIMIT, Tuned, autotune_enabled, dot_types, interpreting, length_bucket, softcap_form
from .hopper import call_reason
from .hopper_bwd import HopperBwd, bwd_signature_reason, hopper_attn_bwd, hopper_bwd_reason

__all__ = ["attn_bwd", "clear_plans", "prepare_bwd", "BwdPlan", "PreparedBwd"]

_MAX_GRID_YZ = 65535
_PREPROCESS_BLOCK = 64
_PLANS: dict[tuple, "BwdPlan"] = {}
_PRE_FIRST_INT = _attn_bwd_preprocess.arg_names.index("stride_ob")  # where a plan's integers start
_FIRST_INT = {"dkdv": _attn_bwd_dkdv_kernel.arg_names.index("stride_qb"),
              "dq": _attn_bwd_dq_kernel.arg_names.index("stride_qb")}


def _shapes(head_dim_pad: int) -> list[tuple[int, int, int, int]]:
    """(resident block, streamed block, num_warps, num_stages) to try, best guess first.

    dkdv keeps a key block (BLOCK_N rows of k, v, dk, dv) resident and streams query blocks,
    dq keeps a query block resident and streams key blocks: the resident side is the large one.
    """
    if interpreting():  # small tiles: the tests walk several blocks in a few hundred tokens
        return [(32, 16, 4, 1)]
    if head_dim_pad <= 64:
        return [(128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 2), (64, 64, 4, 3)]
    if head_dim_pad <= 128:
        # the last two spill least in dK/dV (ptxas: 32 and 208 B of stack against 0.6-3 KB for the
        # others, tests/hopper_compile.py); timed on the H200, the autotuner never kept them
        # (docs/perf-notes.md: the spilling (128, 64, 8, 2 or 3) won at every size)
        return [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 5), (128, 32, 8, 3), (64, 64, 4, 3),
                (128, 16, 8, 3), (128, 32, 8, 2)]
    return [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3)]




def _smem_estimate(resident: int, streamed: int, stages: int, head_dim_pad: int, elem_size: int) -> int:
    """An estimate of one program's shared memory: two resident tiles (k, v or q, dout) and
    ``stages`` copies of the two streamed ones. Compiled for sm_90 the kernels use 60-101 % of
    it (tests/hopper_compile.py checks every kept config against the real limit); without it
    fp32 inputs would get the bf16 tiles, which do not fit."""
    return elem_size * head_dim_pad * (2 * resident + 2 * stages * streamed)


def _configs(kind: str, head_dims=(64, 128, 256), elem_size: int | None = None) -> list[triton.Config]:
    """The configs of one kernel ("dkdv" or "dq") for the given padded head dims, best guess
    first; with ``elem_size``, only those whose shared memory fits (at least the smallest)."""
    resident, streamed = ("BLOCK_N", "BLOCK_M") if kind == "dkdv" else ("BLOCK_M", "BLOCK_N")
    configs = []
    for d in head_dims:
        shapes = _shapes(d)
        if kind == "dq" and d <= 128 and not interpreting():
            # dq with 128 query rows, 32-key tiles and 4 warps made an illegal memory access on the
            # H200 (hdim 64, 64/8 heads, causal, 2 x 8k, in the autotuner's timing run; each other
            # config ran clean: docs/perf-notes.md, 2026-11-30). Until the cause is found the
            # autotuner never tries it (hdim 256's first choice, 64 rows, is kept: it runs in every
            # GPU test at that head dim).
            shapes = [sh for sh in shapes if not (sh[0] == 128 and sh[1] == 32 and sh[2] == 4)]
        if elem_size is not None:
            fitting = [sh for sh in shapes if _smem_estimate(sh[0], sh[1], sh[3], d, elem_size) <= SMEM_LIMIT]
            shapes = fitting or [min(shapes, key=lambda sh: _smem_estimate(sh[0], sh[1], sh[3], d, elem_size))]
        configs += [(r, st, w, n) for r, st, w, n in shapes if (r, st, w, n) not in configs]
    return [triton.Config({resident: r, streamed: st}, num_warps=w, num_stages=n) for r, st, w, n in configs]


def _pruner(kind: str):
    """The autotuner's early prune: the configs meant for this head dimension that fit in
    shared memory for this dtype."""
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        width = max(args["HEAD_DIM_PAD"], args["HEAD_DIM_V_PAD"])  # the configs of the wider of q/k and v
        wanted = {str(c) for c in _configs(kind, (width,), args["q_ptr"].element_size())}
        return [c for c in configs if str(c) in wanted]
    return prune


_TUNE_KEY = ["HEAD_DIM_PAD", "HEAD_DIM_V_PAD", "GROUP", "IS_VARLEN", "MASK_LEFT", "MASK_RIGHT", "HAS_DROPOUT"]


@functools.lru_cache(maxsize=None)
def _tuned(kind: str, bucket: int) -> Tuned:
    """The autotuned dkdv or dq kernel for one sequence-length bucket (``length_bucket``): one
    autotuner per bucket over the same jit function, since a key can only name kernel arguments."""
    kernel = _attn_bwd_dkdv_kernel if kind == "dkdv" else _attn_bwd_dq_kernel
    return Tuned(kernel, _configs(kind), _TUNE_KEY, _pruner(kind))


def clear_plans() -> None:
    """Forget every backward launch plan (as ``attention.clear_plans``); the plans a
    ``PreparedBwd`` holds are made again (``generation``)."""
    global generation
    _PLANS.clear()
    generation += 1


generation = 0  # how many times the plans were forgotten


def attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, params, alibi_slopes=None,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
             deterministic=False, dlse=None, learnable_sink=None, dsink=None) -> None:
    """Gradients of ``sum(out * dout) + sum(lse * dlse)`` with respect to q, k, v (and the
    learnable sinks), written into dq, dk, dv (and dsink).

    Three launches: delta = rowsum(dO * O) - dlse (with lse in log2 units and, with sinks, the
    rows' terms of dsink, summed here by torch in a fixed order), then dK/dV per key block
    and dQ per query block. The scores are recomputed from q, k and lse (no N x N buffer);
    see ``tileattn.kernels.attn_bwd`` for the math. Every gradient element is written by exactly
    one program, which sums in a fixed order (a shared key/value head's dk, dv too: its program
    walks the query heads of its group one after the other), and no atomics are used. The
    gradients are therefore bitwise reproducible run after run; ``deterministic=True`` also pins
    the tile configuration (no autotuning), so they match across processes as well.

    As the forward's, the launches are planned once per shape class (``BwdPlan``).

    On Hopper, where ``hopper_bwd_reason`` allows (sm_90, fp16/bf16, head dim 64 or 128, no
    softcap, ALiBi or dropout; ``TILEATTN_HOPPER=0`` turns it off), the Gluon kernels of
    ``gpu/hopper_bwd.py`` replace the dK/dV and dQ launches (same preprocess). At head dim 128
    their dK/dV programs also add dQ's shares to an fp32 workspace by reductions, whose order varies
    from run to run; ``deterministic=True`` takes their two-launch form instead, which writes every
    element once in a fixed order with one tile config: bitwise reproducible as well.
    """
    assert (learnable_sink is None) == (dsink is None)
    if dout.stride(-1) != 1:  # autograd hands over any gradient (an expanded one has stride 0)
        dout = dout.contiguous()
    packed = cu_seqlens_q is not None
    if not all(offsets_fit_int32(t, packed) for t in (dout, q, k, v, out, dq, dk, dv)):
        _bwd_on_copies(dout, q, k, v, out, lse, dq, dk, dv, params=params, alibi_slopes=alibi_slopes,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, deterministic=deterministic, dlse=dlse,
                       learnable_sink=learnable_sink, dsink=dsink)
        return
    plan = _plan(dout, q, k, v, out, lse, dq, dk, dv, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, deterministic, dlse, learnable_sink)
    plan.run(dout, q, k, v, out, lse, dq, dk, dv, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, dlse,
             learnable_sink, dsink)


_MAX_TILE_ROWS = 256  # no tile of the backward (portable or Gluon) has more rows


def offsets_fit_int32(t: torch.Tensor, packed: bool) -> bool:
    """Whether the backward kernels' int32 offset products stay in range for ``t`` (B, S, H, D), or
    packed (T, H, D): a head index times the head stride, and a tile's rows times the row stride
    (batch and sequence starts are int64 there; the forward kernels use int64 throughout). Every
    contiguous tensor fits; a view whose heads lie 2**31 elements apart or more (heads first,
    (B, H, S, D).transpose(1, 2) with H * S * D >= 2**31 per batch) does not."""
    row, head = (0, 1) if packed else (1, 2)
    return index_offsets_fit_int32(t, head, t.shape[head]) and index_offsets_fit_int32(t, row, _MAX_TILE_ROWS)


def _bwd_on_copies(dout, q, k, v, out, lse, dq, dk, dv, **options) -> None:
    """``attn_bwd`` on contiguous copies of the inputs, into contiguous gradients copied to dq, dk,
    dv afterwards: for tensors whose strides ``offsets_fit_int32`` refuses (read as they are, an
    offset wrapped around: a segfault in the interpreter, reads and writes out of bounds on a GPU)."""
    dout, q, k, v, out = (t.clone(memory_format=torch.contiguous_format) for t in (dout, q, k, v, out))
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (dq, dk, dv)]
    attn_bwd(dout, q, k, v, out, lse, *grads, **options)
    for dst, src in zip((dq, dk, dv), grads):
        dst.copy_(src)


def _plan(dout, q, k, v, out, lse, dq, dk, dv, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
          max_seqlen_k, deterministic, dlse, learnable_sink) -> "BwdPlan":
    """The plan of one call (``dout`` with a unit last stride): the Hopper rule asked, the key
    built, the plan looked up or made."""
    hopper = hopper_bwd_reason(dout, q, k, v, dq, dk, dv, params, alibi_slopes=alibi_slopes,
                               varlen=cu_seqlens_q is not None) is None
    key = (dout.stride(), q.shape, q.stride(), k.shape, k.stride(), v.shape[-1], v.stride(), out.stride(), lse.shape, lse.stride(),
           dq.stride(), dk.stride(), dv.stride(), q.dtype, k.dtype, v.dtype, out.dtype, dout.dtype, dq.dtype, dk.dtype,
           dv.dtype, lse.dtype, q.device,
           None if cu_seqlens_q is None else (cu_seqlens_q.numel(), cu_seqlens_q.dtype),
           None if cu_seqlens_k is None else cu_seqlens_k.dtype,
           None if alibi_slopes is None else (alibi_slopes.stride(), alibi_slopes.dtype),
           None if dlse is None else (dlse.stride(), dlse.dtype),
           None if learnable_sink is None else learnable_sink.dtype,
           max_seqlen_q, max_seqlen_k, params.window_left, params.window_right, softcap_form(q.dtype, params.softcap),
           params.dropout_p > 0, bool(deterministic), hopper)
    return plan_for(_PLANS, key, BwdPlan)


def kernel_scalars(params, nheads: int) -> tuple:
    """The dK/dV and dQ kernels' arguments after the integers, for a call of ``nheads`` query
    heads: scale, softcap, window, diagonal shift and dropout's counters, seed, threshold and
    rescale."""
    p = float(params.dropout_p)
    return (float(params.softmax_scale), float(params.softcap), int(params.window_left), int(params.window_right),
            int(params.diag_shift), *params.dropout_offsets(nheads), int(params.dropout_seed) % 2**32,
            keep_threshold(p), 1.0 / (1.0 - p) if p > 0 else 1.0)


def prepare_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q: int, max_seqlen_k: int, deterministic: bool, dlse, learnable_sink,
                dsink) -> "PreparedBwd | None":
    """``attn_bwd`` decided once for every later call whose q, k, v, out, lse, dq, dk, dv, ALiBi
    slopes and sinks have these tensors' metadata and whose options are these (the caller vouches
    for them: the ops layer's memo entry of a forward signature, ``ops._custom.GraphLane``, after
    that signature's first backward), or None where it cannot be: packed (varlen) calls,
    dropout (a seed per call) and layouts ``offsets_fit_int32`` refuses (copied per call). The
    Hopper rule's part that these fix (``bwd_signature_reason``) is asked here. The prepared launch checks per call what autograd may change (dO's strides and
    dtype, whether a gradient reaches the LSE and its layout) and, where that part said yes, asks
    the rest (``call_reason``: the environment, the pointers' alignment); anything new goes to
    ``attn_bwd``."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None or params.dropout_p > 0:
        return None
    if not all(offsets_fit_int32(t, False) for t in (dout, q, k, v, out, dq, dk, dv)):
        return None  # attn_bwd's copies, every call
    hopper = bwd_signature_reason(dout, q, k, v, dq, dk, dv, params, alibi_slopes=alibi_slopes) is None
    return PreparedBwd(params, max_seqlen_q, max_seqlen_k, bool(deterministic), (dout.stride(), dout.dtype),
                       None if dlse is None else (dlse.stride(), dlse.dtype), kernel_scalars(params, q.shape[-2]),
                       HopperBwd(params, max_seqlen_q, max_seqlen_k, bool(deterministic)) if hopper else None)


class PreparedBwd:
    """``prepare_bwd``'s launch: ``prepared(dout, dlse, q, k, v, out, lse, dq, dk, dv, alibi_slopes,
    learnable_sink, dsink)`` does what ``attn_bwd`` with the prepared options does: with dO and
    dlse laid out as at preparation, the plan of this call's Hopper decision (made by ``_plan``
    the first time, kept for both decisions), launched with the kernel scalars worked out once
    and, for the Gluon kernels, with the signature's launches (``hopper``: a ``HopperBwd``, None
    where the signature's part of the rule said no); else ``attn_bwd`` itself. ``calls`` counts
    the calls that took a kept plan."""

    __slots__ = ("params", "max_seqlen_q", "max_seqlen_k", "deterministic", "dout_meta", "dlse_meta", "scalars",
                 "hopper", "plans", "generation", "calls")

    def __init__(self, params, max_seqlen_q: int, max_seqlen_k: int, deterministic: bool, dout_meta: tuple,
                 dlse_meta, scalars: tuple, hopper: HopperBwd | None):
        self.params, self.max_seqlen_q, self.max_seqlen_k = params, max_seqlen_q, max_seqlen_k
        self.deterministic, self.dout_meta, self.dlse_meta, self.scalars = deterministic, dout_meta, dlse_meta, scalars
        self.hopper = hopper
        self.plans, self.generation, self.calls = [None, None], generation, 0

    def __call__(self, dout, dlse, q, k, v, out, lse, dq, dk, dv, alibi_slopes, learnable_sink, dsink) -> None:
        params = self.params
        if (dout.stride(), dout.dtype) != self.dout_meta or (
                (dlse is not None or self.dlse_meta is not None)
                and (None if dlse is None else (dlse.stride(), dlse.dtype)) != self.dlse_meta):
            attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, params=params, alibi_slopes=alibi_slopes,
                     max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
                     deterministic=self.deterministic, dlse=dlse, learnable_sink=learnable_sink, dsink=dsink)
            return
        if self.generation != generation:  # the plans were forgotten: their tiles may be stale
            self.plans, self.generation = [None, None], generation
        hopper = self.hopper is not None and call_reason(q, k, v, dout) is None  # as hopper_bwd_reason
        plan = self.plans[hopper]
        if plan is None:
            plan = self.plans[hopper] = _plan(dout, q, k, v, out, lse, dq, dk, dv, params, alibi_slopes, None, None,
                                              self.max_seqlen_q, self.max_seqlen_k, self.deterministic, dlse,
                                              learnable_sink)
        self.calls += 1
        plan.run(dout, q, k, v, out, lse, dq, dk, dv, params, alibi_slopes, None, None, dlse, learnable_sink, dsink,
                 self.scalars, self.hopper)


class BwdPlan:
    """The three backward launches of one shape class, built from ``attn_bwd``'s key alone."""

    def __init__(self, key: tuple):
        (do_stride, q_shape, q_stride, k_shape, k_stride, head_dim_v, v_stride, o_stride, lse_shape, lse_stride,
         dq_stride, dk_stride, dv_stride, *dtypes, device, cu_q, cu_k, alibi, dlse, sink, max_seqlen_q, max_seqlen_k,
         window_left, window_right, (has_softcap, precise_tanh), has_dropout, deterministic, self.hopper) = key
        self.deterministic = deterministic
        q_dtype = dtypes[0]
        varlen = cu_q is not None
        head_dim = q_shape[-1]
        # validated by tileattn.ops (shapes, head dims, grid limits) and by its autograd (strides)
        assert varlen == (cu_k is not None) and max(head_dim, head_dim_v) <= 256
        assert all(stride[-1] == 1 for stride in (q_stride, k_stride, v_stride, o_stride, dq_stride, dk_stride,
                                                  dv_stride))
        nheads, nheads_k = q_shape[-2], k_shape[-2]
        if varlen:
            batch = cu_q[0] - 1
            seqlen_q, seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
            lse_strides = (0, lse_stride[0], lse_stride[1])
        else:
            batch, seqlen_q, seqlen_k = q_shape[0], q_shape[1], k_shape[1]
            lse_strides = lse_stride
        assert batch <= _MAX_GRID_YZ and nheads <= _MAX_GRID_YZ
        self.empty = batch == 0 or seqlen_q == 0 and seqlen_k == 0
        if self.empty:
            return

        def rows(stride):  # (batch, row, head) strides of a (B, S, H, D) or packed (T, H, D) tensor
            return (0, stride[0], stride[1]) if varlen else stride[:3]

        # workspaces shaped like lse: delta = rowsum(dO * O) and lse2 = log2(e) lse (+inf if empty)
        self.lse_shape = lse_shape
        ws_full = contiguous_strides(lse_shape)
        # allocated like lse when lse is laid out as they are (the forward's): empty_like skips parsing a shape
        self.ws_like_lse = tuple(lse_stride) == ws_full and dtypes[-1] == torch.float32
        ws_strides = (0, ws_full[0]) if varlen else (ws_full[0], ws_full[1])
        head_dim_pad = max(16, next_power_of_2(head_dim))
        head_dim_v_pad = max(16, next_power_of_2(head_dim_v))
        width = max(head_dim_pad, head_dim_v_pad)  # tile configs are chosen for the wider of q/k and v
        elem_size = q_dtype.itemsize
        self.has_sink = sink is not None
        self.preprocess = None
        if seqlen_q > 0:
            dlse_strides = (0, 0, 0) if dlse is None else (0, *dlse[0][:2]) if varlen else dlse[0]
            self.pre_ints = (*rows(o_stride), *rows(do_stride), *lse_strides, *dlse_strides, *ws_strides, seqlen_q)
            self.pre_grid = (cdiv(seqlen_q, _PREPROCESS_BLOCK), nheads, batch)
            self.preprocess = launch_for(
                _attn_bwd_preprocess, dict(HEAD_DIM=head_dim_v, HEAD_DIM_PAD=head_dim_v_pad, BLOCK_M=_PREPROCESS_BLOCK,
                                           IS_VARLEN=varlen, HAS_DLSE=dlse is not None, HAS_SINK=sink is not None),
                {}, ((dtypes[3], dtypes[4], dtypes[-1], cu_q and cu_q[1], dlse and dlse[1], sink,
                      sink and torch.float32),
                     int_class(_attn_bwd_preprocess, _PRE_FIRST_INT, self.pre_ints)))
        self.meta = dict(GROUP=nheads // nheads_k, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEAD_DIM_V=head_dim_v,
                         HEAD_DIM_V_PAD=head_dim_v_pad, IS_VARLEN=varlen,
                         HAS_SOFTCAP=has_softcap, PRECISE_TANH=precise_tanh, HAS_ALIBI=alibi is not None,
                         HAS_DROPOUT=has_dropout,
                         MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
                         **dict(zip(("DOT_DTYPE", "DOT_PRECISION"), dot_types(q_dtype))))
        common = (*rows(q_stride), *rows(k_stride), *rows(v_stride), *rows(do_stride))
        tail = (*ws_strides, *(alibi[0] if alibi else (0, 0)), seqlen_q, seqlen_k)
        fixed = deterministic or interpreting() or not autotune_enabled()
        bucket = length_bucket(seqlen_q, seqlen_k)
        tensor_dtypes = (*dtypes, cu_q and cu_q[1], cu_k, alibi and alibi[1])
        self.kernels = []
        self.max_seqlens = (max_seqlen_q, max_seqlen_k)
        if self.hopper:  # the Gluon kernels replace both launches (hopper_attn_bwd, in run)
            return
        if seqlen_k > 0:
            ints = (*common, *rows(dk_stride), *rows(dv_stride), *tail)
            self.kernels.append(_PlannedKernel(
                "dkdv", bucket, fixed, elem_size, width, self.meta, q_dtype, ints,
                lambda m: (cdiv(seqlen_k, m["BLOCK_N"]), nheads_k, batch),
                (tensor_dtypes, window_left, window_right)))
        if seqlen_q > 0:
            ints = (*common, *rows(dq_stride), *tail)
            self.kernels.append(_PlannedKernel(
                "dq", bucket, fixed, elem_size, width, self.meta, q_dtype, ints,
                lambda m: (cdiv(seqlen_q, m["BLOCK_M"]), nheads, batch),
                (tensor_dtypes, window_left, window_right)))

    def run(self, dout, q, k, v, out, lse, dq, dk, dv, params, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
            dlse=None, learnable_sink=None, dsink=None, scalars=None, gluon=None) -> None:
        """Launch the plan on one call's tensors (they must have the plan's key); ``scalars``: the
        kernels' ``kernel_scalars(params, nheads)`` when the caller has them, else worked out here;
        ``gluon``: the Gluon launches of the caller's signature (``HopperBwd``) when it keeps them,
        else ``hopper_attn_bwd`` works them out."""
        if dsink is not None:
            dsink.zero_()
        if self.empty:
            return
        if self.ws_like_lse:
            delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
        else:
            delta = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
            lse2 = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.preprocess is not None:
            # with sinks, each row's term of -dsink (zeros where no row writes: packed tokens outside every sequence)
            sink_terms = torch.zeros(self.lse_shape, dtype=torch.float32, device=q.device) if self.has_sink else None
            self.preprocess(self.pre_grid, out, dout, lse, delta, lse2, cu_seqlens_q, dlse, learnable_sink,
                            sink_terms, *self.pre_ints)
            if sink_terms is not None:  # (B, H, Sq) or packed (H, Tq) -> (H,), summed in a fixed order
                dsink.copy_(-(sink_terms.sum(dim=1) if cu_seqlens_q is not None else sink_terms.sum(dim=(0, 2))))
        if self.hopper:  # (the plan has no portable kernels)
            if gluon is not None:
                gluon(dout, q, k, v, dq, dk, dv, lse2, delta)
            else:
                hopper_attn_bwd(dout, q, k, v, dq, dk, dv, lse2, delta, params=params, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=self.max_seqlens[0],
                                max_seqlen_k=self.max_seqlens[1], deterministic=self.deterministic)
            return
        if scalars is None:
            scalars = kernel_scalars(params, q.shape[-2])
        for kernel in self.kernels:
            grads = (dk, dv) if kernel.kind == "dkdv" else (dq,)
            kernel((q, k, v, dout, *grads, lse2, delta, cu_seqlens_q, cu_seqlens_k, alibi_slopes, *kernel.ints,
                    *scalars))


class _PlannedKernel:
    """The dkdv or dq launch of a plan: a fixed config, or the autotuner's choice once it is made."""

    def __init__(self, kind, bucket, fixed, elem_size, head_dim_pad, meta, dtype, ints, grid, signature):
        self.kind, self.meta, self.ints, self._grid = kind, meta, ints, grid
        kernel = _attn_bwd_dkdv_kernel if kind == "dkdv" else _attn_bwd_dq_kernel
        self._signature = (signature, int_class(kernel, _FIRST_INT[kind], ints))
        self._tuned = _tuned(kind, bucket)
        self._tune_key = tuple(meta[name] for name in _TUNE_KEY) + (dtype,)
        self.launch = None
        if fixed:
            self._use(_configs(kind, (head_dim_pad,), elem_size)[0])

    def _use(self, config: triton.Config) -> None:
        kernel = _attn_bwd_dkdv_kernel if self.kind == "dkdv" else _attn_bwd_dq_kernel
        self.launch = launch_for(kernel, dict(self.meta, **config.kwargs), config_options(config), self._signature)
        self.grid = self._grid(config.kwargs)

    def __call__(self, args: tuple) -> None:
        if self.launch is not None:
            self.launch(self.grid, *args)
            return
        config = self._tuned.best(self._tune_key)
        if config is None:  # the autotuner times the configs the first time its key is seen
            self._tuned.launch(self._grid, self._tune_key, args, self.meta)
            self._use(self._tuned.best(self._tune_key))
        else:
            self._use(config)
            self.launch(self.grid, *args)
