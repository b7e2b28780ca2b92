"""Launching a compiled Triton kernel directly, without ``JITFunction.run``'s per-call work.

Every call of ``kernel[grid](*args, **meta)`` makes Triton 3.6 bind all ~60 arguments,
specialise each one (dtype; 16-byte alignment of pointers; whether an int is 1 or divisible
by 16; the i32/i64 range of the others), turn that into a string key, look the compiled
kernel up, build launch metadata for profiler hooks and ask the driver to check every
pointer. A ``Launch`` does that once: its first call goes through Triton and keeps the
``CompiledKernel`` Triton returns; later calls hand the launcher raw pointers directly::

    compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata=None, enter_hook=None, exit_hook=None, *args, *constexprs)

That is sound only while every call would compile to the same kernel. ``launch_for`` hands
out one ``Launch`` per (jit function, constexprs, options, signature), where the caller's
signature names the dtype (or absence) of every tensor argument and how Triton classifies each
integer argument the caller keeps fixed (``int_class``); the integers a caller varies from
call to call must be ones the kernel does not specialise (``do_not_specialize``). Per call
``Launch`` checks the rest: the pointers' 16-byte alignment, the i32 range of those
unspecialised integers, and that no profiler hook is installed (``knobs.runtime.launch_enter_hook``),
and takes the kernel's handle for the current device: the first call on each further GPU of the
process goes through Triton, which loads the kernel there, and its handle is kept beside the first
(``Launch.elsewhere``) when it was built for the same target (the same GPU model: the C launcher and its
flags, kept from the first, are then its own too). Anything else goes through Triton as before. Under
``TRITON_INTERPRET=1`` there is no compiled kernel and every call takes Triton's path.

A kernel that takes TMA descriptors (the Gluon kernels) has a Python wrapper between
``compiled.run`` and the C launcher: for every call it allocates no scratch (these kernels need
none) and walks all ~40 arguments to replace each descriptor by its CUtensorMap, shape and
strides (``make_tensordesc_arg``). A ``Launch`` of such a kernel does that replacement itself from
the descriptor metadata the compiled kernel carries, at the descriptors' known positions, and calls
the C launcher (the wrapper's ``launcher``) with the same arguments the wrapper would give it.
"""

from __future__ import annotations

import functools
import math

import torch
from triton import knobs
from triton.compiler import CompiledKernel

__all__ = ["Launch", "arg_classes", "cdiv", "config_options", "contiguous_strides", "int_class", "launch_for",
           "next_power_of_2"]

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_ENTER_HOOKS, _EXIT_HOOKS = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def index_offsets_fit_int32(t: torch.Tensor, dim: int, count: int) -> bool:
    """Whether a kernel that computes ``i * t.stride(dim)`` in int32 for indices ``i < count`` (a head
    index, a tile's row) stays in range: a contiguous tensor's heads do, the heads of a view that
    lie 2**31 elements apart or more (heads first, transposed) do not."""
    return t.stride(dim) * max(count - 1, 0) <= _I32_MAX


_LAUNCHES: dict[tuple, "Launch"] = {}


def int_class(fn, first: int, values) -> tuple:
    """How Triton classifies the integer arguments ``values`` of jit function ``fn``, the first
    at argument position ``first``: (equal to 1, divisible by 16, within i32) each, or only the
    range for those the kernel does not specialise (``do_not_specialize``)."""
    loose = getattr(fn, "do_not_specialize", None)
    if loose is None:  # the interpreter's InterpretedFunction keeps the decorator's arguments
        loose = fn.kwargs.get("do_not_specialize") or ()
    names = fn.arg_names[first:first + len(values)]
    return tuple((_I32_MIN <= v <= _I32_MAX,) if name in loose else (v == 1, v % 16 == 0, _I32_MIN <= v <= _I32_MAX)
                 for name, v in zip(names, values))


def arg_classes(fn, args) -> tuple:
    """How Triton specialises each runtime argument of ``fn`` (all of them, in signature order):
    a tensor's dtype, None, an integer's class (as ``int_class``), a tensor descriptor's block
    shape and dtype (its layout follows from them: the launchers make it so), else the type.
    For launches whose arguments change kind from call to call (the Gluon kernels' optional
    tensors and their integers): a ``launch_for`` signature computed per call, so the plain
    kinds (int, None, float, bool, tensor) are told apart by their exact type first."""
    loose = fn.do_not_specialize
    classes = []
    append = classes.append
    for name, v in zip(fn.arg_names, args):
        kind = type(v)
        if v is None:
            append(None)
        elif kind is float or kind is bool:
            append(kind)
        elif kind is int or (isinstance(v, int) and not isinstance(v, bool)):
            append((_I32_MIN <= v <= _I32_MAX,) if name in loose else (v == 1, v % 16 == 0, _I32_MIN <= v <= _I32_MAX))
        elif isinstance(v, torch.Tensor):
            append(v.dtype)
        elif isinstance(v, (bool, float)):
            append(kind)
        else:  # a TensorDescriptor
            append((tuple(v.block_shape), v.base.dtype))
    return tuple(classes)


MAX_PLANS = 1024  # launch plans a launcher keeps (shape classes); all are dropped when full


def plan_for(plans: dict, key: tuple, make):
    """A launcher's plan for ``key`` from its cache ``plans``, made by ``make(key)`` the first
    time. A full cache is emptied: shape classes are few, so a cache that fills holds keys
    that do not come back."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plan = plans[key] = make(key)
    return plan


def launch_for(fn, constexprs: dict, options: dict, signature: tuple) -> "Launch":
    """The ``Launch`` of ``fn`` with these constexprs and options shared by every caller whose
    calls specialise alike, as ``signature`` says (see the module docstring)."""
    key = (fn, tuple(sorted(constexprs.items())), tuple(sorted(options.items())), signature)
    launch = _LAUNCHES.get(key)
    if launch is None:
        # every constexpr named, defaults included: ``_through_triton`` keeps no launch that leaves one
        # to its default, and every call of such a launch would take Triton's path
        missing = [name for name in _constexpr_names(fn) if name not in constexprs]
        assert not missing, f"{fn.__name__}: constexprs not given: {missing}"
        launch = _LAUNCHES[key] = Launch(fn, constexprs, options)
    return launch


def _constexpr_names(fn) -> list[str]:
    """The constexpr parameters of a jitted kernel, or of the function Triton's interpreter wraps."""
    if hasattr(fn, "params"):
        return [p.name for p in fn.params if p.is_constexpr]
    annotations = getattr(getattr(fn, "fn", None), "__annotations__", {})
    return [name for name, kind in annotations.items() if "constexpr" in str(kind)]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``. ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in
    Triton 3.6, whose Python calls cost 5-15 µs each on the 2-core CPU machine: host code uses these."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def config_options(config) -> dict:
    """The launch options of an autotuner config (num_warps, num_stages, ...), as the autotuner
    passes them, without its constexprs."""
    return {name: value for name, value in config.all_kwargs().items() if name not in config.kwargs}


def partials_workspace(workspace_shapes: tuple, device) -> tuple:
    """fp32 buffers for split partial states (o, lse) of ``workspace_shapes`` (o's shape, lse's):
    contiguous views of one allocation (an eager decoding call pays each allocation on the host),
    the lse part starting on a 128-byte boundary. The views are made by ``as_strided`` from the
    layout worked out once per pair of shapes (``_partials_layout``): two calls where a slice and a
    view of each took four (~2.5 µs less per split decoding call on the 2-core CPU machine)."""
    size, o_strides, l_strides, start = _partials_layout(workspace_shapes)
    o_shape, l_shape = workspace_shapes
    buf = torch.empty(size, device=device, dtype=torch.float32)
    return buf.as_strided(o_shape, o_strides), buf.as_strided(l_shape, l_strides, start)


@functools.lru_cache(maxsize=256)
def _partials_layout(workspace_shapes: tuple) -> tuple[int, tuple, tuple, int]:
    """(elements to allocate, o's strides, lse's strides, lse's first element) for ``partials_workspace``."""
    o_shape, l_shape = workspace_shapes
    start = cdiv(math.prod(o_shape), 32) * 32
    return start + math.prod(l_shape), contiguous_strides(o_shape), contiguous_strides(l_shape), start


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``torch.empty(shape)`` will have)."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def _target(compiled) -> object:
    """The GPU target a compiled kernel was built for (another GPU model of the process compiles its own)."""
    return getattr(getattr(compiled, "metadata", None), "target", None)


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


class Launch:
    """One jit kernel with fixed constexprs and launch options (see the module docstring).

    ``launch((g0, g1, g2), *args)`` takes the grid and the kernel's runtime arguments in
    signature order (the constexprs come from ``constexprs``). ``fast_calls`` counts the calls
    that skipped Triton's path.
    """

    __slots__ = ("fn", "constexprs", "options", "compiled", "device", "elsewhere", "tail", "ptr_slots",
                 "wide_slots", "descs", "direct", "fill", "fast_calls")

    def __init__(self, fn, constexprs: dict, options: dict):
        self.fn = fn
        self.constexprs = constexprs
        self.options = options
        self.compiled: CompiledKernel | None = None
        self.device = -1
        self.elsewhere: dict[int, CompiledKernel] = {}  # the same kernel loaded on the process's other GPUs
        self.tail: tuple = ()
        self.ptr_slots: tuple[int, ...] = ()
        self.wide_slots: tuple[int, ...] = ()
        self.descs: tuple = ()  # (position, swizzle, element size, element type, block) per TMA descriptor
        self.direct: tuple = ()  # (C launcher, its fixed flags) once the kernel is launched without compiled.run
        self.fill = None  # the driver's fill_tma_descriptor then
        self.fast_calls = 0

    def __call__(self, grid: tuple[int, int, int], *args) -> None:
        if not self.launched(grid, args):
            self._through_triton(grid, args)

    def launched(self, grid: tuple[int, int, int], args, encoded: tuple | None = None) -> bool:
        """Launch directly and say True, or say False where the call must go through Triton
        (``_through_triton``). ``encoded``: the call's TMA descriptors as ``encode`` gave them, the
        descriptor positions of ``args`` then holding anything (their bases' alignment vouched for)."""
        compiled = self.compiled
        if compiled is None or _ENTER_HOOKS.calls or _EXIT_HOOKS.calls:
            return False
        device = _current_device()
        if device != self.device:  # another GPU: its own handle of the kernel, once Triton has loaded it there
            compiled = self.elsewhere.get(device)
            if compiled is None:
                return False
        raw = list(args)
        align = 0  # any bit set: take Triton's path
        for i in self.ptr_slots:
            raw[i] = ptr = args[i].data_ptr()
            align |= ptr
        for i in self.wide_slots:
            if not _I32_MIN <= raw[i] <= _I32_MAX:
                align = 1
        descs = self.descs
        if encoded is None:
            for desc in descs:
                align |= args[desc[0]].base.data_ptr()
        if align & 15:
            return False
        g0, g1, g2 = grid
        if self.direct:
            for desc, fields in zip(reversed(descs), reversed(encoded or self.encode(args))):  # later positions first
                raw[desc[0]:desc[0] + 1] = fields
            c_launch, flags = self.direct
            c_launch(g0, g1, g2, _current_stream(device), compiled.function, *flags, compiled.packed_metadata, None,
                     None, None, *raw, *self.tail)
        else:
            compiled.run(g0, g1, g2, _current_stream(device), compiled.function, compiled.packed_metadata, None, None,
                         None, *raw, *self.tail)
        self.fast_calls += 1
        return True

    def _vouched(self, args) -> bool:
        """Whether the fast path may launch this call (as ``launched`` checks it): every pointer and
        descriptor base 16-byte aligned, every unspecialised int in i32; so that Triton compiled the
        call as the kept kernel's specialisation."""
        align = 0
        for i in self.ptr_slots:
            align |= args[i].data_ptr()
        for desc in self.descs:
            align |= args[desc[0]].base.data_ptr()
        return not align & 15 and all(_I32_MIN <= args[i] <= _I32_MAX for i in self.wide_slots)

    def encode(self, args) -> tuple:
        """Each TMA descriptor of ``args`` (at ``descs``' positions) as the C launcher takes it, in
        ``descs``' order: (CUtensorMap, *shape, *strides). What a CUtensorMap holds besides the
        descriptor's base, shape, strides and padding (tile, swizzle, element type) is the slot's."""
        return tuple((self.fill(d.base.data_ptr(), swizzle, elem_size, elem_type, block, d.shape, d.strides,
                                d.padding == "nan"), *d.shape, *d.strides)
                     for i, swizzle, elem_size, elem_type, block in self.descs for d in (args[i],))

    def _through_triton(self, grid, args) -> None:
        """Launch through ``JITFunction.run``; keep the compiled kernel when the call is one the
        fast path may repeat (every pointer 16-byte aligned, every unspecialised int in i32)."""
        compiled = self.fn[grid](*args, **self.constexprs, **self.options)
        if not isinstance(compiled, CompiledKernel):
            return  # the interpreter
        if self.compiled is not None:  # kept: on another GPU, keep that GPU's handle of the same kernel
            device = _current_device()
            if (device != self.device and device not in self.elsewhere and self._vouched(args)
                    and _target(compiled) == _target(self.compiled)):  # the C launcher and flags kept are its too
                compiled.run  # noqa: B018 (loads the module and function handles on this GPU now)
                self.elsewhere[device] = compiled
            return
        params = self.fn.params
        runtime = [p for p in params if not p.is_constexpr]
        if len(runtime) != len(args) or any(p.is_constexpr for p in params[:len(runtime)]):
            return  # constexprs not all trailing: not launched directly
        ptr_slots = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        if any(args[i].data_ptr() & 15 for i in ptr_slots):
            return
        wide = tuple(i for i, (p, a) in enumerate(zip(runtime, args))
                     if p.do_not_specialize and isinstance(a, int) and not isinstance(a, bool))
        if not all(_I32_MIN <= args[i] <= _I32_MAX for i in wide):
            return
        if any(p.name not in self.constexprs for p in params[len(runtime):]):
            return
        compiled.run  # noqa: B018 (loads the module and function handles now, not in the fast path)
        desc_slots = tuple(i for i, a in enumerate(args) if hasattr(a, "block_shape"))
        direct = _direct_launcher(compiled, len(desc_slots))
        if direct is not None:  # else compiled.run (its wrapper encodes any descriptors)
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

            c_launch, self.fill, flags, meta = direct
            self.direct = (c_launch, flags)
            self.descs = tuple((i, m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]],
                                m["block_size"]) for i, m in zip(desc_slots, meta))
        self.tail = tuple(self.constexprs[p.name] for p in params[len(runtime):])
        self.ptr_slots, self.wide_slots = ptr_slots, wide
        self.device = _current_device()
        self.compiled = compiled


def _direct_launcher(compiled: CompiledKernel, descriptors: int):
    """(C launcher, ``fill_tma_descriptor``, (cooperative grid, PDL, global scratch, profile
    scratch), descriptor metadata) of a compiled kernel launched by Triton 3.6's ``CudaLauncher``,
    whose ``descriptors`` TMA descriptor arguments (0 or more) its launcher encodes as CUtensorMaps;
    None where it cannot be launched so (scratch memory to allocate per call, descriptors passed as
    pointers, FP4 padding, a launcher of another shape): such a ``Launch`` calls ``compiled.run``.

    Without descriptors ``CudaLauncher.__call__`` adds only the flags and the scratch pointers
    (None without scratch) before its C launcher; called directly, the C launcher gets the same
    arguments (~1 µs less per launch on the 2-core CPU machine's stand-in)."""
    from triton.runtime import driver

    run = compiled.run
    wrapper = getattr(run, "launch", None)  # Triton's wrap_handle_tensordesc(launcher, ...), or the launcher
    if wrapper is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    flags = (run.launch_cooperative_grid, run.launch_pdl, None, None)
    if not descriptors:  # no descriptor argument: wrap_handle_tensordesc returned the C launcher itself
        wraps = "launcher" in getattr(getattr(wrapper, "__code__", None), "co_freevars", ())  # else its wrapper
        return None if wraps else (wrapper, None, flags, ())
    meta = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None)
    closure = getattr(wrapper, "__closure__", None)
    if not closure or not meta or len(meta) != descriptors:
        return None
    c_launch = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in closure))).get("launcher")
    if c_launch is None or any(m is None or m["fp4_padded"] for m in meta):
        return None
    return c_launch, driver.active.utils.fill_tma_descriptor, flags, meta
