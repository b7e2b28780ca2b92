"""The merge of split-KV partial states (``kernels/combine.py``'s ``merge_row``), two ways.

* A launch of its own after the split forward (``combine_launch``): one program per row. Every
  split plan has one; ``merge_parts`` launches it on partial states a caller computed (a
  cascade's prefix splits and suffix).
* In the split forward launch itself (``MERGE_SPLITS``, ``merge_constexprs``): the last split program of
  each row block to finish merges the block's rows, one row at a time as the combine kernel does,
  with the same code, block of splits (``combine_block_s``) and number of warps; the two forms agree
  to rounding (``kernels/combine.py``: an fp32 ulp in a few elements), each deterministic. The programs count their arrival on an int32 per program along the grid's
  axis 0, zero before the launch and left at zero by the merging program.

Which calls merge in the forward launch (``eager_counters``, the one place of the rule): the
eager calls of a prepared launch (``gpu.prepared.PreparedFwd``, the ops layer's lane) on a
stream that is not capturing a CUDA graph. Measured on the H200 (07e430d, docs/perf-notes.md):
graph-replayed batch-1 decoding with the merge in the kernel was slower than with the combine
launch (8k 22.2 -> 23.4 µs, 32k 50.0 -> 51.1, paged 16 24.4 -> 27.0: the merge's tail, one
program reading every split after all the others, and the captured counters' fill), so captured
calls, ``DecodePlan`` and ``attn_fwd`` keep the two launches. An eager call is host-bound (~75 µs
of host time against ~18 µs of kernels on the GPU hosts, 5-12 µs of host time per launch), where
one launch fewer outweighs the ~1.2 µs the merge adds on the device (predicted, not yet measured:
docs/perf-notes.md, "eagermerge"). ``EAGER_MERGE = False`` turns the merged form off (A/B).

Counters: an eager call takes the cached buffer of its (device, stream), which calls on that
stream use one after another (stream order: a launch starts after the last one's programs have
zeroed their counters); two streams never share one. A capturing stream takes none (two
launches), so graphs never hold these buffers; nor does a call on tensors of another device than
the current one (its launch goes to the current device's stream, not the one its key names).
"""

from __future__ import annotations

import torch

from . import _launch
from ..kernels.combine import _combine_kernel
from ._launch import Launch, contiguous_strides, int_class, launch_for, next_power_of_2

__all__ = ["EAGER_MERGE", "combine_launch", "eager_counters", "merge_constexprs", "merge_parts"]

EAGER_MERGE = True  # eager prepared split launches merge their splits themselves (module docstring)
COMBINE_MAX_BLOCK_S = 64  # splits the combine reads at once (fewer when there are fewer splits)
COMBINE_MAX_TILE = 64 * 256  # ... and of them x head dim: 32 splits at 512 (64 spilled 2.8 KB on sm_90)
COMBINE_NUM_WARPS = 4  # the combine's warps; forward launches of other warps do not merge (their reductions' order)
# The in-kernel merge: at most MERGE_MAX_ROWS rows a program (a decoding row of GQA up to 16, or a
# few speculative tokens), and MERGE_MAX_BYTES of partials it reads alone (past that, the combine's
# program per row is predicted quicker: at ~100 GB/s from L2 for one SM, 128 KB take ~1.3 µs,
# under a launch's device cost). Its loop over the rows is unrolled where a row's block of splits
# holds MERGE_UNROLL_TILE fp32 or more (BLOCK_S x head dim), else not. Chosen by sm_90 ptxas
# (tests/hopper_compile.py): unrolled small blocks made it lower the register target below the
# plain variant's and spill (paged 256, 4 splits: 96 -> 80 registers and 8 bytes of stack), the
# loop over large blocks did (8k contiguous, 16 splits: 128 and 8 bytes; 33 splits: 242 against
# 216 unrolled); this way no merged variant spills where its plain one does not.
MERGE_MAX_ROWS = 16
MERGE_MAX_BYTES = 128 * 1024
MERGE_UNROLL_TILE = 16 * 128
_STREAMS_KEPT = 64  # (device, stream) buffers kept; all are dropped when full (new ones are zeros)
_COMBINE_FIRST_INT = _combine_kernel.arg_names.index("stride_po_split")
_COUNTERS: dict = {}


def combine_block_s(num_splits: int, head_dim_pad: int) -> int:
    """Splits the merge reads at once (``BLOCK_S`` / ``MERGE_BLOCK_S``), in either form."""
    return min(next_power_of_2(num_splits), COMBINE_MAX_BLOCK_S, COMBINE_MAX_TILE // head_dim_pad)


def merge_constexprs(rows: int, num_splits: int, head_dim_v: int, head_dim_v_pad: int,
                     num_warps: int) -> dict | None:
    """The forward kernel's merge constexprs (``MERGE_SPLITS`` and its tile) for a split decode
    launch whose programs serve at most ``rows`` rows (a power of two, at most the tile's); None
    where it cannot merge its splits itself (``num_warps`` not the combine's, ``MERGE_MAX_ROWS``,
    ``MERGE_MAX_BYTES``)."""
    if num_warps != COMBINE_NUM_WARPS or rows > MERGE_MAX_ROWS or rows * num_splits * head_dim_v * 4 > MERGE_MAX_BYTES:
        return None
    block_s = combine_block_s(num_splits, head_dim_v_pad)
    return dict(MERGE_SPLITS=True, MERGE_ROWS=rows, MERGE_BLOCK_S=block_s,
                MERGE_UNROLL=rows if block_s * head_dim_v_pad >= MERGE_UNROLL_TILE else 1)


def eager_counters(plan) -> torch.Tensor | None:
    """The arrival counters of ``plan``'s merged launch (``FwdPlan.merged``) for an eager call: at
    least ``plan.grid[0]`` int32 zeros, the current stream's cached buffer (grown when too small);
    None where the call launches the forward and the combine (the rule: module docstring)."""
    if not EAGER_MERGE or plan.merged is None:
        return None
    index = plan.device_index
    if index >= 0:
        if torch._C._cuda_isCurrentStreamCapturing():  # torch.cuda.is_current_stream_capturing, one call less
            return None
        if _launch._current_device() != index:  # the launch goes to another device's stream than the key's
            return None
        key = (index, _launch._current_stream(index))
    else:  # CPU tensors: Triton's interpreter, one launch at a time
        key = index
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < plan.grid[0]:
        if len(_COUNTERS) >= _STREAMS_KEPT:
            _COUNTERS.clear()
        counters = _COUNTERS[key] = torch.zeros(next_power_of_2(plan.grid[0]), dtype=torch.int32, device=plan.device)
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
    block_s = combine_block_s(num_splits, head_dim_pad)
    launch = launch_for(_combine_kernel,
                        dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_S=block_s, HAS_SINK=sink is not None,
                             SKIP_MARKED=marked),
                        dict(num_warps=COMBINE_NUM_WARPS), ((torch.float32, torch.float32, o_dtype, l_dtype, sink),
                                                            int_class(_combine_kernel, _COMBINE_FIRST_INT, ints)))
    return launch, (batch * seqlen_q * nheads, 1, 1), ints
