"""Launching a compiled Triton kernel directly, without ``JITFunction.run``'s per-call work.

Every call of ``kernel[grid](*args, **meta)`` makes Triton 3.6 bind all ~60 arguments,
specialise each one (dtype; 16-byte alignment of pointers; whether an int is 1 or divisible
by 16; the i32/i64 range of the others), turn that into a string key, look the compiled
kernel up, build launch metadata for profiler hooks and ask the driver to check every
pointer. ``Launch`` does that once: the first call goes through Triton and keeps the
``CompiledKernel`` it returns; later calls hand the launcher raw pointers directly::

    compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata=None, enter_hook=None, exit_hook=None, *args, *constexprs)

That is sound only while every call would have compiled to the same kernel. The owner of a
``Launch`` (a launch plan, ``gpu.attention``) guarantees what it can from its cache key: the
constexprs, options and grid are fixed, and so are the dtype and None-ness of every tensor and
the value of every int Triton specialises. Per call ``Launch`` checks the rest: the pointers'
16-byte alignment, the i32 range of the ints Triton does not specialise, the current device,
and that no profiler hook is installed (``knobs.runtime.launch_enter_hook``). Anything else
goes through Triton as before. Under ``TRITON_INTERPRET=1`` there is no compiled kernel and
every call takes Triton's path.
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.compiler import CompiledKernel

__all__ = ["Launch"]

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_ENTER_HOOKS, _EXIT_HOOKS = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


class Launch:
    """One jit kernel with fixed constexprs, launch options and grid (see the module docstring).

    ``launch(*args)`` takes the kernel's runtime arguments in signature order (the constexprs
    come from ``constexprs``). ``fast_calls`` counts the calls that skipped Triton's path.
    """

    __slots__ = ("fn", "grid", "constexprs", "options", "compiled", "device", "tail", "ptr_slots", "wide_slots",
                 "fast_calls")

    def __init__(self, fn, grid: tuple[int, ...], constexprs: dict, options: dict):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = constexprs
        self.options = options
        self.compiled: CompiledKernel | None = None
        self.device = -1
        self.tail: tuple = ()
        self.ptr_slots: tuple[int, ...] = ()
        self.wide_slots: tuple[int, ...] = ()
        self.fast_calls = 0

    def __call__(self, *args) -> None:
        compiled = self.compiled
        if compiled is not None and not (_ENTER_HOOKS.calls or _EXIT_HOOKS.calls):
            device = _current_device()
            raw = list(args)
            align = device != self.device  # any bit set: take Triton's path
            for i in self.ptr_slots:
                raw[i] = ptr = args[i].data_ptr()
                align |= ptr
            for i in self.wide_slots:
                if not _I32_MIN <= raw[i] <= _I32_MAX:
                    align = 1
            if not align & 15:
                g0, g1, g2 = self.grid
                compiled.run(g0, g1, g2, _current_stream(device), compiled.function, compiled.packed_metadata,
                             None, None, None, *raw, *self.tail)
                self.fast_calls += 1
                return
        self._through_triton(args)

    def _through_triton(self, args) -> None:
        """Launch through ``JITFunction.run``; keep the compiled kernel when the call is one the
        fast path may repeat (every pointer 16-byte aligned, every unspecialised int in i32)."""
        compiled = self.fn[self.grid](*args, **self.constexprs, **self.options)
        if self.compiled is not None or not isinstance(compiled, CompiledKernel):
            return  # the interpreter, or already kept
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
        self.tail = tuple(self.constexprs[p.name] for p in params[len(runtime):])
        self.ptr_slots, self.wide_slots = ptr_slots, wide
        self.device = _current_device()
        self.compiled = compiled
