"""What both launchers decide the same way: interpreter or GPU, autotuning or a fixed tile, the
matmuls' operand dtype and precision, the shared memory a program may use."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SMEM_LIMIT = 227 * 1024  # shared memory one block may use on Hopper (sm_90)
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def interpreting() -> bool:
    """Whether tileattn's Triton kernels run in Triton's CPU interpreter. Triton's ``jit`` decides
    that when a kernel is defined (``TRITON_INTERPRET=1`` then gives an ``InterpretedFunction``), so
    it is read from the kernels, once: setting the variable later changes nothing Triton runs (and
    reading it on every call cost ~0.6 µs of each call's host time)."""
    global _INTERPRETED
    if _INTERPRETED is None:
        from triton.runtime.interpreter import InterpretedFunction

        from ..kernels.attn_fwd import _attn_fwd_kernel

        _INTERPRETED = isinstance(_attn_fwd_kernel, InterpretedFunction)
    return _INTERPRETED


_INTERPRETED: bool | None = None


def dot_types(dtype: torch.dtype, fp8_cache: bool = False) -> tuple:
    """The matmuls' operand dtype and precision (``DOT_DTYPE``, ``DOT_PRECISION``), forward and
    backward alike: the inputs' own dtype; fp16 over an FP8 cache (the forward scales q into
    fp16's range); bf16 widened to fp32 under Triton 3.6's interpreter, whose tl.dot multiplies bf16
    bit patterns as integers (the operands are already rounded to bf16, so this is exact);
    "ieee" for fp32 operands, else "tf32" (which 16-bit operands ignore)."""
    if fp8_cache:
        dot = tl.float16
    elif dtype == torch.bfloat16 and interpreting():
        dot = tl.float32
    else:
        dot = _DOT_DTYPES[dtype]
    return dot, "ieee" if dot == tl.float32 else "tf32"


def autotune_enabled() -> bool:
    """``TILEATTN_AUTOTUNE=0`` launches the first (best-guess) config instead of autotuning.

    For quick correctness runs on a GPU, where timing every config of every new shape class
    would dominate; the benchmarks autotune and check their outputs.
    """
    return os.environ.get("TILEATTN_AUTOTUNE", "1") not in ("0", "false", "no")


def length_bucket(*seqlens: int) -> int:
    """0, 1 or 2 for at most 1k, 4k, or more tokens: the autotuners keep one choice per bucket
    (the tiles that win at 512 tokens need not win at 16k)."""
    n = max(seqlens)
    return 0 if n <= 1024 else 1 if n <= 4096 else 2


class Tuned:
    """An autotuned jit kernel whose choice, once made, is launched straight through the jit function.

    Triton's autotuner rebuilds its key from every argument on each call, which on the H200
    machine's host costs about 65 µs per launch (``benchmarks/overhead.py``), more than a short
    kernel runs. Here the caller names the key (it must determine everything the tuner's key
    and pruning depend on), the autotuner runs only the first time a key is seen, and later
    calls launch the jit function with the remembered config.
    """

    def __init__(self, kernel, configs, key: list[str], prune):
        self.fn = kernel
        self._tuner = triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune})(kernel)
        self._best: dict[tuple, triton.Config] = {}

    def best(self, key: tuple) -> triton.Config | None:
        """The config chosen for ``key``, or None before the first launch with it."""
        return self._best.get(key)

    def launch(self, grid, key: tuple, args: tuple, meta: dict) -> None:
        config = self._best.get(key)
        if config is None:
            self._tuner[grid](*args, **meta)
            self._best[key] = self._tuner.best_config
        else:
            self.fn[grid](*args, **meta, **config.all_kwargs())
