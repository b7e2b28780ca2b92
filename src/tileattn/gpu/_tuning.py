"""What both launchers decide the same way: interpreter or GPU, autotuning or a fixed tile."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
