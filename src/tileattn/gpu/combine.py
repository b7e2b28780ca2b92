"""The merge of split-KV partial states (``kernels/combine.py``'s ``merge_splits``), two ways.

* In the forward launch itself (``MERGE_SPLITS``, ``merge_tile``): the last split program of each
  row block to finish merges the row block's partials and writes the outputs. The programs count
  their arrival on an int32 per program along the grid's axis 0 (``split_counters``), zero before
  the launch, which the merging programs leave at zero.
* A launch of its own after the forward (``combine_launch``): one program per row. For the plans
  the in-kernel merge does not suit (``merge_tile`` returns None), a mixed batch whose long rows
  were written directly (``SKIP_MARKED``), and partial states the caller merges itself
  (``merge_parts``: a cascade's prefix splits and suffix).

Counters: two launches that may run at once must not share them. An eager call takes the one
cached buffer of its (device, stream), which calls on that stream use one after another; a call
made while a CUDA graph is being captured allocates zeros of its own, from the graph's pool, so
that each graph owns its counters and graphs replayed at once on different streams stay apart.
``DecodePlan`` allocates its own once (``FwdPlan.new_counters``): its runs share its workspace
too, one after another on one stream.
"""

from __future__ import annotations

import torch

from . import _launch
from ..kernels.combine import _combine_kernel
from ._launch import Launch, contiguous_strides, int_class, launch_for, next_power_of_2

__all__ = ["combine_launch", "merge_parts", "merge_tile", "split_counters"]

COMBINE_MAX_BLOCK_S = 64  # splits the combine reads at once (fewer when there are fewer splits)
COMBINE_MAX_TILE = 64 * 256  # ... and of them x head dim: 32 splits at 512 (64 spilled 2.8 KB on sm_90)
# The in-kernel merge. The merging program reads its rows' partial outputs MERGE_MAX_TILE fp32
# at a time at the most (rows x splits x head dim; 32 registers a thread at 4 warps): sm_90
# ptxas then gives the decode variants as many registers as without the merge or fewer, but the
# mixed batch's 16-row tile (204 -> 214: two programs per SM either way); at twice that, the 8k
# paged decode variant (16 splits of 4 rows x 128 at once) took 236 against 168, two programs per
# SM instead of three (tests/hopper_compile.py). The rows alone must fit (the wide tiles' 16-64
# rows x 512 columns take the combine launch). And it reads MERGE_MAX_BYTES of partials at the
# most: past that the combine launch, one program per row, is predicted to be quicker than one
# program reading every split of its rows alone (at ~100 GB/s from L2 for one SM, 128 KB take
# ~1.3 us, under the ~3 us of the separate launch; not yet measured, docs/perf-notes.md).
MERGE_MAX_TILE = 32 * 128
MERGE_MAX_BYTES = 128 * 1024
_COMBINE_FIRST_INT = _combine_kernel.arg_names.index("stride_po_split")
_COUNTERS: dict = {}


def merge_tile(rows: int, num_splits: int, head_dim_v: int, head_dim_v_pad: int) -> tuple[int, int] | None:
    """(rows, splits) the merging program reads at once (``MERGE_ROWS``, ``MERGE_BLOCK_S``) when the
    forward launch merges its ``num_splits`` splits itself, each of its programs serving at most
    ``rows`` rows (a power of two: all of them at once); None where the combine launch merges them
    (``MERGE_MAX_TILE``, ``MERGE_MAX_BYTES``)."""
    if rows * head_dim_v_pad > MERGE_MAX_TILE or rows * num_splits * head_dim_v * 4 > MERGE_MAX_BYTES:
        return None
    return rows, min(next_power_of_2(num_splits), MERGE_MAX_TILE // (rows * head_dim_v_pad))


def split_counters(device: torch.device, index: int, programs: int) -> torch.Tensor:
    """At least ``programs`` int32 zeros for the arrival counters of a merging launch on ``device``
    (``index``: its CUDA index, -1 for the CPU; asked per call, ``device.type`` costs 0.25 us):
    the current stream's cached buffer, grown when too small, or while a CUDA graph is being
    captured a buffer of the call's own (see the module docstring)."""
    if index >= 0:
        if torch._C._cuda_isCurrentStreamCapturing():  # torch.cuda.is_current_stream_capturing, one call less
            return torch.zeros(programs, dtype=torch.int32, device=device)
        key = (index, _launch._current_stream(index))
    else:  # CPU tensors: Triton's interpreter, one launch at a time
        key = index
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < programs:
        counters = _COUNTERS[key] = torch.zeros(next_power_of_2(programs), dtype=torch.int32, device=device)
    return counters


def merge_parts(o_parts, lse_parts, out, lse) -> None:
    """Merge partial states over disjoint key sets into ``out`` (B, Sq, H, Dv; any strides, last
    contiguous, any dtype) and ``lse`` (B, H, Sq) fp32: ``o_parts`` (S, B, Sq, H, Dv) and
    ``lse_parts`` (S, B, H, Sq) fp32, any strides (o's last contiguous) — the split combine's
    kernel on states the caller computed (a cascade's prefix splits and suffix). One launch, no
    host sync."""
    assert o_parts.stride(-1) == 1 and out.stride(-1) == 1, "validated by tileattn.ops"
    head_dim = o_parts.shape[-1]
    launch, grid, ints = combine_launch((tuple(o_parts.shape), tuple(lse_parts.shape)), False, out.stride()[:3],
                                        lse.stride(), head_dim, max(16, next_power_of_2(head_dim)), out.dtype,
                                        lse.dtype, None, False, (o_parts.stride()[:4], lse_parts.stride()))
    launch(grid, o_parts, lse_parts, out, lse, None, *ints)


def combine_launch(workspace, varlen: bool, o_stride, l_stride, head_dim: int, head_dim_pad: int, o_dtype,
                   l_dtype, sink, marked: bool, part_strides=None) -> tuple[Launch, tuple, tuple]:
    """The merge of the (splits, B, Sq, H, D) partials, and the sinks if any (``sink``: their
    dtype or None), into ``out``/``lse`` (varlen as B = 1), skipping the ``marked`` rows when
    asked: its launch, grid and integer arguments. The partials are contiguous unless
    ``part_strides`` gives (o's, lse's) strides (the head dim's stride 1)."""
    (num_splits, batch, seqlen_q, nheads, _), l_shape = workspace
    po, pl = part_strides or (contiguous_strides(workspace[0]), contiguous_strides(l_shape))
    if varlen:
        o_stride, l_stride = (0, *o_stride[:2]), (0, *l_stride[:2])
    ints = (*po[:4], *pl[:4], *o_stride[:3], *l_stride[:3], nheads, seqlen_q, num_splits)
    block_s = min(next_power_of_2(num_splits), COMBINE_MAX_BLOCK_S, COMBINE_MAX_TILE // head_dim_pad)
    launch = launch_for(_combine_kernel,
                        dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_S=block_s, HAS_SINK=sink is not None,
                             SKIP_MARKED=marked),
                        dict(num_warps=4), ((torch.float32, torch.float32, o_dtype, l_dtype, sink),
                                            int_class(_combine_kernel, _COMBINE_FIRST_INT, ints)))
    return launch, (batch * seqlen_q * nheads, 1, 1), ints
