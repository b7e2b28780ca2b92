"""The Gluon FP8 decode (``kernels/decode_fp8_hopper.py``, launched by ``gpu/hopper_fp8.py``).

On a CPU: the rule (``hopper_fp8_decode_reason``) with the device stood in for as an H200, the
switch ``TILEATTN_HOPPER=0``, the split count, the launch's arguments (recorded instead of compiled,
as tests/test_hopper_host.py does) and the dispatch of ``attn_fwd`` / ``plan_fwd``. On a GPU (marked
``gpu``): the outputs against the float64 reference over the dequantised cache, within the budget of
plain attention in q's dtype over that cache (tests/tolerance.py; the FP8 budget of test_serving.py's
FP8 tests: the quantisation itself is in the reference, the kernel's fp16 products are judged against
torch's bf16 ones), on paged pools of 16 and 256 keys whose block tables are random permutations with
NaN in every unused slot, and on contiguous caches.
"""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn import reference as R
from tileattn.contract import AttnParams
from tileattn.gpu import hopper, hopper_fp8
from tileattn.ops.fp8 import FP8_DTYPE, quantize
from tolerance import assert_within, plain_attention

D = 128


def _call(batch=2, sq=1, nheads=32, nheads_k=8, page=16, blocks=8, dtype=torch.bfloat16, d=D, paged=True,
          cache_dtype=FP8_DTYPE):
    """(q, k, v, kwargs of the rule) for a decoding call over an FP8 cache (CPU tensors)."""
    q = torch.randn(batch, sq, nheads, d).to(dtype)
    if paged:
        k = torch.zeros(batch * blocks + 3, page, nheads_k, d).to(cache_dtype)
        table = torch.randperm(batch * blocks + 3)[:batch * blocks].view(batch, blocks).to(torch.int32)
    else:
        k, table = torch.zeros(batch, page * blocks, nheads_k, d).to(cache_dtype), None
    descale = torch.rand(batch, nheads_k)
    return q, k, k.clone(), dict(alibi_slopes=None, varlen=False, block_table=table, learnable_sink=None,
                                 k_descale=descale, v_descale=descale.clone())


@pytest.fixture
def h200(monkeypatch):
    """The device stood in for as an H200 with Gluon (not Triton's interpreter), the switch on."""
    monkeypatch.setattr(hopper, "device_kind_reason", lambda q: None)
    monkeypatch.setattr(hopper, "interpreting", lambda: False)
    monkeypatch.setenv("TILEATTN_HOPPER", "1")


PARAMS = AttnParams(D**-0.5, -1, 0)  # causal, as engines decode


@pytest.mark.parametrize("case", [dict(), dict(page=256, blocks=2), dict(paged=False), dict(page=32),
                                  dict(nheads=8, nheads_k=8), dict(nheads=64, nheads_k=8), dict(sq=2, nheads=32),
                                  dict(dtype=torch.float16), dict(page=128, blocks=3)])
def test_rule_takes_fp8_decoding_calls(h200, case):
    q, k, v, kw = _call(**case)
    assert hopper_fp8.hopper_fp8_decode_reason(q, k, v, PARAMS, **kw) is None


@pytest.mark.parametrize("change, words", [
    (lambda q, k, v, kw, p: (q, k, v, dict(kw, k_descale=None, v_descale=None), p), "not an FP8 cache"),
    (lambda q, k, v, kw, p: (q, k.to(torch.bfloat16), v.to(torch.bfloat16), kw, p), "dtypes"),
    (lambda q, k, v, kw, p: (q.float(), k, v, kw, p), "dtypes"),
    (lambda q, k, v, kw, p: (q, k, v, dict(kw, varlen=True), p), "packed queries"),
    (lambda q, k, v, kw, p: (q[..., :64], k[..., :64], v[..., :64], kw, p), "head dims"),
    (lambda q, k, v, kw, p: (q.expand(2, 3, 32, D), k, v, kw, p), "query rows per KV head"),
    (lambda q, k, v, kw, p: (q, k, v, dict(kw, learnable_sink=torch.zeros(32)), p), "learnable sinks"),
    (lambda q, k, v, kw, p: (q, k, v, kw, AttnParams(D**-0.5, 128, 0)), "sliding window"),
    (lambda q, k, v, kw, p: (q, k, v, kw, AttnParams(D**-0.5, -1, -1, 30.0)), "softcap"),
    (lambda q, k, v, kw, p: (q, k, v, dict(kw, alibi_slopes=torch.rand(2, 32)), p), "ALiBi"),
    (lambda q, k, v, kw, p: (q, k[:, :8], v[:, :8], kw, p), "pages of 8"),
    (lambda q, k, v, kw, p: (q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), kw, p), "pages of 48"),
    (lambda q, k, v, kw, p: (q, k, v[..., :64], kw, p), "head dims"),
])
def test_rule_declines(h200, change, words):
    q, k, v, kw, params = change(*_call(), PARAMS)
    why = hopper_fp8.hopper_fp8_decode_reason(q, k, v, params, **kw)
    assert why is not None and words in why, why


def test_rule_declines_a_group_of_more_than_8_and_misaligned_caches(h200):
    q, k, v, kw = _call(nheads=128, nheads_k=8)
    assert "query rows per KV head" in hopper_fp8.hopper_fp8_decode_reason(q, k, v, PARAMS, **kw)
    q, k, v, kw = _call()
    flat = torch.empty(k.numel() + 1, dtype=torch.uint8).view(FP8_DTYPE)
    odd = flat[1:].view(k.shape)  # one byte past an aligned start
    assert hopper_fp8.hopper_fp8_decode_reason(q, odd, odd, PARAMS, **kw) == "strides not 16-byte aligned"


def test_switch_and_device_turn_it_off(monkeypatch):
    q, k, v, kw = _call()
    monkeypatch.setattr(hopper, "device_kind_reason", lambda q: None)
    monkeypatch.setattr(hopper, "interpreting", lambda: False)
    monkeypatch.setenv("TILEATTN_HOPPER", "0")
    assert hopper_fp8.hopper_fp8_decode_reason(q, k, v, PARAMS, **kw) == "TILEATTN_HOPPER=0"
    monkeypatch.setenv("TILEATTN_HOPPER", "1")
    assert hopper_fp8.hopper_fp8_decode_reason(q, k, v, PARAMS, **kw) is None
    monkeypatch.undo()
    assert hopper_fp8.hopper_fp8_decode_reason(q, k, v, PARAMS, **kw) is not None  # a CPU: never


def test_splits():
    # serving.py's fp8 row: 64 sequences x 8 KV heads over 32k keys on 132 SMs: 3 splits (1,536 items)
    assert hopper_fp8.fp8_decode_splits(512, 32768, 132) == 3
    assert hopper_fp8.fp8_decode_splits(8, 32768, 132) == 32  # one sequence: ITEMS_PER_SM, capped by MAX_SPLITS
    assert hopper_fp8.fp8_decode_splits(8, 1000, 132) == 1  # fewer than MIN_SPLIT_TILES tiles
    assert hopper_fp8.fp8_decode_splits(8, 0, 132) == 1
    assert hopper_fp8.fp8_decode_splits(512, 32768, 132, num_splits=5) == 5  # the caller's count
    assert hopper_fp8.fp8_decode_splits(512, 200, 132, num_splits=5) == 2  # never more than tiles


@pytest.fixture
def launches(monkeypatch):
    """The Gluon launches recorded instead of compiled: (kernel, constexprs, grid, arguments) each."""
    recorded = []
    monkeypatch.setattr(hopper, "launch_of", lambda kernel, args, constexprs:
                        lambda grid, *args: recorded.append((kernel, constexprs, grid, args)))
    hopper._DESCRIPTOR_FIELDS.clear()
    return recorded


@pytest.mark.parametrize("page, paged, sq, nheads, splits", [(16, True, 1, 32, 0), (256, True, 2, 16, 3),
                                                             (16, False, 1, 8, 1)])
def test_launch_arguments(launches, page, paged, sq, nheads, splits):
    """The launch: descriptors over the cache in [1, min(page, 128), 1, 128] tiles (128 keys for a
    contiguous cache), q and the 2 x splits partials by their strides, the descales, the lengths
    and table; constexprs; one program per SM at most; the combine reads the partials' layout."""
    from tileattn.kernels.decode_fp8_hopper import _decode_fp8_hopper_kernel

    batch, blocks = 2, (8 if page == 16 else 2)
    q, k, v, kw = _call(batch=batch, sq=sq, nheads=nheads, page=page, blocks=blocks, paged=paged)
    out, lse = torch.empty_like(q), torch.empty(batch, nheads, sq)
    used = torch.tensor([0, 100], dtype=torch.int32)
    table = kw["block_table"]
    plan = hopper_fp8.Fp8DecodePlan(q, k, out, lse, PARAMS, block_table=table, seqused_k=used, max_seqlen_k=0,
                                    num_splits=splits, fallback=None)
    parts = plan.new_workspace("cpu")
    plan.fwd(k, v, q, *parts, kw["k_descale"], kw["v_descale"], used, table)
    (kernel, constexprs, grid, args), = launches
    keys = blocks * page
    want_splits = splits or hopper_fp8.fp8_decode_splits(batch * 8, keys, 132)
    assert plan.num_splits == want_splits
    assert kernel is _decode_fp8_hopper_kernel and grid == (min(batch * 8 * want_splits, 132), 1, 1)
    assert constexprs == dict(GROUP=nheads // 8, HAS_SEQUSED=True, CAUSAL=sq > 1, PAGE=page if paged else 0,
                              STAGES=hopper_fp8.FP8_DECODE_STAGES, OVERLAP=hopper_fp8.FP8_DECODE_OVERLAP)
    block = [1, min(page, 128) if paged else 128, 1, D]
    for desc, base in zip(args[:2], (k, v)):
        assert desc.base is base and desc.block_shape == block and desc.shape == list(base.shape)
    assert args[2] is q and args[3] is parts[0] and args[4] is parts[1]
    assert args[5] is kw["k_descale"] and args[7] is used and args[8] is table
    o_shape, l_shape = plan.workspace_shapes
    assert o_shape == (2 * want_splits, batch, sq, nheads, D) and l_shape == (2 * want_splits, batch, nheads, sq)
    po, pl = parts[0].stride(), parts[1].stride()
    tiles = -(-keys // 128)
    assert args[9:] == (*q.stride()[:3], po[1], po[2], po[3], po[0], pl[1], pl[2], pl[3], pl[0],
                        *((table.stride(0), table.shape[1]) if paged else (0, 0)), batch, 8, sq, keys, want_splits,
                        -(-tiles // want_splits), pytest.approx(D**-0.5 * 1.4426950408889634))
    assert plan.combine_grid == (batch * sq * nheads, 1, 1)


@pytest.mark.parametrize("overlap", [True, False])
def test_launch_takes_the_overlap_switch(launches, monkeypatch, overlap):
    """``FP8_DECODE_OVERLAP`` (read when a plan is made) is the kernel's ``OVERLAP``: the A/B's switch."""
    monkeypatch.setattr(hopper_fp8, "FP8_DECODE_OVERLAP", overlap)
    q, k, v, kw = _call()
    used = torch.tensor([0, 100], dtype=torch.int32)
    plan = hopper_fp8.Fp8DecodePlan(q, k, torch.empty_like(q), torch.empty(2, 32, 1), PARAMS,
                                    block_table=kw["block_table"], seqused_k=used, max_seqlen_k=0, num_splits=0,
                                    fallback=None)
    plan.fwd(k, v, q, *plan.new_workspace("cpu"), kw["k_descale"], kw["v_descale"], used, kw["block_table"])
    (_, constexprs, _, _), = launches
    assert constexprs["OVERLAP"] is overlap


def test_attn_fwd_and_plan_fwd_take_the_rule(monkeypatch):
    """``attn_fwd`` and ``plan_fwd`` over an FP8 cache run the Gluon plan where the rule says yes (kept
    per signature and scale), the portable plan where it says no; ``plan_partials`` never takes it."""
    from tileattn.gpu import attention as A

    ran = []
    monkeypatch.setattr(hopper_fp8.Fp8DecodePlan, "run", lambda self, *a, **kw: ran.append(self))
    q, k, v, kw = _call()
    out, lse = torch.empty_like(q), torch.empty(2, 32, 1)
    used = torch.tensor([3, 100], dtype=torch.int32)
    call = dict(params=PARAMS, seqused_k=used, block_table=kw["block_table"], max_seqlen_q=1, max_seqlen_k=128,
                num_splits=0, k_descale=kw["k_descale"], v_descale=kw["v_descale"])
    A.clear_plans()
    monkeypatch.setattr(A, "hopper_fp8_decode_reason", lambda *a, **k: None)
    A.attn_fwd(q, k, v, out, lse, **call)
    A.attn_fwd(q, k, v, out, lse, **call)
    assert len(ran) == 2 and ran[0] is ran[1] and len(A._FP8_PLANS) == 1
    plan = A.plan_fwd(q, k, v, out, lse, **{n: x for n, x in call.items() if n != "v_descale"})
    assert plan is ran[0]
    assert isinstance(A.plan_partials(q[:1], k, v, params=PARAMS, max_seqlen_q=1, max_seqlen_k=128,
                                      seqused_k=used[:1], block_table=kw["block_table"][:1], num_splits=2,
                                      k_descale=kw["k_descale"][:1]), A.FwdPlan)
    monkeypatch.setattr(A, "hopper_fp8_decode_reason", lambda *a, **k: "no")
    assert isinstance(A.plan_fwd(q, k, v, out, lse, **{n: x for n, x in call.items() if n != "v_descale"}), A.FwdPlan)
    A.clear_plans()
    assert not A._FP8_PLANS


# ------------------------------------------------------------------------------------------- GPU


def _pool(lens, page, nheads_k, gen, paged):
    """(k real, k descale, v real, v descale, k cache, v cache, table): per sequence ``lens[b]`` keys,
    quantised; a paged pool whose table is a random permutation of a pool larger than needed, with
    NaN in every unused slot (past a sequence's keys and in unused pages), or a contiguous cache."""
    batch, cap = len(lens), max(max(lens), 1)
    blocks = -(-cap // page)
    k_real, v_real = (torch.randn(batch, blocks * page, nheads_k, D, generator=gen) for _ in range(2))
    k_descale, v_descale = ((x.abs().amax(dim=(1, 3)) / 448 * (1 + torch.rand(batch, nheads_k, generator=gen)))
                            for x in (k_real, v_real))
    k_q, v_q = quantize(k_real, k_descale), quantize(v_real, v_descale)
    for b, n in enumerate(lens):
        k_q[b, n:], v_q[b, n:] = float("nan"), float("nan")
    if not paged:
        return k_descale, v_descale, k_q, v_q, None
    pool = batch * blocks + 5
    table = torch.randperm(pool, generator=gen)[:batch * blocks].view(batch, blocks).to(torch.int32)
    k_cache, v_cache = (torch.full((pool, page, nheads_k, D), float("nan")).to(FP8_DTYPE) for _ in range(2))
    for b in range(batch):
        for p in range(blocks):
            k_cache[table[b, p]] = k_q[b, p * page:(p + 1) * page]
            v_cache[table[b, p]] = v_q[b, p * page:(p + 1) * page]
    return k_descale, v_descale, k_cache, v_cache, table


def _dense_cache(cache, table, b, n, page):
    if table is None:
        return cache[b, :n]
    rows = torch.tensor([int(table[b, p // page]) * page + p % page for p in range(n)], dtype=torch.long)
    return cache.flatten(0, 1)[rows]


def _check(q, lens, page, paged, splits, nheads_k, gen, dtype=torch.bfloat16, scale=D**-0.5):
    pool = _pool(lens, page, nheads_k, gen, paged)
    out, lse = _decode(q, lens, pool, splits, scale)
    _compare(q, lens, page, pool, out, lse, dtype, scale)


def _decode(q, lens, pool, splits, scale=D**-0.5):
    """(out, lse) on the CPU of the Gluon FP8 decode of q over ``pool`` (``_pool``'s), a fresh plan."""
    from tileattn.gpu import attention as A

    k_descale, v_descale, k_cache, v_cache, table = pool
    dev = "cuda"
    used = torch.tensor(lens, dtype=torch.int32)
    args = dict(alibi_slopes=None, varlen=False, block_table=None if table is None else table.to(dev),
                learnable_sink=None, k_descale=k_descale.to(dev), v_descale=v_descale.to(dev))
    qd, kd, vd = q.to(dev), k_cache.to(dev), v_cache.to(dev)
    assert hopper_fp8.hopper_fp8_decode_reason(qd, kd, vd, AttnParams(D**-0.5, -1, 0), **args) is None, \
        "the rule does not take the call on this GPU"
    A.clear_plans()
    out, lse = tileattn.flash_attn_with_kvcache(
        qd, kd, vd, cache_seqlens=used.to(dev), block_table=args["block_table"], causal=True, softmax_scale=scale,
        return_softmax_lse=True, num_splits=splits, k_descale=args["k_descale"], v_descale=args["v_descale"])
    assert len(A._FP8_PLANS) == 1, "the Gluon FP8 decode did not take the call"
    return out.cpu(), lse.cpu()


def _compare(q, lens, page, pool, out, lse, dtype, scale):
    """out and lse against the float64 reference over the dequantised cache (tolerance rule)."""
    k_descale, v_descale, k_cache, v_cache, table = pool
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all(), "a sequence with no keys"
            continue
        k_b = _dense_cache(k_cache, table, b, n, page).double() * k_descale[b].double()[None, :, None]
        v_b = _dense_cache(v_cache, table, b, n, page).double() * v_descale[b].double()[None, :, None]
        ref_o, ref_lse = R.attention_naive(q[b:b + 1].double().numpy(), k_b[None].numpy(), v_b[None].numpy(),
                                           softmax_scale=scale, causal=True)
        plain_o, plain_lse = plain_attention(q[b:b + 1], k_b[None].to(dtype), v_b[None].to(dtype),
                                             softmax_scale=scale, causal=True)
        assert_within(f"out[{b}] ({n} keys)", out[b:b + 1], plain_o, ref_o)
        assert_within(f"lse[{b}] ({n} keys)", lse[b:b + 1], plain_lse, ref_lse)


LENS = {16: [0, 1, 15, 16, 17, 127, 128, 129, 200, 1000], 256: [0, 1, 255, 256, 257, 383, 1, 700],
        0: [0, 1, 63, 64, 65, 129, 300, 517]}


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256, 0])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 0, 3])
def test_fp8_decode_matches_the_dequantised_reference(page, group, splits):
    """One query row per sequence: lengths 0, 1, a page's boundary +-1, not multiples of the 128-key
    tile; GQA 1, 4 and 8; one split, the automatic count and 3."""
    gen = torch.Generator().manual_seed(1900 + page + group + splits)
    lens = LENS[page]
    nheads_k = 2
    q = torch.randn(len(lens), 1, nheads_k * group, D, generator=gen).to(torch.bfloat16)
    _check(q, lens, page or 64, page > 0, splits, nheads_k, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("sq, group", [(2, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_decode_speculative_rows_causal(sq, group, dtype):
    """Several query rows per sequence (speculative decoding): the causal diagonal, bottom-right."""
    gen = torch.Generator().manual_seed(1910 + sq)
    lens = [3, 16, 130, 600]
    q = torch.randn(len(lens), sq, 2 * group, D, generator=gen).to(dtype)
    _check(q, lens, 16, True, 0, 2, gen, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("q_size", [4e4, 1e-6])
def test_fp8_decode_any_q_magnitude(q_size):
    """q scaled by a power of two into fp16's range first, as the portable FP8 path: entries of 4e4
    (past fp16's 65504 once multiplied out) and 1e-6 (fp16 subnormals unscaled), with the largest
    entries and an exact zero in one row; softmax_scale keeps the scores O(1), so that the
    reference and the plain-torch budget describe the same softmax."""
    gen = torch.Generator().manual_seed(1920)
    lens = [7, 300]
    q = (torch.randn(len(lens), 1, 8, D, generator=gen) * q_size).to(torch.bfloat16)
    q[0, 0, 0, :3] = torch.tensor([2 * q_size, -3 * q_size, 0.0])
    _check(q, lens, 16, True, 0, 2, gen, scale=D**-0.5 / q_size)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256, 0])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 0, 3])
def test_fp8_decode_overlap_is_bitwise_the_same(monkeypatch, page, group, splits):
    """``OVERLAP`` on and off give the same bits (out and lse): every product sees the same operands and
    accumulator, only the waits move. Lengths as the reference test's (items of 1 to 8 tiles, so
    the overlapped loop runs 0 to 7 times), NaN in every unused slot; then the flag's output against
    the float64 reference."""
    gen = torch.Generator().manual_seed(1930 + page + group + splits)
    lens = LENS[page]
    q = torch.randn(len(lens), 1, 2 * group, D, generator=gen).to(torch.bfloat16)
    pool = _pool(lens, page or 64, 2, gen, page > 0)
    got = {}
    for overlap in (False, True):
        monkeypatch.setattr(hopper_fp8, "FP8_DECODE_OVERLAP", overlap)
        got[overlap] = _decode(q, lens, pool, splits)  # a fresh plan: the flag is read when it is made
    for off, on in zip(got[False], got[True]):
        assert not on.isnan().any()
        assert torch.equal(on, off), f"max |on - off| {(on.float() - off.float()).abs().max().item()}"
    _compare(q, lens, page or 64, pool, *got[True], torch.bfloat16, D**-0.5)


@pytest.mark.gpu
def test_fp8_decode_overlap_speculative_rows_bitwise(monkeypatch):
    """Two causal rows x GQA 4 over long sequences (up to 24 tiles in one split): on and off agree bitwise."""
    gen = torch.Generator().manual_seed(1940)
    lens = [3, 129, 1500, 3000]
    q = torch.randn(len(lens), 2, 8, D, generator=gen).to(torch.float16)
    pool = _pool(lens, 16, 2, gen, True)
    got = {}
    for overlap in (False, True):
        monkeypatch.setattr(hopper_fp8, "FP8_DECODE_OVERLAP", overlap)
        got[overlap] = _decode(q, lens, pool, 1)
    for off, on in zip(got[False], got[True]):
        assert torch.equal(on, off), f"max |on - off| {(on.float() - off.float()).abs().max().item()}"
