"""A KV cache's values checked on the device in one launch: lengths, left pads, block-table entries.

``tileattn.ops`` validates what a call's tensors hold before attention reads them. For CUDA
tensors the values are not read on the host (that would synchronise every decoding step):
with ``ASSERT`` this kernel asserts on the device itself (``tl.device_assert``, compiled in by
the launch option ``debug``), so a bad value fails the step at the next synchronisation, as
a device-side assertion, before the kernels queued after it run, with no host round trip and
no second launch. Without ``ASSERT`` (the interpreter on CPU tensors, and the tests of the
rule) it writes one flag, which the caller asserts (``torch._assert_async``).

Sequence ``b`` of length ``L = Seqlens[b]`` passes when

* ``0 <= L <= top`` (``top``: the capacity less the tokens the call appends, and less what the
  rotary tables cannot reach);
* with ``HAS_LEFTPAD``: ``0 <= Leftpad[b] <= L``;
* with ``PAGED``: every block-table entry of a page its keys occupy after the append (pages
  ``p`` with ``p * block_size < L + new_tokens``) lies within ``0 .. num_blocks - 1``; entries
  past a sequence's last page are never read, so they may hold anything.

A small batch is one program. A large paged batch (64 sequences of 1k pages: 64k entries) is a
grid of programs over its rows, one step each: in one program its dependent steps cost 59 µs on
the H200, 9 % of the decoding step it guards. Each program then asserts its own rows; for the
flag the launcher sets it to true first and a program that finds a bad value clears it (every
such write stores the same value, so the order does not matter).

The rule's parts are jit helpers (``length_out_of_range``, ``leftpad_out_of_range``,
``block_id_out_of_range``, and ``sequence_reads_ok`` for one sequence), written once: the forward
kernel's ``CHECK_CACHE`` (``attn_fwd.py``) applies them to the values each of its programs is
about to read, and the append kernel's ``CHECK`` (``append.py``) to those each of its programs is
about to write by, so an eager decoding call, appending or not, needs no launch of this kernel.
"""


import triton
import triton.language as tl

# what a failed device assertion prints (CUDA reports only that an assertion failed)
ASSERT_MESSAGE = tl.constexpr("tileattn: a KV cache's lengths, left pads or block-table entries are out of range "
                              "(rerun with TILEATTN_DEBUG_CHECKS=1 for the exact check)")


@triton.jit
def length_out_of_range(lens, top):
    """Lengths (any shape) outside 0..``top``."""
    return (lens < 0) | (lens > top)


@triton.jit
def leftpad_out_of_range(pads, lens):
    """Left pads (any shape) outside 0..their sequence's length."""
    return (pads < 0) | (pads > lens)


@triton.jit
def block_id_out_of_range(ids, num_blocks):
    """Block-table entries (any shape) outside 0..``num_blocks - 1``."""
    return (ids < 0) | (ids >= num_blocks)


@triton.jit
def sequence_reads_ok(length, top, row, p_lo, p_hi, num_blocks, PAGED: tl.constexpr, BLOCK_P: tl.constexpr):
    """Whether one sequence passes the rule as far as a reader of its pages ``p_lo .. p_hi - 1``
    depends on it: ``length`` within 0..``top`` and, with ``PAGED``, those entries of its
    block-table row (``row``: the row's first entry, unit stride) within 0..``num_blocks - 1``,
    ``BLOCK_P`` entries per step. The caller keeps ``p_hi`` within the row (pages of at most
    ``top`` keys), so a bad length cannot send these loads past it."""
    bad = length_out_of_range(length, top)
    if PAGED:
        offs_p = tl.arange(0, BLOCK_P)  # [BLOCK_P]
        wrong = offs_p < 0  # [BLOCK_P] all false
        for p0 in range(p_lo, p_hi, BLOCK_P):
            cols = p0 + offs_p  # [BLOCK_P]
            used = cols < p_hi
            ids = tl.load(row + cols, mask=used, other=0)  # [BLOCK_P]
            wrong = wrong | (block_id_out_of_range(ids, num_blocks) & used)
        bad = bad | (tl.max(wrong.to(tl.int32), axis=0) > 0)
    return bad == 0


@triton.jit(do_not_specialize=["batch", "rows_per_program", "pages", "stride_s", "stride_l", "stride_tb", "stride_tp", "top",
                               "new_tokens", "block_size", "num_blocks"])
def _cache_check_kernel(Seqlens, Leftpad, BlockTable, Ok, batch, rows_per_program, pages, stride_s, stride_l, stride_tb, stride_tp, top,
                        new_tokens, block_size, num_blocks, HAS_LEFTPAD: tl.constexpr, PAGED: tl.constexpr,
                        BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, ONE_PROGRAM: tl.constexpr,
                        ASSERT: tl.constexpr):
    """``Ok[0]`` = every sequence passes, or with ``ASSERT`` a device assertion of it (module
    docstring): rows ``rows_per_program`` per program, ``BLOCK_B`` of them per step. Only the
    entries of pages in use are read."""
    n_bad = 0
    first = tl.program_id(0) * rows_per_program
    for b0 in range(first, tl.minimum(first + rows_per_program, batch), BLOCK_B):
        rows = b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        live = rows < batch
        lens = tl.load(Seqlens + rows * stride_s, mask=live, other=0)
        bad = length_out_of_range(lens, top)
        if HAS_LEFTPAD:
            pad = tl.load(Leftpad + rows * stride_l, mask=live, other=0)
            bad = bad | leftpad_out_of_range(pad, lens)
        n_bad += tl.sum((bad & live).to(tl.int32), axis=0)
        if PAGED:
            ends = lens + new_tokens  # [BLOCK_B] keys of each sequence after the append
            row_ptrs = BlockTable + rows.to(tl.int64)[:, None] * stride_tb  # [BLOCK_B, 1]
            for p0 in range(0, pages, BLOCK_P):
                cols = p0 + tl.arange(0, BLOCK_P)  # [BLOCK_P]
                used = live[:, None] & (cols < pages)[None, :] & (cols[None, :] * block_size < ends[:, None])
                ids = tl.load(row_ptrs + cols[None, :] * stride_tp, mask=used, other=0)  # [BLOCK_B, BLOCK_P]
                wrong = block_id_out_of_range(ids, num_blocks) & used
                n_bad += tl.sum(tl.sum(wrong.to(tl.int32), axis=1), axis=0)
    if ASSERT:
        tl.device_assert(n_bad == 0, ASSERT_MESSAGE)
    elif ONE_PROGRAM:
        tl.store(Ok, n_bad == 0)
    elif n_bad > 0:  # Ok was set to true before the launch
        tl.store(Ok, False)
