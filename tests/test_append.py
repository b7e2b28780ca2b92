"""The one-launch append of new keys and values to a KV cache (``tileattn.gpu.append_kv``).

Run in Triton's interpreter on the CPU (or on the GPU when there is one) against torch indexing
and ``tileattn.ops.rotary.apply_rotary``. Every cache slot starts as NaN: the slots the append
must write are checked against the expected values, every other slot must still be NaN.

Then the KV cache's value check folded into an appending decoding call's two launches (the
append kernel's ``CHECK``, the forward's ``CHECK_CACHE``), in Triton's interpreter with its
device assertions kept (tests/test_sync.py runs it on the GPU: bad values in subprocesses, the
folded and unfolded calls bitwise).
"""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn import gpu
from tileattn.ops.rotary import apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected_slots(lens, new, block_size, table):
    """(cache row or page, slot) of new token i of sequence b, for every (b, i)."""
    pos = lens.long()[:, None] + torch.arange(new)
    if table is None:
        return torch.arange(len(lens))[:, None].expand_as(pos), pos
    return table.long().gather(1, pos // block_size), pos % block_size


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
def test_append_writes_exactly_the_new_slots(paged, rotary):
    gen = torch.Generator().manual_seed(71)
    batch, new, nheads_k, nheads, head_dim, dtype = 3, 3, 2, 6, 40, torch.float16
    lens = torch.tensor([0, 5, 13], dtype=torch.int32)
    k, v = (torch.randn(batch, new, nheads_k, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(batch, new, nheads, head_dim, generator=gen).to(dtype)
    if paged:
        block_size, table = 4, torch.randperm(20, generator=gen)[:12].view(batch, 4).to(torch.int32)
        shape = (20, block_size, nheads_k, head_dim)
    else:
        block_size, table, shape = 16, None, (batch, 16, nheads_k, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    cos = sin = None
    if rotary:
        angles = torch.rand(32, 12, generator=gen) * 6.3  # rotary_dim 24 of head_dim 40
        cos, sin = angles.cos(), angles.sin()
    seqused = torch.full((batch,), -1, dtype=torch.int32)
    dev = [t.to(DEVICE) if t is not None else None for t in (k_cache, v_cache, k, v, lens, table, cos, sin, q)]
    q_rot = gpu.append_kv(*dev[:6], rotary_cos=dev[6], rotary_sin=dev[7], interleaved=rotary == "interleaved",
                          q=dev[8] if rotary else None, q_per_token=True, seqused_out=seqused.to(DEVICE))
    k_cache, v_cache = dev[0].cpu(), dev[1].cpu()

    rows, slots = _expected_slots(lens, new, block_size, table)
    pos = lens.long()[:, None] + torch.arange(new)
    k_want = apply_rotary(k, cos, sin, pos, rotary == "interleaved") if rotary else k
    torch.testing.assert_close(k_cache[rows, slots], k_want, rtol=0, atol=1e-3 if rotary else 0)
    torch.testing.assert_close(v_cache[rows, slots], v, rtol=0, atol=0)
    for cache in (k_cache, v_cache):
        untouched = torch.ones(cache.shape[:2], dtype=torch.bool)
        untouched[rows, slots] = False
        assert cache[untouched].isnan().all()
    if rotary:
        torch.testing.assert_close(q_rot.cpu(), apply_rotary(q, cos, sin, pos, rotary == "interleaved"), rtol=0,
                                   atol=1e-3)
    else:
        assert q_rot is None


def test_rotated_q_at_the_cache_length_and_new_lengths():
    """q at position cache_seqlens[b] for every token (not causal, not local); the lengths after
    the append come back; a view of a contiguous cache (cache_batch_idx as a one-page table)."""
    gen = torch.Generator().manual_seed(72)
    batch, new, head_dim = 2, 2, 32
    lens = torch.tensor([3, 7], dtype=torch.int32)
    k, v = (torch.randn(batch, new, 1, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(batch, new, 4, head_dim, generator=gen)[..., :head_dim]
    k_cache, v_cache = (torch.full((3, 10, 1, head_dim), float("nan")) for _ in range(2))
    rows = torch.tensor([2, 0], dtype=torch.int32)
    angles = torch.rand(16, head_dim // 2, generator=gen) * 6.3
    seqused = torch.full((batch,), -1, dtype=torch.int32)
    lens, k, v, q, k_cache, v_cache, rows, angles, seqused = (
        t.to(DEVICE) for t in (lens, k, v, q, k_cache, v_cache, rows, angles, seqused))
    q_rot = gpu.append_kv(k_cache, v_cache, k, v, lens, rows.view(batch, 1), rotary_cos=angles.cos(),
                          rotary_sin=angles.sin(), interleaved=False, q=q, q_per_token=False, seqused_out=seqused)
    torch.testing.assert_close(seqused, lens + new, rtol=0, atol=0)
    at_len = lens.long()[:, None].expand(batch, new)
    torch.testing.assert_close(q_rot, apply_rotary(q, angles.cos(), angles.sin(), at_len, False), rtol=0, atol=1e-5)
    pos = lens.long()[:, None] + torch.arange(new, device=DEVICE)
    torch.testing.assert_close(v_cache[rows.long()[:, None], pos], v, rtol=0, atol=0)
    assert v_cache[1].isnan().all()


def test_nothing_new_leaves_the_cache_and_reports_the_lengths():
    k_cache = torch.full((2, 8, 1, 16), float("nan"))
    lens = torch.tensor([2, 8], dtype=torch.int32)
    seqused = torch.full((2,), -1, dtype=torch.int32)
    empty = torch.empty(2, 0, 1, 16)
    gpu.append_kv(k_cache, k_cache, empty, empty, lens, seqused_out=seqused)
    assert k_cache.isnan().all()
    torch.testing.assert_close(seqused, lens, rtol=0, atol=0)


# ------------------------------------------------------------------ the check folded into the appending lane


def _appending_call(paged: bool, rotary: bool, gen, device: str = "cpu"):
    """(call(lens, table=None, caches=None), caches, good lengths, good table) of one appending
    signature on ``device`` (CPU tensors, which the interpreter runs, unless told): batch 2, two new
    tokens, a capacity of 12 (contiguous, or 3 pages of 4 from a pool of 9), rotary tables of 11 rows
    (one fewer than the capacity) when ``rotary``."""
    q = torch.randn(2, 2, 4, 16, generator=gen).to(device)
    new = torch.randn(2, 2, 2, 16, generator=gen).to(device)
    cache = (torch.randn(9, 4, 2, 16, generator=gen) if paged else torch.randn(2, 12, 2, 16, generator=gen)).to(device)
    table = torch.tensor([[3, 1, 0], [2, 5, 8]], dtype=torch.int32, device=device) if paged else None
    angles = torch.rand(11, 4, generator=gen) * 6.3
    rope = dict(rotary_cos=angles.cos().to(device), rotary_sin=angles.sin().to(device)) if rotary else {}

    def call(lens, tbl=table, caches=None):
        k_cache, v_cache = caches or (cache, cache)
        return tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, **rope, causal=True,
                                                cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                                                block_table=tbl, return_softmax_lse=True)

    return call, (cache, cache), [3, 7], table


def _count_launches(monkeypatch) -> list:
    """A list that grows by one name per kernel launch through ``_launch.Launch`` (the ops layer's
    launches all go through one): "check", "append", "forward" or "combine", with "+check" after
    the append's and the forward's when their checked variant is launched."""
    from tileattn.gpu import _launch

    seen, call = [], _launch.Launch.__call__

    def counted(self, grid, *args):
        name = {"_cache_check_kernel": "check", "_append_kv_kernel": "append", "_attn_fwd_kernel": "forward",
                "_combine_kernel": "combine"}[self.fn.__name__]
        seen.append(name + ("+check" if self.constexprs.get("CHECK") or self.constexprs.get("CHECK_CACHE") else ""))
        return call(self, grid, *args)

    monkeypatch.setattr(_launch.Launch, "__call__", counted)
    return seen


_APPEND_BAD = {  # name: (cache_seqlens, table or None (the good one), the kernel that asserts)
    "no room for the new tokens": ([5, 11], None, "append"),
    "negative length": ([-1, 3], None, "append"),
    "largest length": ([5, 2**31 - 1], None, "append"),
    "block id past the pool, page written": ([5, 4], [[3, 1, 0], [2, 9, 8]], "append"),
    "negative block id, page written": ([5, 4], [[3, 1, 0], [2, -3, 8]], "append"),
    "block id past the pool, page read only": ([5, 4], [[3, 1, 0], [9, 5, 8]], "forward"),
}


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_the_appending_lane_checks_the_cache_in_its_two_launches(device_checks, asserting_interpreter, monkeypatch,
                                                                 paged, rotary):
    """A kept appending signature's call launches the append and the forward, each checking the cache
    values it writes or reads by (``CHECK``, ``CHECK_CACHE``), and no separate check: two launches, the
    bits (output, lse, cache) of the unchecked kernels. Each bad value fails the kernel that depends on
    it first with the check kernel's message; one past the rotary tables' rows fails the append."""
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    from tileattn.ops import _validate

    call, (cache, _), good, table = _appending_call(paged, rotary, torch.Generator().manual_seed(91))
    call(good)  # the signature's first call: the separate check, then the lane is prepared
    launches = _count_launches(monkeypatch)
    folded_cache = cache.clone()
    folded = call(good, caches=(folded_cache, folded_cache))
    assert launches == ["append+check", "forward+check"]
    with monkeypatch.context() as m:
        m.setattr(_validate, "value_mode", lambda t: None)  # no value check at all: the unchecked kernels
        plain_cache = cache.clone()
        plain = call(good, caches=(plain_cache, plain_cache))
    assert launches[2:] == ["append", "forward"]
    assert all(torch.equal(a, b) for a, b in zip(folded, plain)) and torch.equal(folded_cache, plain_cache)
    cases = dict(_APPEND_BAD, **({"past the rotary tables": ([5, 10], None, "append")} if rotary else {}))
    for name, (lens, bad_table, kernel) in cases.items():
        if bad_table is not None and not paged:
            continue
        del launches[:]
        bad_cache = cache.clone()  # k and v one tensor, as in the signature's calls above (the memo keys that)
        with pytest.raises(Exception, match="tileattn: a KV cache's lengths"):
            call(lens, table if bad_table is None else torch.tensor(bad_table, dtype=torch.int32),
                 caches=(bad_cache, bad_cache))
        assert launches[-1] == kernel + "+check" and "check" not in launches, name


@pytest.mark.parametrize("case", ["FOLD_APPEND_CHECK off", "assertions dropped", "host checks", "no checks"])
def test_the_appending_lane_keeps_the_check_apart_where_the_fold_does_not_apply(device_checks, asserting_interpreter,
                                                                                monkeypatch, case):
    """The lane without the fold: the separate check then the unchecked append and forward (the
    constant off, or kernels that drop their assertions: Triton's interpreter on CPU tensors), the
    unchecked ones alone (the values checked on the host, or not at all: capture, compile, =0)."""
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    from tileattn.ops import _validate
    from tileattn.ops import kvcache as kv_ops

    kv_ops._CHECKED.clear()
    if case == "FOLD_APPEND_CHECK off":
        monkeypatch.setattr(kv_ops, "FOLD_APPEND_CHECK", False)
    elif case == "assertions dropped":
        monkeypatch.setattr(_validate, "kernel_asserts", lambda t: False)
    call, _, good, _ = _appending_call(True, True, torch.Generator().manual_seed(92))
    call(good)
    launches = _count_launches(monkeypatch)
    if case in ("host checks", "no checks"):
        monkeypatch.setattr(_validate, "value_mode", lambda t: "host" if case == "host checks" else None)
    call(good)
    assert launches == (["append", "forward"] if case in ("host checks", "no checks") else ["check", "append", "forward"])
    if case != "no checks":
        with pytest.raises(Exception, match="cache_seqlens|tileattn: a KV cache's lengths"):
            call([5, 11])


def test_the_appending_lane_launches_no_check_for_paged_kv_cache_tensors(device_checks, asserting_interpreter,
                                                                         monkeypatch):
    """PagedKVCache vouches for its lengths and block table (their values known on the host, checked
    there): the lane launches the unchecked append and forward alone, as the full path did."""
    from tileattn.ops import kvcache as kv_ops

    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    kv_ops._CHECKED.clear()
    gen = torch.Generator().manual_seed(95)
    cache = tileattn.PagedKVCache(1, num_blocks=16, block_size=4, nheads_k=2, headdim=16, dtype=torch.float32)
    ids = [cache.allocate() for _ in range(2)]
    for seq_id, n in zip(ids, (3, 7)):
        cache.reserve([seq_id], n)
        cache.advance([seq_id], n)
    q, new = torch.randn(2, 1, 4, 16, generator=gen), torch.randn(2, 1, 2, 16, generator=gen)
    table = torch.zeros(2, 4, dtype=torch.int32)

    def step():
        cache.reserve(ids, 1)
        tileattn.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0], k=new, v=new, causal=True,
                                         cache_seqlens=cache.seqlens(ids), block_table=cache.block_table(ids, table))
        cache.advance(ids, 1)

    step()
    launches = _count_launches(monkeypatch)
    step()
    (plan,) = kv_ops._CHECKED.entries.values()
    assert launches == ["append", "forward"] and plan.direct and plan.fold


@pytest.mark.parametrize("paged", [False, True])
def test_an_append_program_that_finds_a_bad_value_writes_nothing(device_checks, monkeypatch, paged):
    """Were the append's device assertion to return (it traps), its program would write no key or value
    and its sequence's length after the append would come out as -1, which the forward's own check
    refuses: that sequence's rows come out empty (0, lse -inf) and its slots as they were, the other
    sequence's as before (the interpreter, whose assertions are off by default, stands for that)."""
    from tileattn.gpu._tuning import interpreting
    from tileattn.ops import _validate

    if not interpreting():
        pytest.skip("Triton's interpreter only")
    monkeypatch.setattr(_validate, "kernel_asserts", lambda t: True)  # the fold taken, its assertions off
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    call, (cache, _), good, _ = _appending_call(paged, False, torch.Generator().manual_seed(93))
    first_cache = cache.clone()  # k and v one tensor in every call: one signature (the memo keys that)
    call(good, caches=(first_cache, first_cache))
    good_cache = cache.clone()
    good_out, good_lse = call(good, caches=(good_cache, good_cache))
    bad_cache = cache.clone()  # sequence 1: a block id past the pool where it writes, or no room left
    bad = torch.tensor([[3, 1, 0], [2, 9, 8]], dtype=torch.int32) if paged else None
    out, lse = call([3, 4] if paged else [3, 11], bad, caches=(bad_cache, bad_cache))
    assert torch.equal(out[0], good_out[0]) and torch.equal(lse[0], good_lse[0])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    want = cache.clone()  # sequence 0's new slots written, sequence 1's not
    if paged:
        want[3, 3], want[1, 0] = good_cache[3, 3], good_cache[1, 0]
    else:
        want[0, 3:5] = good_cache[0, 3:5]
    assert torch.equal(bad_cache, want)


@pytest.mark.parametrize("paged", [False, True])
def test_the_appending_lane_bumps_the_caches_versions(monkeypatch, paged):
    """Every appending call tells autograd that it wrote the caches (their version counters), the
    kept signature's lane as its first call: a tensor saved for a backward that shares a cache's
    storage must fail that backward after any append, not only after the first."""
    from tileattn.ops import kvcache as kv_ops

    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    kv_ops._CHECKED.clear()
    call, (cache, _), good, _ = _appending_call(paged, True, torch.Generator().manual_seed(97), DEVICE)
    k_cache = cache.clone()
    v_cache = cache.clone()
    for _ in range(3):
        versions = k_cache._version, v_cache._version
        call(good, caches=(k_cache, v_cache))
        assert k_cache._version > versions[0] and v_cache._version > versions[1]
    (plan,) = kv_ops._CHECKED.entries.values()
    assert plan.direct
