"""The Triton forward kernel (``tileattn.gpu.attention.attn_fwd``) against the float64 reference.

On a machine without a GPU the kernel runs on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest.py), so the shapes stay small: a few hundred tokens.
Every output is poisoned with NaN before the kernel runs. The budget of each comparison is
the error of plain PyTorch attention in the same dtype (tests/tolerance.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from tileattn import reference
import tileattn.gpu.attention as launch
import tileattn.gpu.combine as combine
from tileattn.gpu.attention import attn_fwd
from tileattn.contract import AttnParams
from tileattn.kernels.common import visible_in_tile, visible_mask

from tolerance import assert_within, plain_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _np(x):
    return None if x is None else x.detach().to("cpu", torch.float64).numpy()


def _params(head_dim, causal=False, window_size=(-1, -1), softcap=0.0, dropout_p=0.0, dropout_seed=0):
    left, right = window_size
    return AttnParams(softmax_scale=head_dim**-0.5, window_left=left, window_right=0 if causal else right,
                      softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed)


def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(DEVICE)


def _poisoned(q, nheads, lse_shape):
    out = torch.full(q.shape[:-2] + (nheads, q.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    return out, torch.full(lse_shape, float("nan"), dtype=torch.float32, device=q.device)


def _check(name, out, lse, q, k, v, alibi_slopes=None, **opts):
    """Dense (B, S, H, D) results against the reference, with plain torch's error as budget."""
    ref_out, ref_lse = reference.attention_naive(_np(q), _np(k), _np(v), alibi_slopes=_np(alibi_slopes), **opts)
    slopes = None if alibi_slopes is None else alibi_slopes.cpu()
    plain_out, plain_lse = plain_attention(q.cpu(), k.cpu(), v.cpu(), alibi_slopes=slopes, **opts)
    assert_within(f"{name} out", out, plain_out, ref_out)
    assert_within(f"{name} lse", lse, plain_lse, ref_lse)


def _dense(seed, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, num_splits=1,
           alibi_slopes=None, **opts):
    """Run the kernel on fresh random dense inputs; returns q, k, v, out, lse."""
    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k = _randn(gen, batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = _randn(gen, batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    out, lse = _poisoned(q, nheads, (batch, nheads, seqlen_q))
    attn_fwd(q, k, v, out, lse, params=_params(head_dim, **opts), alibi_slopes=alibi_slopes, num_splits=num_splits)
    return q, k, v, out, lse


# (dtype, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal); the interpreter's tiles are 32 x 32
DENSE_CASES = [
    (torch.float16, 1, 1, 2, 2, 64, False),
    (torch.bfloat16, 2, 17, 4, 2, 40, True),
    (torch.float32, 17, 113, 2, 1, 80, False),
    (torch.float16, 113, 17, 4, 4, 96, True),  # rows 0..95 see no key
    (torch.bfloat16, 33, 33, 2, 2, 128, True),  # one past a tile
    (torch.float32, 65, 129, 4, 1, 32, True),
    (torch.bfloat16, 1, 113, 8, 2, 64, False),  # decoding: PACK_GQA
    (torch.float16, 3, 70, 8, 2, 96, True),  # a few queries per group: PACK_GQA + causal
    (torch.bfloat16, 40, 70, 2, 1, 256, False),
]


@pytest.mark.parametrize("dtype,seqlen_q,seqlen_k,nheads,nheads_k,head_dim,causal", DENSE_CASES)
def test_dense_matches_reference(dtype, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal):
    q, k, v, out, lse = _dense(1, 2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, causal=causal)
    _check("dense", out, lse, q, k, v, causal=causal)


@triton.jit
def _both_masks(Out, q_start, k_start, seqlen_k, diag_off, window_left, window_right, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    q_pos = q_start + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    old = visible_mask(q_pos, k_start + cols, seqlen_k, diag_off, window_left, window_right, MASK_LEFT, MASK_RIGHT,
                       True)
    new = visible_in_tile(q_pos, cols, k_start, seqlen_k, diag_off, window_left, window_right, MASK_LEFT,
                          MASK_RIGHT) & (old | ~old)  # (broadcast to the tile where it is [1, BLOCK_N])
    at = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + cols[None, :]
    tl.store(Out + at, old.to(tl.int8))
    tl.store(Out + BLOCK_M * BLOCK_N + at, new.to(tl.int8))


@settings(max_examples=60, deadline=None)
@given(q_start=st.integers(0, 300), tile=st.integers(0, 8), seqlen_k=st.integers(1, 600),
       diag_off=st.integers(-300, 300), window_left=st.integers(-1, 200), window_right=st.integers(-1, 200))
def test_visible_in_tile_is_visible_mask(**case):
    """The Hopper forward's mask (bounds folded into per-row column limits) marks the same scores as
    the portable kernels' ``visible_mask`` (a subtraction and a compare per bound and score), for any
    tile, window, diagonal offset and sequence end."""
    block_m, block_n = 16, 32
    out = torch.full((2, block_m, block_n), -1, dtype=torch.int8, device=DEVICE)
    _both_masks[(1,)](out, case["q_start"], case["tile"] * block_n, case["seqlen_k"], case["diag_off"],
                      case["window_left"], case["window_right"], block_m, block_n, case["window_left"] >= 0,
                      case["window_right"] >= 0)
    assert torch.equal(out[0], out[1]), f"{case}: {int((out[0] != out[1]).sum())} scores differ"


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v, out, lse = _dense(2, 1, 50, 20, 2, 1, 32, torch.float16, causal=True)
    empty = slice(0, 30)  # query i sees keys j <= i - 30
    assert torch.equal(out[:, empty].cpu(), torch.zeros_like(out[:, empty].cpu()))
    assert torch.isneginf(lse[:, :, empty]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 30:]).all()


def test_strided_views():
    """Queries transposed from (B, H, S, D), keys and values sliced out of wider tensors."""
    gen = torch.Generator().manual_seed(3)
    q = _randn(gen, 2, 4, 45, 64, dtype=torch.float16).transpose(1, 2)  # (2, 45, 4, 64)
    kv = _randn(gen, 2, 70, 2, 2, 64, dtype=torch.float16)
    k, v = kv[:, :, 0], kv[:, :, 1]  # (2, 70, 2, 64) views, interleaved
    out_big = torch.full((2, 45, 8, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    out = out_big[:, :, 1::2]  # a strided output view
    lse = torch.full((2, 45, 4), float("nan"), device=DEVICE).transpose(1, 2)
    attn_fwd(q, k, v, out, lse, params=_params(64, causal=True))
    _check("views", out, lse, q, k, v, causal=True)
    assert torch.isnan(out_big[:, :, 0::2]).all()  # nothing written outside the view


@pytest.mark.parametrize("num_splits", [2, 3, 0])
def test_num_splits_give_the_same_answer(num_splits):
    base = _dense(4, 2, 5, 150, 4, 2, 64, torch.float32, num_splits=1, causal=True)
    q, k, v, out, lse = _dense(4, 2, 5, 150, 4, 2, 64, torch.float32, num_splits=num_splits, causal=True)
    _check(f"splits={num_splits}", out, lse, q, k, v, causal=True)
    torch.testing.assert_close(out, base[3], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, base[4], atol=1e-6, rtol=1e-6)


def test_more_splits_than_the_combine_reads_at_once():
    # Key tiles for 9 more splits than the combine reads per block, over 4 more splits still:
    # the second block can raise the running maximum, and the last 3 splits are empty (weight 0).
    splits = combine.COMBINE_MAX_BLOCK_S + 13
    seqlen_k = (combine.COMBINE_MAX_BLOCK_S + 9) * launch.DECODE_BLOCK_N + 7
    q, k, v, out, lse = _dense(6, 1, 2, seqlen_k, 4, 2, 32, torch.float32, num_splits=splits, causal=True)
    _check(f"splits={splits}", out, lse, q, k, v, causal=True)


def test_window_and_softcap():
    q, k, v, out, lse = _dense(5, 2, 70, 90, 2, 2, 40, torch.bfloat16, num_splits=2,
                               window_size=(20, 5), softcap=3.0)
    _check("window+softcap", out, lse, q, k, v, window_size=(20, 5), softcap=3.0)


@pytest.mark.parametrize("seqlen_q,nheads,nheads_k", [(60, 2, 2), (2, 4, 2)])
def test_alibi_with_zero_batch_stride(seqlen_q, nheads, nheads_k):
    slopes = (torch.rand(nheads, generator=torch.Generator().manual_seed(6)) * 0.5).to(DEVICE)
    alibi = slopes.expand(2, nheads)  # batch stride 0, as the ops layer passes (H,) slopes
    q, k, v, out, lse = _dense(6, 2, seqlen_q, 80, nheads, nheads_k, 64, torch.float16,
                               alibi_slopes=alibi, causal=True)
    _check("alibi", out, lse, q, k, v, alibi_slopes=alibi, causal=True)


@pytest.mark.parametrize("seqlen_q,nheads,nheads_k,causal", [(40, 2, 1, True), (1, 4, 2, False)])
def test_dropout_matches_reference_mask(seqlen_q, nheads, nheads_k, causal):
    opts = dict(dropout_p=0.3, dropout_seed=1234, causal=causal)
    q, k, v, out, lse = _dense(7, 2, seqlen_q, 70, nheads, nheads_k, 32, torch.float32, **opts)
    _check("dropout", out, lse, q, k, v, **opts)


def _check_sequences(out_seqs, lse_seqs, q_seqs, k_seqs, v_seqs, **opts):
    for b, (o, l, qb, kb, vb) in enumerate(zip(out_seqs, lse_seqs, q_seqs, k_seqs, v_seqs)):
        if qb.shape[0] > 0:
            _check(f"sequence {b}", o[None], l[None], qb[None], kb[None], vb[None], **opts)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_varlen_with_empty_sequences(num_splits):
    gen = torch.Generator().manual_seed(8)
    lens_q, lens_k = [30, 0, 1, 17, 40], [50, 0, 33, 0, 25]  # an empty sequence, and queries with no keys
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32, device=DEVICE)
    q = _randn(gen, sum(lens_q), 4, 80, dtype=torch.float16)
    k = _randn(gen, sum(lens_k), 2, 80, dtype=torch.float16)
    v = _randn(gen, sum(lens_k), 2, 80, dtype=torch.float16)
    out, lse = _poisoned(q, 4, (4, q.shape[0]))
    attn_fwd(q, k, v, out, lse, params=_params(80, causal=True), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
             max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), num_splits=num_splits)
    sq, sk = torch.split(torch.arange(q.shape[0]), lens_q), torch.split(torch.arange(k.shape[0]), lens_k)
    _check_sequences([out[i] for i in sq], [lse[:, i] for i in sq], [q[i] for i in sq],
                     [k[i] for i in sk], [v[i] for i in sk], causal=True)


def test_dense_seqused_k():
    gen = torch.Generator().manual_seed(9)
    q = _randn(gen, 2, 3, 4, 64, dtype=torch.bfloat16)
    k = _randn(gen, 2, 100, 1, 64, dtype=torch.bfloat16)
    v = _randn(gen, 2, 100, 1, 64, dtype=torch.bfloat16)
    used = [37, 100]
    for b, n in enumerate(used):  # keys past seqused_k must never be read
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    out, lse = _poisoned(q, 4, (2, 4, 3))
    attn_fwd(q, k, v, out, lse, params=_params(64, causal=True),
             seqused_k=torch.tensor(used, dtype=torch.int32, device=DEVICE), num_splits=2)
    _check_sequences(out, lse, q, [k[b, :n] for b, n in enumerate(used)],
                     [v[b, :n] for b, n in enumerate(used)], causal=True)


@pytest.mark.parametrize("page_size,seqlen_q,num_splits,dtype", [
    (16, 1, 1, torch.float16),  # pages smaller than the tile: one table lookup per key
    (64, 1, 3, torch.bfloat16),  # tiles inside one page: one lookup per tile
    (7, 5, 2, torch.float32),  # odd page size, several queries, causal
])
def test_paged_cache_from_permuted_pool(page_size, seqlen_q, num_splits, dtype):
    gen = torch.Generator().manual_seed(10)
    lens_k = [150, 9, 64]
    pages = [-(-n // page_size) for n in lens_k]
    max_pages = max(pages) + 1
    num_blocks = sum(pages) + 5  # a larger pool than needed, unused slots NaN
    k_pool = torch.full((num_blocks, page_size, 2, 96), float("nan"), dtype=dtype, device=DEVICE)
    v_pool = torch.full_like(k_pool, float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(3, max_pages, dtype=torch.int32)
    k_seqs, v_seqs = [], []
    for b, n in enumerate(lens_k):
        k_b, v_b = _randn(gen, n, 2, 96, dtype=dtype), _randn(gen, n, 2, 96, dtype=dtype)
        k_seqs.append(k_b)
        v_seqs.append(v_b)
        for p in range(pages[b]):
            blk = perm.pop()
            table[b, p] = blk
            rows = slice(p * page_size, min((p + 1) * page_size, n))
            k_pool[blk, : rows.stop - rows.start] = k_b[rows]
            v_pool[blk, : rows.stop - rows.start] = v_b[rows]
    q = _randn(gen, 3, seqlen_q, 8, 96, dtype=dtype)
    out, lse = _poisoned(q, 8, (3, 8, seqlen_q))
    causal = seqlen_q > 1
    attn_fwd(q, k_pool, v_pool, out, lse, params=_params(96, causal=causal), block_table=table.to(DEVICE),
             seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE), max_seqlen_k=max(lens_k),
             num_splits=num_splits)
    _check_sequences(out, lse, q, k_seqs, v_seqs, causal=causal)


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("page_size", [0, 7, 16, 64, 256])
def test_decode_tile_fits_and_keeps_a_pipeline(block_m, page_size):
    """Every decode tile the launcher can pick fits in shared memory with two or more stages;
    pages of 64 keys or more hold whole tiles (one table lookup per tile)."""
    for head_dim_pad in (16, 32, 64, 128, 256):
        for elem, kv_elem in ((2, None), (4, None), (2, 1)):  # (2, 1): bf16 q over an FP8 cache
            block_n, stages = launch._decode_tile(block_m, page_size, head_dim_pad, elem, kv_elem_size=kv_elem)
            assert launch._smem_bytes(block_m, block_n, stages, head_dim_pad, elem,
                                      kv_elem_size=kv_elem) <= launch.SMEM_BUDGET
            assert stages >= 2 and 16 <= block_n <= launch.DECODE_BLOCK_N
            if page_size >= launch.DECODE_BLOCK_N_WHOLE_PAGES:
                assert page_size % block_n == 0


def _plan(q, k, v, **kwargs):
    """The launcher's plan for these tensors (nothing runs), causal."""
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    return launch.plan_fwd(q, k, v, out, lse, params=_params(q.shape[-1], causal=True), **kwargs)


def _cache_call(d, dv, nheads, nheads_k, seqlen_q, page, dtype, share=False, fp8=False):
    """(q, k_cache, v_cache, launcher kwargs) of a decoding call: a contiguous cache (page 0) or a
    pool of pages; v_cache a view of k_cache's first dv columns when ``share``."""
    gen = torch.Generator().manual_seed(d + dv)
    q = _randn(gen, 2, seqlen_q, nheads, d, dtype=dtype)
    k = _randn(gen, 8 if page else 2, page or 200, nheads_k, d, dtype=dtype)
    v = k[..., :dv] if share else _randn(gen, *k.shape[:-1], dv, dtype=dtype)
    kwargs = dict(seqused_k=torch.tensor([5, 200], dtype=torch.int32, device=DEVICE), max_seqlen_q=seqlen_q,
                  max_seqlen_k=200, num_splits=2)
    if page:
        kwargs["block_table"] = torch.arange(8, dtype=torch.int32, device=DEVICE).view(2, 4)
    if fp8:
        k = k.to(torch.float8_e4m3fn)
        v = k[..., :dv] if share else v.to(torch.float8_e4m3fn)
        kwargs["k_descale"] = torch.ones(2, nheads_k, device=DEVICE)
    return q, k, v, kwargs


@pytest.mark.parametrize("d,dv,nheads,nheads_k,seqlen_q,page,dtype,share", [
    (128, 128, 32, 8, 1, 16, torch.bfloat16, True),  # v is k itself: no V_IS_K below the wide tile
    (64, 64, 8, 8, 3, 0, torch.float16, False),
    (256, 256, 16, 1, 2, 0, torch.float16, True),
    (192, 128, 16, 16, 1, 64, torch.bfloat16, True),  # MLA training's widths, v a view of k
    (256, 256, 4, 1, 1, 256, torch.float32, False),
])
def test_head_dims_up_to_256_keep_their_kernels(d, dv, nheads, nheads_k, seqlen_q, page, dtype, share):
    """Below the wide tile nothing changed: no tail (HEAD_DIM is q/k's head dim), the key tile is
    never the value tile (not even when v is k), three key ranges, and the decode tile is what
    ``_decode_tile`` gives for the wider of the padded head dims with 4 warps. Those flags' values
    are the kernel's defaults, which compile to the kernel as it was before them (sm_90 SASS
    compared for every variant of tests/hopper_compile.py, docs/perf-notes.md)."""
    import inspect

    q, k, v, kwargs = _cache_call(d, dv, nheads, nheads_k, seqlen_q, page, dtype, share)
    plan = _plan(q, k, v, **kwargs)
    defaults = inspect.signature(launch._attn_fwd_kernel.fn).parameters
    for flag, value in (("HEAD_DIM_TAIL", 0), ("HEAD_DIM_TAIL_PAD", 0), ("V_IS_K", False), ("SINGLE_LOOP", False)):
        assert plan.flags[flag] == value == defaults[flag].default
    assert plan.flags["HEAD_DIM"] == d and plan.flags["HEAD_DIM_V"] == dv
    rows = seqlen_q * (nheads // nheads_k) if nheads > nheads_k else seqlen_q
    block_m = max(16, triton.next_power_of_2(rows))
    pads = max(16, triton.next_power_of_2(d), triton.next_power_of_2(dv))
    block_n, stages = launch._decode_tile(block_m, page, pads, q.element_size())
    assert plan.fwd.constexprs["BLOCK_M"] == block_m and plan.fwd.constexprs["BLOCK_N"] == block_n
    assert plan.fwd.options == dict(num_warps=launch.DECODE_NUM_WARPS, num_stages=stages)


# (rows = seqlen_q x heads per KV head, share, fp8) -> (BLOCK_M, BLOCK_N, num_warps, num_stages): the
# largest tiles sm_90 ptxas compiles without spills (tests/hopper_compile.py, docs/perf-notes.md)
WIDE_TILES = [
    ((128, True, False), (64, 32, 8, 2)),  # MLA decoding, 128 heads: two programs of 64 rows
    ((64, True, False), (64, 32, 8, 2)),
    ((32, True, False), (32, 32, 4, 2)),
    ((16, True, False), (16, 32, 4, 2)),
    ((128, False, False), (64, 16, 8, 2)),  # a v tile of its own
    ((128, True, True), (32, 16, 4, 2)),  # an FP8 latent
]


@pytest.mark.parametrize("case,tile", WIDE_TILES)
def test_the_wide_tile_is_the_measured_one(case, tile):
    """The first (and only) choice for head dims above 256: no autotuning, the same tile with
    TILEATTN_AUTOTUNE=0 or not, within the shared-memory budget; flags as the design says."""
    rows, share, fp8 = case
    q, k, v, kwargs = _cache_call(576, 512, rows, 1, 1, 64, torch.bfloat16, share, fp8)
    plan = _plan(q, k, v, **kwargs)
    c = plan.fwd.constexprs
    assert (c["BLOCK_M"], c["BLOCK_N"], plan.fwd.options["num_warps"], plan.fwd.options["num_stages"]) == tile
    assert (c["HEAD_DIM"], c["HEAD_DIM_PAD"], c["HEAD_DIM_TAIL"], c["HEAD_DIM_TAIL_PAD"]) == (512, 512, 64, 64)
    assert c["V_IS_K"] == share and c["SINGLE_LOOP"] and c["PACK_GQA"] and plan.tuned is None
    smem = launch._smem_bytes(c["BLOCK_M"], c["BLOCK_N"], tile[3], 576, q.element_size(), 0 if share else 512)
    assert smem <= launch.SMEM_BUDGET


def test_auto_splits_fill_the_waves(monkeypatch):
    """The split rule on an H200-like GPU (132 SMs, 227 KB per block), without one."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_gpu_limits", lambda index: (132, 232448))
    gpu = torch.device("cuda", 0)
    big, small = 200 * 1024, 100 * 1024  # one or two programs per SM
    assert launch._auto_splits(8, 64, gpu, big, waves=1) == 16  # batch 1 x 8 KV heads: one wave
    assert launch._auto_splits(8, 256, gpu, big, waves=2) == 33  # paged: two
    assert launch._auto_splits(128, 256, gpu, small, waves=2) == 4  # two programs per SM, two waves
    assert launch._auto_splits(8, 5, gpu, big, waves=1) == 5  # never more splits than key blocks
    assert launch._auto_splits(1, 4096, gpu, small, waves=2) == launch.MAX_SPLITS
    assert launch._auto_splits(512, 256, gpu, big, waves=1) == 1  # the GPU is full already
    assert launch._auto_splits(8, 64, torch.device("cpu"), big, waves=1) == 1
    # lengths per call (seqused_k): RAGGED_WAVES programs per SM whatever fits at once, each split
    # at least RAGGED_MIN_KEYS keys
    assert launch._auto_splits(384, 256, gpu, small, waves=2, ragged_blocks=32) == 5  # 48 decoding rows
    assert launch._auto_splits(384, 256, gpu, 70 * 1024, waves=2, ragged_blocks=32) == 5  # three per SM: the same
    assert launch._auto_splits(384, 256, gpu, small, waves=2, ragged_blocks=4) == 4  # 4k keys: 1k per split
    assert launch._auto_splits(8, 256, gpu, big, waves=2, ragged_blocks=32) == 33  # batch 1: the waves rule
    assert launch._auto_splits(8, 256, gpu, big, waves=1, ragged_blocks=32) == 16  # (contiguous: one wave)
    assert launch._auto_splits(384, 3, gpu, small, waves=2, ragged_blocks=32) == 3  # never more than key blocks


# ----------------------------------------------------------------- larger shapes, GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen,head_dim,causal", [(1024, 64, True), (2048, 128, True), (4096, 128, False),
                                                    (1031, 256, True), (2048, 96, False)])
def test_gpu_prefill_bf16(seqlen, head_dim, causal):
    q, k, v, out, lse = _dense(11, 1, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, causal=causal)
    _check("gpu prefill", out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
def test_gpu_decode_auto_split_equals_one_split():
    base = _dense(12, 2, 1, 8192, 32, 8, 128, torch.bfloat16, num_splits=1)
    q, k, v, out, lse = _dense(12, 2, 1, 8192, 32, 8, 128, torch.bfloat16, num_splits=0)
    _check("gpu decode", out, lse, q, k, v)
    torch.testing.assert_close(out, base[3], atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, base[4], atol=1e-4, rtol=1e-5)
