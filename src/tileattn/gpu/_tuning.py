"""What both launchers decide the same way: interpreter or GPU, autotuning or a fixed tile, the
matmuls' operand dtype and precision, the softcap's form of tanh, the shared memory a program may use."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._env import getenv

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


# The softcap's tanh (``kernels.common.tanh``), per call: the cheap form (2 sigmoid(2x) - 1) where
# its error is far inside the tolerance rule's budget (tests/tolerance.py: 2 err(plain torch in
# the inputs' dtype) + 1e-5), the precise one (~10 more FMAs per score, -13 to -15 % on a bf16
# softcapped forward, docs/benchmarks.md 2026-12-01 22:42) elsewhere. The numbers:
#  - the cheap form is off by up to 1.8e-7 absolutely for every x (numpy float32), so the scores
#    by up to cap x 1.8e-7; in the interpreter the outputs, LSE and gradients came out
#    0.6-1.1e-7 x cap off (N(0, 1) inputs, head dim 32, 64 tokens, causal). A GPU's exp and
#    division are 2-ulp approximations: up to ~2.5x that there (4.5e-7 for 1.8e-7), i.e. up to
#    ~1.4e-7 x cap on the LSE, ~2.8e-7 x cap on outputs and gradients.
#  - fp32: plain torch is ~1e-6 off, so the budget is the 1e-5 slack: the cheap form passed it up
#    to cap ~100 in the interpreter (cap 50: at half of it; 1e3: 8x past), by the estimate only
#    up to ~40 on a GPU. Every fp32 softcap takes the precise form (cheap: absent below).
#  - fp16/bf16: plain torch rounds the scores to 16 bits, so its budget grows with the scores:
#    the tightest is the LSE's (fp32 either way) at small scores: 8e-5 (fp16), 3e-4 (bf16) at
#    scores ~0.05, where the cheap form failed from cap ~1.2e3 (fp16) and ~5e3 (bf16) in the
#    interpreter; at scores of order 1 the budgets are 1.6e-3 and 1.5e-2 (failed from ~2e4 and
#    ~2e5). In the limit of scores -> 0 the budget falls to the 1e-5 slack for every dtype:
#    1e-5 / 1.4e-7 = ~70 on a GPU by the estimate.
# Hence 64: the 16-bit caps of common models (Gemma 2's 50, Grok's 30) keep the cheap form and
# its speed, with ~9x (fp16) and ~35x (bf16) to spare at scores ~0.05 on the GPU estimate and
# inside the slack even as the scores vanish; larger caps and fp32 pay for the precise form.
CHEAP_TANH_MAX_CAP = {torch.float16: 64.0, torch.bfloat16: 64.0}


def softcap_form(dtype: torch.dtype, softcap: float) -> tuple[bool, bool]:
    """``(HAS_SOFTCAP, PRECISE_TANH)`` of a call whose q has ``dtype``: the precise tanh above
    ``CHEAP_TANH_MAX_CAP[dtype]`` (every fp32 softcap), else the cheap one. Forward and backward
    alike, and part of every plan key (the two forms are two compiled variants)."""
    return softcap > 0, softcap > CHEAP_TANH_MAX_CAP.get(dtype, 0.0)


def autotune_enabled() -> bool:
    """``TILEATTN_AUTOTUNE=0`` launches the first (best-guess) config instead of autotuning.

    For quick correctness runs on a GPU, where timing every config of every new shape class
    would dominate; the benchmarks autotune and check their outputs.
    """
    return getenv("TILEATTN_AUTOTUNE", "1") not in ("0", "false", "no")


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
