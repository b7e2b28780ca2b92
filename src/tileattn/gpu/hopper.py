"""Launcher of the Hopper forward kernel (``kernels/attn_fwd_hopper.py``) and the rule that picks it.

``attn_fwd`` of ``gpu/attention.py`` asks ``hopper_fwd_reason`` first: ``None`` means the
Hopper kernel takes the call; otherwise the string says why the portable kernel runs (the
benchmarks print it). ``TILEATTN_HOPPER=0`` turns the Hopper path off. A prepared forward
(``gpu/prepared.py``) asks the rule's two parts apart: ``fwd_signature_reason`` (shapes, dtypes,
strides, options, the device) once for its signature, ``call_reason`` (the environment, the data
pointers' alignment) on every call, and keeps its launch (``HopperFwd``, ``GluonLaunch``).

Work items of 128 query rows, each computed by two consumer warpgroups of 64 rows and one
producer warp (``kernels/attn_fwd_hopper.py``): one program per SM walks them when they cost
the same (dense, no mask) and for dense causal calls whose grouped work order holds enough
(sequence, head) pairs (``_order_group``, ``PERSISTENT_MIN_GROUP``), else one program per item. Dense
causal calls on a persistent grid take their items dynamically from a per-call counter (``DYNAMIC``,
``_causal_grid``, ``_item_counter``), which also brings groups of ``DYNAMIC_MIN_GROUP`` pairs onto it.
Tiles per head dim: (BLOCK_N, STAGES); shared memory is the two Q tiles plus STAGES K and V tiles: hdim 128
-> 32 + 2 x 2 x 32 KB = 160 KB, hdim 64 -> 16 + 4 x 2 x 16 KB = 144 KB (4 stages for ``KV_BAR``), hdim 256 -> 64 +
2 x 2 x 32 KB = 192 KB; at ``DOUBLE_Q_HEAD_DIMS`` (64) two more Q tiles, 16 KB (``Q_BUFS``). The
output goes through shared memory and one asynchronous TMA copy per warpgroup (``TMA_STORE``,
``_out_block``) for dense calls (not packed: a tile past a sequence's end would overwrite the next
one's rows; TMA clips only at the tensor's bounds) whose ``out`` has q's dtype and TMA-writable
strides, at head dims ``TMA_STORE_HEAD_DIMS``; the others store from
registers, as packed calls, split partials and an fp32 ``out`` do, and so does a later call of a
kept launch whose ``out`` is not 16-byte aligned (``HopperFwd``). Two staging tiles of 64 rows add
2 x 8 KB at hdim 64 (160 KB in all), 2 x 16 KB at 128 (192 KB) and would add 2 x 32 KB at 256 (256
KB, past the 227 KB a block may use). At hdim 128 the staging store costs registers: compiled for
sm_90 its consumers keep 112-120 bytes of per-item values on the stack against 16-40 without (none
in the key-tile loop; at hdim 64 the stack shrinks, 80 -> 40 bytes unmasked, 0 causal; table in
docs/perf-notes.md, 2026-12-01 #16); measured both ways on the H200, 128 gains all the same.
Registers: the kernel runs 12 warps (3 warpgroups), so at most
``MAXNREG`` = 168 per thread on average; the producer gives back all but ``PRODUCER_REGS`` and
each consumer thread gets ``CONSUMER_REGS`` (2 x 128 x 240 + 128 x 24 <= 168 x 384).
"""

from __future__ import annotations

import functools

import torch

from .._env import getenv
from ..kernels.common import LOG2E
from ..contract import AttnParams
from ._launch import arg_classes, cdiv, index_offsets_fit_int32, launch_for
from ._tuning import interpreting

__all__ = ["hopper_fwd_reason", "fwd_signature_reason", "call_reason", "hopper_attn_fwd", "HopperFwd", "GluonLaunch",
           "hopper_partials_reason", "hopper_partials_splits",
           "hopper_attn_partials", "HopperPartials", "HOPPER_TILES"]

HOPPER_TILES = {64: (128, 4), 128: (128, 2), 256: (64, 2)}  # head_dim -> (BLOCK_N, STAGES)
# The head dims whose output tiles go through shared memory (module docstring); 256's staging tiles do not
# fit. Measured on the H200 (docs/perf-notes.md, 2026-12-01 14:45): hdim 128 +6 to +10 % at 2k, +2 to +3 %
# at 8k over the register stores (with Q_EARLY), despite the stack it takes per work item.
TMA_STORE_HEAD_DIMS = (64, 128)
# The head dims whose consumers release Q after an item's last S product (``Q_EARLY``), so that the next
# item's loads overlap its last P V product and epilogue. Measured on the H200 (docs/perf-notes.md,
# 2026-12-01 14:40, forward alone, two alternating runs): hdim 128 +0.2 to +4.9 % at 2k, -1.8 to +2.8 %
# at 8k; hdim 64 (with its TMA-store epilogue) -0.5 to -3.1 % in every cell, so it stays off there.
Q_EARLY_HEAD_DIMS = (128,)
# The head dims with two pairs of Q buffers (``Q_BUFS`` = 2): the producer loads the next item's Q, and
# queues its K/V tiles behind it, while the consumers still read the current item's Q, instead of waiting
# for that Q's release at the item's end. Costs 2 x ROWS_WG x HEAD_DIM x 2 bytes of shared memory: 16 KB
# at hdim 64 (176 KB in all with its 4 stages: 180,776 bytes compiled); 128 and 256 have no room (229 and 256 KB
# against 227).
DOUBLE_Q_HEAD_DIMS = (64,)
# The head dims whose key-tile loop takes its tiles in pairs with the S product one tile ahead of the
# softmax (``S_AHEAD``: a warpgroup's softmax overlaps its own next S product). Measured on the H200 at 64:
# +3 to +4 % forward except causal 2k (level); 128 keeps it off (untested there; docs/perf-notes.md,
# 2026-12-02 04:49).
S_AHEAD_HEAD_DIMS = (64,)
# The head dims whose ring slots keep one full and one empty barrier for their K and V together (``KV_BAR``):
# a key tile costs each consumer warpgroup one mbarrier wait and one arrival instead of two and two, and
# Triton puts a warpgroup barrier (bar.sync) next to most of them: compiled for sm_90, the S_AHEAD pair loop
# has 5 BAR.SYNC and 4 SYNCS instructions per warpgroup instead of 7 and 8. K is then held until its tile's
# P V product, so hdim 64 takes 4 stages instead of 3 (176 KB of shared memory with its four Q tiles and two
# staging tiles, against 227). Measured on the H200 (docs/perf-notes.md, 2026-12-02 10:00): +0.7 to +2.4 %
# forward at 64; on 3 stages 3 % less; at 128 (2 stages: the held K leaves the producer no lead) 13-24 %
# slower, so 128 and 256 keep it off.
KV_BAR_HEAD_DIMS = (64,)
BLOCK_M, ROWS_WG = 128, 64
MAXNREG, CONSUMER_REGS, PRODUCER_REGS = 168, 240, 24
# The work order of unequal items (_order_group): groups of (sequence, head) pairs whose keys and
# values fit ORDER_L2_BYTES (about half the L2), heaviest blocks first across a group; a group of
# fewer than ORDER_MIN_GROUP pairs keeps one pair at a time. Measured on the H200, causal, 16k
# tokens a batch (docs/perf-notes.md, 2026-12-01 05:20): groups of 12-48 pairs +1.6 to +3.7 %
# (hdim 128 at 2k-4k, hdim 64 at 2k-8k); groups of 3-6: -4.6 to +0.8 %.
ORDER_L2_BYTES, ORDER_MIN_GROUP = 24 << 20, 12
# Dense causal calls whose groups hold this many pairs run on a persistent grid walking the grouped
# order: measured (05:29) +10 / +2 % at hdim 128 (1k / 2k; groups 48 / 24), +23 / +17 / +10 % at
# hdim 64 (1k / 2k / 4k; 96 / 48 / 24); with groups of 12, -4 % at hdim 128 (4k), +5 % at hdim 64 (8k).
PERSISTENT_MIN_GROUP = 24
# Dynamic schedule (``DYNAMIC`` in kernels/attn_fwd_hopper.py): a persistent dense causal call whose items
# outnumber its programs fetches each program's next item with an atomic on a per-call counter instead of
# the static round-robin. Modelled (docs/perf-notes.md, "dynamic persistent schedule"): at
# hdim 128, 16k tokens a batch, 132 programs, the round-robin balances 85 % of the ideal at 1k-4k, the
# dynamic fetch 96 %; hdim 64 97 % against 99.5-100 %. With it, groups of DYNAMIC_MIN_GROUP pairs already
# run persistent (hdim 128 at 4k, hdim 64 at 8k: groups of 12, whose static round-robin lost at hdim 128).
# Measured on the H200 (docs/perf-notes.md, 2026-12-01 16:21, forward alone): hdim 128 causal +4.0 to
# +4.7 % at 1k-4k (4k's from groups of 12 going persistent), hdim 64 within the noise but 8k +3 %.
DYNAMIC_SCHEDULE = True
DYNAMIC_MIN_GROUP = 12
MIN_SEQLEN_Q = 128  # fewer query rows: decoding shapes, which the portable kernel's split-KV path serves
# From MIN_SEQLEN_Q rows on, every call the rules accept runs the Gluon kernels at any length: the last
# short-call exception (hdim 64 causal forwards of <= 1024 rows on the portable kernel) lost its A/B on
# the H200 (docs/perf-notes.md, 2026-12-01 18:37: Gluon +17.9 % at 512 rows, +19.1 % at 1024).
_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def hopper_enabled() -> bool:
    return getenv("TILEATTN_HOPPER", "1") not in ("0", "false", "no")


@functools.lru_cache(maxsize=None)
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1)
def _gluon_available() -> bool:
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _strides_reason(*tensors) -> str | None:
    """Why a TMA descriptor cannot read one of ``tensors`` by its strides (every stride but the last
    a multiple of 16 bytes), or None. A call signature fixes it."""
    for t in tensors:
        size = t.element_size()
        for s in t.stride()[:-1]:
            if s * size % 16:
                return "strides not 16-byte aligned"
    return None


def _pointers_reason(*tensors) -> str | None:
    """Why a TMA descriptor cannot read one of ``tensors`` by its base (not 16-byte aligned), or
    None: the part of the alignment rule that can change from call to call."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return "strides not 16-byte aligned" if bits & 15 else None


def device_reason(q) -> str | None:
    """Why the Gluon kernels cannot run on ``q``'s device, or are turned off there (one short
    phrase), or None: they can. The forward's and the backward's rules both ask it: the switches
    of the environment, which can change between calls (``switch_reason``), then the device,
    which a call signature fixes (``device_kind_reason``)."""
    return switch_reason() or device_kind_reason(q)


def switch_reason() -> str | None:
    """Why the environment turns the Gluon kernels off (``TILEATTN_HOPPER=0``, Triton's
    interpreter), or None. Read on every call, as the environment may change between calls."""
    if not hopper_enabled():
        return "TILEATTN_HOPPER=0"
    if interpreting():
        return "not a CUDA device"
    return None


def device_kind_reason(q) -> str | None:
    """Why ``q``'s device cannot run the Gluon kernels (not CUDA, not sm_90, a Triton without
    Gluon), or None: what a call signature (its device) fixes."""
    device = q.device
    if device.type != "cuda":
        return "not a CUDA device"
    if not _is_hopper(device.index if device.index is not None else torch.cuda.current_device()):
        return "not sm_90"
    if not _gluon_available():
        return "Triton has no Gluon"
    return None


def options_reason(params: AttnParams, alibi_slopes) -> str | None:
    """Why the Gluon kernels (forward and backward alike) cannot apply these options, or None."""
    if not params.softmax_scale > 0:
        return "softmax_scale <= 0"
    if params.softcap > 0 or alibi_slopes is not None or params.dropout_p > 0:
        return "softcap / ALiBi / dropout"
    if params.diag_shift:
        return "shifted diagonal (a ring block)"
    return None


def hopper_fwd_reason(q, k, v, params: AttnParams, *, alibi_slopes, varlen: bool, paged: bool, seqused_k,
                      num_splits: int, max_seqlen_q: int = 0, out=None, lse=None) -> str | None:
    """None when the Hopper kernel can compute this forward call, else why not (one short phrase).

    The shape checks come first: a decoding call, the most frequent and the shortest, is told
    no before the environment and the device are looked at. All but the environment
    (``switch_reason``) and the data pointers' alignment are fixed by the call's signature:
    ``fwd_signature_reason`` asks them once, ``call_reason`` the rest. ``out``/``lse``, when given,
    are the outputs the call writes (``_outputs_reason``)."""
    return (_fwd_shape_reason(q, varlen, paged, seqused_k, num_splits, max_seqlen_q) or device_reason(q)
            or _fwd_operands_reason(q, k, v, params, alibi_slopes, varlen) or _outputs_reason(q, out, lse)
            or _pointers_reason(q, k, v))


def fwd_signature_reason(q, k, v, params: AttnParams, *, alibi_slopes, varlen: bool, paged: bool, seqused_k,
                         num_splits: int, max_seqlen_q: int = 0, out=None, lse=None) -> str | None:
    """The part of ``hopper_fwd_reason`` that every call with these tensors' metadata (shapes,
    strides, dtypes, device) and these options answers alike; a call passes the whole rule when
    this is None and ``call_reason(q, k, v)`` is None."""
    return (_fwd_shape_reason(q, varlen, paged, seqused_k, num_splits, max_seqlen_q) or device_kind_reason(q)
            or _fwd_operands_reason(q, k, v, params, alibi_slopes, varlen) or _outputs_reason(q, out, lse))


def call_reason(*tensors) -> str | None:
    """The part of the Gluon rules (forward and backward) that can change between calls of one
    signature: the environment's switches (``switch_reason``), then the 16-byte alignment of the
    ``tensors``' data pointers."""
    return switch_reason() or _pointers_reason(*tensors)


def _fwd_shape_reason(q, varlen: bool, paged: bool, seqused_k, num_splits: int, max_seqlen_q: int) -> str | None:
    if paged or seqused_k is not None:
        return "paged / seqused_k"
    if num_splits > 1:
        return "explicit KV splits"
    rows = max_seqlen_q if varlen and max_seqlen_q > 0 else q.shape[0 if varlen else 1]
    return "decoding shape" if rows < MIN_SEQLEN_Q else None


def _fwd_operands_reason(q, k, v, params: AttnParams, alibi_slopes, varlen: bool) -> str | None:
    why = _operands_reason(q, k, v)
    if why is not None:
        return why
    if q.shape[0] == 0 or k.shape[0 if varlen else 1] == 0:
        return "empty batch or keys"
    return options_reason(params, alibi_slopes) or _strides_reason(q, k, v)


def _outputs_reason(q, out, lse) -> str | None:
    """Why the Gluon forward cannot write ``out`` (B, S, H, Dv) or packed (T, H, Dv) and ``lse`` (B, H, S)
    or packed (H, T), or None. Its register store and its lse store (kernels/attn_fwd_hopper.py,
    ``o_row``/``l_row``) compute a row's head offset as ``h * stride`` in int32 (the batch and row terms
    are int64), so a layout whose heads lie 2**31 elements apart or more (an ``out=`` view of a heads-first
    (B, H, S, D) buffer with H * S * D >= 2**31 a batch) wraps: writes out of bounds. The portable kernel
    takes int64 offsets. The register store serves every packed call, head dim 256, and a kept launch's
    call whose ``out`` is not 16-byte aligned, so the rule asks it of every ``out``."""
    heads = q.shape[-2]
    for t in (out, lse):
        if t is not None and t.dim() >= 2 and not index_offsets_fit_int32(t, -2, heads):
            return "output head offsets past int32"
    return None


def _operands_reason(q, k, v) -> str | None:
    """Why the Gluon forward cannot take these tensors (dtypes, head dims), or None."""
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype} / {k.dtype} / {v.dtype}"
    if q.shape[-1] not in HOPPER_TILES or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]}"
    return None


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    name = "float8e4nv" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")  # an FP8 cache
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, name))


class GluonLaunch:
    """One launch of a Gluon kernel whose grid, constexprs, descriptor tiles and numbers (the
    integer and float arguments, which follow the tensors in both kernels' signatures) are decided
    for a call signature. ``launch(*tensors)`` takes the kernel's leading arguments: a tensor (the
    base of a descriptor where ``blocks`` names its tile) or None each.

    The first call makes the descriptors (``_kept_fields``: validated by Triton the first time a
    (shape, strides, block, dtype) is seen) and finds the ``Launch`` by the argument classes
    (``launch_of``); both are kept, so a later call, whose tensors must have the first call's
    metadata (shapes, strides, dtypes, which are None: the prepared launches' callers vouch for it),
    only copies the kept descriptor fields with its own tensors as bases (~0.35 µs each on the 2-core
    CPU machine, against ~1 for a lookup by shape and 5 for ``arg_classes`` of the forward's 30
    arguments). Once the ``Launch`` launches directly, the descriptors as its C launcher takes them
    (``Launch.encode``: the driver's CUtensorMap encoding, ~1 µs each on the GPU host) are kept per
    set of base pointers (``encoded``, at most ``_MAX_ENCODED``): a CUtensorMap holds the base, the
    shape, the strides, the padding and the slot's tile, swizzle and element type, and all but the
    base are fixed for a ``GluonLaunch``, so a call whose bases were seen before reuses the same
    bytes; the caching allocator hands a loop's outputs and activations the same addresses step
    after step. The launchers of single calls (``hopper_attn_fwd``, ``hopper_attn_bwd``) make one
    per call: the work the first call does is what every call did before."""

    __slots__ = ("kernel", "grid", "constexprs", "blocks", "numbers", "kept", "launch", "encoded")

    def __init__(self, kernel, grid: tuple[int, int, int], constexprs: dict, blocks: tuple, numbers: tuple):
        self.kernel, self.grid, self.constexprs, self.blocks, self.numbers = kernel, grid, constexprs, blocks, numbers
        self.kept, self.launch, self.encoded = (), None, {}

    def __call__(self, *tensors) -> None:
        launch = self.launch
        args = [*tensors, *self.numbers]
        if getattr(launch, "descs", None):  # a direct Launch kept: the descriptors encoded once per set of bases
            bases = tuple([tensors[i].data_ptr() for i, _ in self.kept])
            encoded = self.encoded.get(bases)
            if encoded is None:
                encoded = launch.encode(self._described(args))
                if len(self.encoded) >= _MAX_ENCODED:
                    self.encoded.clear()
                self.encoded[bases] = encoded
            if launch.launched(self.grid, args, encoded):
                return
        elif launch is None:  # (position, kept fields) of each descriptor
            self.kept = tuple((i, _kept_fields(tensors[i], block)) for i, block in enumerate(self.blocks)
                              if block is not None)
        args = self._described(args)
        if launch is None:
            launch = self.launch = launch_of(self.kernel, args, self.constexprs)
        launch(self.grid, *args)

    def _described(self, args: list) -> list:
        """``args`` with a descriptor (``_rebase``) in place of each tensor that is read through one."""
        args = list(args)
        for i, kept in self.kept:
            args[i] = _rebase(kept, args[i])
        return args


def launch_of(kernel, args: tuple, constexprs: dict):
    """The ``_launch.Launch`` of Gluon ``kernel`` (one consumer warpgroup per default partition,
    the register split of this module) for a call with these arguments: after a shape class's
    first call, straight to the compiled kernel's launcher, without ``JITFunction.run`` binding and
    specialising ~30 arguments (for a portable kernel ~36 µs a launch in benchmarks/host_launch.py's
    stand-in). Kept per (kernel, the caller's constexprs in its order, ``arg_classes``): no sorted
    key per call."""
    classes = arg_classes(kernel, args)
    key = (kernel, tuple(constexprs.items()), classes)  # the caller's constexprs in its own order
    launch = _GLUON_LAUNCHES.get(key)
    if launch is None:
        launch = _GLUON_LAUNCHES[key] = launch_for(
            kernel, dict(constexprs, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4),
            {"maxnreg": MAXNREG}, classes)
    return launch


_GLUON_LAUNCHES: dict = {}  # launch_of's (kernel, constexprs, classes) -> launch_for's Launch


def _kept_fields(t: torch.Tensor, block: tuple[int, ...]) -> tuple:
    """(descriptor class, fields with a None base) of a TMA descriptor of ``t`` read in tiles of
    ``block`` (NVMMA shared layout), for ``_rebase``.

    Triton's constructor validates a descriptor (rank, block shape, dtype, strides, base alignment:
    ~2.5 µs on the 2-core CPU machine, and a launch makes 3 to 8). All but the base's alignment
    depend only on (shape, strides, block, dtype): the fields of the first validated descriptor of
    those are kept (``_DESCRIPTOR_FIELDS``, its base left out: the first tensor is not kept alive)."""
    key = (t.shape, t.stride(), block, t.dtype)
    kept = _DESCRIPTOR_FIELDS.get(key)
    if kept is None:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        desc = TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _smem_layout(block, t.dtype))
        if len(_DESCRIPTOR_FIELDS) >= _MAX_DESCRIPTORS:
            _DESCRIPTOR_FIELDS.clear()
        kept = _DESCRIPTOR_FIELDS[key] = (type(desc), dict(vars(desc), base=None))  # the constructor's field order
    return kept


def _rebase(kept: tuple, t: torch.Tensor):
    """A descriptor with ``kept``'s fields (``_kept_fields``) and ``t`` as its base, whose alignment
    is asserted as Triton's constructor does."""
    cls, fields = kept
    assert t.data_ptr() % 16 == 0, "base must be 16-byte aligned"
    desc = object.__new__(cls)
    desc.__dict__ = {**fields, "base": t}  # the kept fields in their order, base in its place
    return desc


_DESCRIPTOR_FIELDS: dict = {}  # (shape, strides, block, dtype) -> (descriptor class, its fields, base None)
_MAX_DESCRIPTORS = 1024  # kept field sets; all are dropped when full (shapes that do not come back)
_MAX_ENCODED = 256  # a GluonLaunch's encoded descriptor sets (one per set of bases); all dropped when full


def hopper_attn_fwd(q, k, v, out, lse, *, params: AttnParams, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q: int = 0, max_seqlen_k: int = 0, learnable_sink=None) -> None:
    """Forward into ``out``/``lse`` (dense, or packed with ``cu_seqlens_q/k``; ``learnable_sink``
    fp32 (nheads,) or None); the call must have passed ``hopper_fwd_reason``."""
    HopperFwd(params, max_seqlen_q, max_seqlen_k)(q, k, v, out, lse, learnable_sink, cu_seqlens_q, cu_seqlens_k)


class HopperFwd:
    """``hopper_attn_fwd`` with its options bound: ``fwd(q, k, v, out, lse, learnable_sink,
    cu_seqlens_q, cu_seqlens_k)``. Its launch (``GluonLaunch``) is worked out from the first call's
    metadata and kept: a prepared forward (``gpu/prepared.py``) keeps one for every call of its
    signature, whose calls must have passed ``fwd_signature_reason`` once and ``call_reason`` each."""

    __slots__ = ("params", "max_seqlen_q", "max_seqlen_k", "launch", "tma_store", "dynamic")

    def __init__(self, params: AttnParams, max_seqlen_q: int = 0, max_seqlen_k: int = 0):
        self.params, self.max_seqlen_q, self.max_seqlen_k, self.launch = params, max_seqlen_q, max_seqlen_k, None
        self.tma_store = self.dynamic = False

    def __call__(self, q, k, v, out, lse, learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
        if cu_seqlens_q is not None:  # packed (T, H, D) tensors seen as batch 1 by the descriptors; lse (H, T)
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        launch = self.launch
        if launch is None:
            launch = self.launch = self._launch(q, k, v, out, lse, learnable_sink, cu_seqlens_q)
            self.tma_store, self.dynamic = launch.constexprs["TMA_STORE"], launch.constexprs["DYNAMIC"]
        o_desc = None
        if self.tma_store:  # out is also the base of the output descriptor
            if out.data_ptr() & 15:  # no descriptor on this base: this call stores from registers
                launch = self._launch(q, k, v, out, lse, learnable_sink, cu_seqlens_q, tma_store=False)
            else:
                o_desc = out
        # DYNAMIC: every call its own zeroed item counter (``_item_counter``), a kept launch's calls too
        counter = _item_counter(q.device) if self.dynamic else None
        launch(q, k, v, o_desc, out, lse, learnable_sink, cu_seqlens_q, cu_seqlens_k, None, None, counter)

    def _launch(self, q, k, v, out, lse, learnable_sink, cu_seqlens_q, tma_store: bool = True) -> GluonLaunch:
        """The launch of calls like this one (q, k, v 4-D: packed ones unsqueezed); with ``tma_store``
        False it stores the output from registers whatever ``_out_block`` says."""
        params = self.params
        varlen = cu_seqlens_q is not None
        if varlen:
            batch = cu_seqlens_q.shape[0] - 1
            seqlen_q = self.max_seqlen_q if self.max_seqlen_q > 0 else q.shape[1]
            seqlen_k = self.max_seqlen_k if self.max_seqlen_k > 0 else k.shape[1]
            o_strides = (0, out.stride(0), out.stride(1), 0)
            l_strides = (0, lse.stride(0), lse.stride(1), 0)
        else:
            batch, seqlen_q = q.shape[:2]
            seqlen_k = k.shape[1]
            o_strides = (out.stride(0), out.stride(1), out.stride(2), 0)
            l_strides = (lse.stride(0), lse.stride(1), lse.stride(2), 0)
        block_n, stages = HOPPER_TILES[q.shape[3]]
        works = cdiv(seqlen_q, BLOCK_M) * batch * q.shape[2]
        if varlen or params.window_left >= 0 or params.window_right >= 0:
            # Items of unequal cost (causal diagonal, windows, packed lengths): one program per item,
            # so the hardware's block scheduler balances them. A static round-robin over one program
            # per SM in the order of one (sequence, head) pair at a time measured 435 against 625
            # TFLOP/s at hdim 128, causal, 16k; over the grouped order (_order_group) with large
            # groups it balances: dense causal calls with groups of PERSISTENT_MIN_GROUP or more
            # pairs run persistent (docs/perf-notes.md, 2026-12-01 05:29).
            group = _order_group(k, v, seqlen_k, q.shape[2], batch * q.shape[2])
            dense_causal = not varlen and params.window_left < 0 and params.window_right == 0
            programs, dynamic = _causal_grid(works, _sms(q), group) if dense_causal else (works, False)
        else:  # equal items: one program per SM walks them, overlapping one item's tail with the next's loads
            programs, group, dynamic = min(works, _sms(q)), 1, False
        return _fwd_launch(q, k, o_strides, l_strides, params, batch, seqlen_q, seqlen_k, programs, block_n, stages,
                           learnable_sink=learnable_sink, cu_seqlens_q=cu_seqlens_q, group=group,
                           o_block=_out_block(q, out, varlen) if tma_store else None, dynamic=dynamic)


def _causal_grid(works: int, sms: int, group: int) -> tuple[int, bool]:
    """(programs, ``DYNAMIC``) of a dense causal call of ``works`` items in groups of ``group`` pairs
    (``_order_group``): a persistent grid of ``sms`` programs for groups of ``PERSISTENT_MIN_GROUP``
    pairs, or of ``DYNAMIC_MIN_GROUP`` with the dynamic schedule (``DYNAMIC_SCHEDULE``), which it
    then takes where the items outnumber the programs; else one program per item."""
    persistent = group >= (min(PERSISTENT_MIN_GROUP, DYNAMIC_MIN_GROUP) if DYNAMIC_SCHEDULE else PERSISTENT_MIN_GROUP)
    if not persistent:
        return works, False
    programs = min(works, sms)
    return programs, DYNAMIC_SCHEDULE and works > programs


def _item_counter(device) -> torch.Tensor:
    """A zeroed int32 counter for one dynamic launch (its programs' next items, ``DYNAMIC``): fresh from
    the caching allocator on the current stream and zeroed by a memset on it, so two launches in
    flight on different streams never share one, and under CUDA-graph capture the zeroing is a node
    that every replay runs again. (A counter kept by the launcher and reset by the kernel's last
    program would save this memset, but two launches on two streams would race on it, and a launch
    that never finishes would leave it dirty for the next.)"""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _out_block(q, out, varlen: bool) -> tuple[int, ...] | None:
    """The tile [1, 64, 1, D] of the output descriptor when the forward stores ``out`` through shared
    memory with TMA copies (``TMA_STORE``: the module docstring), else None: dense calls at head dims
    ``TMA_STORE_HEAD_DIMS`` whose ``out`` (B, S, H, D) has q's dtype, a unit last stride and strides of
    16-byte multiples (a view of a larger tensor is fine: the descriptor's bounds are the view's). The
    base's alignment, which can change from call to call, is the caller's to check."""
    head_dim = q.shape[-1]
    if varlen or head_dim not in TMA_STORE_HEAD_DIMS or out.dtype != q.dtype or out.dim() != 4:
        return None
    if out.stride(-1) != 1 or _strides_reason(out):
        return None
    return (1, ROWS_WG, 1, head_dim)


def _order_group(k, v, seqlen_k: int, nheads: int, pairs: int) -> int:
    """How many of the call's ``pairs`` (sequence, query head) pairs the kernel's work order takes
    at a time (``_work`` of kernels/attn_fwd_hopper.py: heaviest blocks first across a group): as
    many as keep the keys and values they read within ``ORDER_L2_BYTES`` (the ``nheads`` query
    heads share k's KV heads), or 1 where that is fewer than ``ORDER_MIN_GROUP``."""
    per_head = seqlen_k * (k.shape[-1] + v.shape[-1]) * k.element_size() * k.shape[-2] // nheads
    group = min(pairs, ORDER_L2_BYTES // max(per_head, 1))
    return group if group >= ORDER_MIN_GROUP else 1


def _sms(q) -> int:
    return _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()) if q.is_cuda else 132


def _fwd_launch(q, k, o_strides, l_strides, params: AttnParams, batch, seqlen_q, seqlen_k, programs, block_n, stages,
                *, learnable_sink=None, cu_seqlens_q=None, seqused_k=None, block_table=None, qpack=1, num_splits=1,
                tiles_per_split=2**30, group=1, o_block=None, dynamic=False) -> GluonLaunch:
    """The one launch of the Gluon forward: descriptor tiles, integer arguments, flags, for calls
    whose tensors are like these (the optional ones read only for their presence and the block
    table's layout). q and k are 4-D (batch, seqlen, heads, dim), k the pool (num_blocks, page,
    heads_k, dim) with ``block_table``; ``o_strides``/``l_strides`` are (batch, seqlen, head, split)
    and (batch, head, seqlen, split) of the output and lse. The launch takes (q, or with ``qpack`` its
    5-D view (B, S, H_k, qpack, D), k, v, out or None, out, lse, learnable_sink, cu_seqlens_q,
    cu_seqlens_k, seqused_k, block_table, counter): with ``o_block`` (``_out_block``: dense, ``qpack`` 1, one
    split) the first out is the base of the output descriptor (``TMA_STORE``), else None; with ``dynamic``
    (``_causal_grid``: dense) the counter is a zeroed int32 tensor of one element, fresh per call
    (``_item_counter``), else None."""
    from ..kernels.attn_fwd_hopper import _attn_fwd_hopper_kernel

    nheads, head_dim, nheads_k = q.shape[2], q.shape[3], k.shape[2]
    # rows with qpack: (query, head of the KV head's group)
    q_block = (1, ROWS_WG // qpack, 1, qpack, head_dim) if qpack > 1 else (1, ROWS_WG, 1, head_dim)
    page = k.shape[1] if block_table is not None else 0
    kv_block = (1, min(page, block_n) if page else block_n, 1, head_dim)
    table = (block_table.stride(0), block_table.shape[1]) if block_table is not None else (0, 0)
    numbers = (*o_strides, *l_strides, *table, batch, nheads, seqlen_q, seqlen_k, num_splits, tiles_per_split, group,
               params.softmax_scale * LOG2E.value, params.window_left, params.window_right)
    assert o_block is None or (qpack == 1 and num_splits == 1 and cu_seqlens_q is None and block_table is None)
    assert not dynamic or (cu_seqlens_q is None and block_table is None)
    return GluonLaunch(_attn_fwd_hopper_kernel, (programs, 1, 1), dict(
        GROUP=nheads // nheads_k, QPACK=qpack, IS_VARLEN=cu_seqlens_q is not None, HAS_SEQUSED=seqused_k is not None,
        MASK_LEFT=params.window_left >= 0, MASK_RIGHT=params.window_right >= 0, HAS_SINK=learnable_sink is not None,
        PAGE=page, BLOCK_N=block_n, STAGES=stages, TMA_STORE=o_block is not None,
        Q_EARLY=head_dim in Q_EARLY_HEAD_DIMS, DYNAMIC=dynamic, Q_BUFS=2 if head_dim in DOUBLE_Q_HEAD_DIMS else 1,
        S_AHEAD=head_dim in S_AHEAD_HEAD_DIMS, KV_BAR=head_dim in KV_BAR_HEAD_DIMS),
        (q_block, kv_block, kv_block, o_block) + (None,) * 8, numbers)


def hopper_partials_reason(q, k_cache, v_cache, params: AttnParams, block_table, seqused_k) -> str | None:
    """None when ``hopper_attn_partials`` can compute this call, else why not: one sequence
    (q (1, rows, heads, dim)) over a paged pool, no mask (a cascade's shared prefix)."""
    if q.shape[0] != 1 or block_table is None or seqused_k is None:
        return "not one sequence over a paged pool"
    if params.window_left >= 0 or params.window_right >= 0:
        return "masked"
    why = device_reason(q) or _operands_reason(q, k_cache, v_cache)
    if why is not None:
        return why
    block_n, page = HOPPER_TILES[q.shape[-1]][0], k_cache.shape[1]
    if not (page % block_n == 0 or (block_n % page == 0 and page % 8 == 0)):
        return f"pages of {page} keys"
    if ROWS_WG % (q.shape[2] // k_cache.shape[2]):
        return "query heads per KV head do not divide 64"
    return options_reason(params, None) or _strides_reason(q, k_cache, v_cache) or _pointers_reason(q, k_cache, v_cache)


def hopper_partials_splits(q, k_cache, max_seqlen_k: int) -> int:
    """How many key splits ``hopper_attn_partials`` makes: enough work items for one per SM, each
    split at least 4 key tiles."""
    block_n = HOPPER_TILES[q.shape[-1]][0]
    return max(1, min(_sms(q) // _partials_items(q, k_cache), cdiv(max_seqlen_k, block_n) // 4))


def _partials_items(q, k_cache) -> int:
    """Work items of one key split: query blocks of the packed rows (rows x query heads per KV
    head) for each KV head."""
    return cdiv(q.shape[1] * (q.shape[2] // k_cache.shape[2]), BLOCK_M) * k_cache.shape[2]


class HopperPartials:
    """``gpu.attention.plan_partials``'s plan on Hopper: ``num_splits`` key splits of the Gluon kernel."""

    def __init__(self, num_splits: int, max_seqlen_k: int):
        self.num_splits, self.max_seqlen_k = num_splits, max_seqlen_k

    def run_partials(self, q, k, v, params: AttnParams, seqused_k, block_table, o_parts, lse_parts, k_descale=None,
                     v_descale=None) -> None:
        assert k_descale is None and v_descale is None, "FP8 pools take the portable kernel"
        hopper_attn_partials(q, k, v, o_parts, lse_parts, params=params, block_table=block_table, seqused_k=seqused_k,
                             max_seqlen_k=self.max_seqlen_k)


def hopper_attn_partials(q, k_cache, v_cache, o_parts, lse_parts, *, params: AttnParams, block_table, seqused_k,
                         max_seqlen_k: int) -> None:
    """The partial states of ``o_parts.shape[0]`` key splits of one sequence's attention over a
    paged pool, unmerged: ``o_parts`` (splits, 1, rows, heads, dim) and ``lse_parts`` (splits, 1,
    heads, rows), fp32 (``merge_parts`` merges them with others). The query heads that share a KV
    head are packed as rows, so each key tile is read once for all of them. The call must have
    passed ``hopper_partials_reason``."""
    splits, rows, nheads = o_parts.shape[0], q.shape[1], q.shape[2]
    block_n, stages = HOPPER_TILES[q.shape[3]]
    qpack = nheads // k_cache.shape[2]
    tiles_per_split = cdiv(cdiv(max_seqlen_k, block_n), splits)
    items = _partials_items(q, k_cache) * splits
    o_strides = (o_parts.stride(1), o_parts.stride(2), o_parts.stride(3), o_parts.stride(0))
    l_strides = (lse_parts.stride(1), lse_parts.stride(2), lse_parts.stride(3), lse_parts.stride(0))
    launch = _fwd_launch(q, k_cache, o_strides, l_strides, params, 1, rows, max_seqlen_k, min(items, _sms(q)),
                         block_n, stages, seqused_k=seqused_k, block_table=block_table, qpack=qpack, num_splits=splits,
                         tiles_per_split=tiles_per_split)
    q_rows = q.unflatten(2, (nheads // qpack, qpack)) if qpack > 1 else q
    launch(q_rows, k_cache, v_cache, None, o_parts, lse_parts, None, None, None, seqused_k, block_table, None)
