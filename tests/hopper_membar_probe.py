"""Where Triton 3.6 puts warpgroup barriers around mbarrier operations, compiled for sm_90 without a GPU.

The fact behind ``KV_BAR`` (docs/perf-notes.md, 2026-12-02 08:40): the shared-memory barrier analysis
(Membar) puts a ``bar.sync`` between two consecutive mbarrier operations of a program, even on different
allocations, unless both are waits on different allocations (two waits on slots of one allocation, as a
ring's full barriers are, get one too: perf-notes 10:40). Not a test of tileattn's kernels: a record of what this toolchain
does, to re-run when Triton changes. Each line names a sequence and the PTX between the initialisations
and the end (``bar.sync`` where the analysis put one).

    python tests/hopper_membar_probe.py
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: E402

SEQUENCES = {0: "arrive(a)", 1: "wait(b), arrive(a)", 2: "arrive(a), wait(b)", 3: "arrive(a), arrive(b)",
             4: "wait(a), wait(b)", 5: "wait(a0), wait(a1)", 6: "arrive(a0), arrive(a1)"}


@gluon.jit
def _sequence(X, MODE: gl.constexpr):
    a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(a.index(i), count=1)
        mbarrier.init(b.index(i), count=1)
    if MODE == 0:
        mbarrier.arrive(a.index(0), count=1)
    elif MODE == 1:
        mbarrier.wait(b.index(0), 0)
        mbarrier.arrive(a.index(0), count=1)
    elif MODE == 2:
        mbarrier.arrive(a.index(0), count=1)
        mbarrier.wait(b.index(0), 0)
    elif MODE == 3:
        mbarrier.arrive(a.index(0), count=1)
        mbarrier.arrive(b.index(1), count=1)
    elif MODE == 4:
        mbarrier.wait(a.index(0), 0)
        mbarrier.wait(b.index(1), 0)
    elif MODE == 5:  # two slots of one allocation (a ring's full barriers)
        mbarrier.wait(a.index(0), 0)
        mbarrier.wait(a.index(1), 0)
    else:
        mbarrier.arrive(a.index(0), count=1)
        mbarrier.arrive(a.index(1), count=1)


def sequence_ptx(mode: int) -> list[str]:
    """The barrier and mbarrier instructions after the initialisations, in order."""
    src = GluonASTSource(_sequence, {"X": "*i32", "MODE": "constexpr"}, constexprs={"MODE": mode})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    lines = [line.strip() for line in ptx.splitlines() if "bar.sync" in line or "mbarrier." in line]
    last_init = max(i for i, line in enumerate(lines) if "mbarrier.init" in line)
    ops = [next(word for word in line.split() if word.startswith(("bar.", "mbarrier."))) for line in lines]
    return [op.split(".shared")[0].removesuffix(".parity") for op in ops[last_init + 2:]]  # past the init's bar.sync


if __name__ == "__main__":
    for mode, name in SEQUENCES.items():
        print(f"{name:24s} -> {', '.join(sequence_ptx(mode))}")
