"""The fast lane (``tileattn.ops._custom.prepare``, ``tileattn.gpu.prepared``): a kept signature's
launch decided once, after its first call. It must be taken (counted), give each call's own answer (new values, lengths,
cache contents, q), leave the calls it cannot serve (gradients, dropout, prefill
shapes the Hopper kernel may take) to the full path, and keep every value check.

On the Triton backend: CUDA tensors on a GPU, else CPU tensors in Triton's interpreter; without a
GPU every test that is not about Triton's plans also runs on the CPU tiles, whose lane
(``tileattn.cpu.prepared``) binds the options and leaves the rest to ``attn_fwd``, or for a
one-tile problem to its one-tile step (``fwd_one_tile``)."""

import pytest
import torch

import tileattn
from tileattn.gpu import attention as A
from tileattn.gpu import prepared
from tileattn.contract import AttnParams
from tileattn.ops import _validate as V
from tileattn.ops import attention as dense_ops
from tileattn.ops import kvcache as kv_ops
from tileattn.ops._custom import GraphLane
from tileattn.ops.rotary import apply_rotary
from test_memo import assert_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, params=["triton", "cpu"] if DEV == "cpu" else ["triton"])
def backend(request, monkeypatch):
    """The Triton kernels (the interpreter without a GPU) or, without a GPU, also the CPU tiles
    (``tileattn.cpu.prepared``: their lane binds the options only); value checks on the host,
    fresh memos."""
    if DEV == "cpu":
        monkeypatch.setenv("TILEATTN_BACKEND", request.param)
    else:
        monkeypatch.setenv("TILEATTN_DEBUG_CHECKS", "1")
    kv_ops._CHECKED.clear()
    dense_ops._CHECKED.clear()
    return request.param


def entry(memo):
    """The one entry of a memo."""
    (value,) = memo.entries.values()
    return value


def check_rows(out, lse, q, k_cache, v_cache, lens, table=None, **opts):
    """Each sequence's (out, lse) against the reference over its first lens[b] keys."""
    for b, n in enumerate(lens.tolist()):
        k, v = k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        if table is not None:  # the sequence's pages in order, as a dense cache
            page = k_cache.shape[1]
            k, v = (c[table[b].long()].reshape(1, -1, *c.shape[2:])[:, :n] for c in (k_cache, v_cache))
            assert k.shape[1] == n and table.shape[1] * page >= n
        assert_attention(out[b:b + 1].cpu(), lse[b:b + 1].cpu(), q[b:b + 1].cpu(), k.cpu(), v.cpu(), **opts)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_kvcache_lane_is_taken_and_reads_each_calls_tensors(paged, num_splits):
    """One signature, five calls: new q, cache contents and lengths, in new tensors and in place."""
    gen = torch.Generator().manual_seed(81)
    batch, cap, page = 2, 24, 8
    table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32).to(DEV) if paged else None
    shape = (6, page, 2, 16) if paged else (batch, cap, 2, 16)
    lens = torch.empty(batch, dtype=torch.int32, device=DEV)
    for step in range(5):
        q = torch.randn(batch, 1, 4, 16, generator=gen).to(DEV)  # a new tensor every call
        k_cache, v_cache = (torch.randn(shape, generator=gen).to(DEV) for _ in range(2))
        lens.copy_(torch.tensor([3 + 4 * step, cap - step], dtype=torch.int32))  # in place
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                    num_splits=num_splits, causal=True, return_softmax_lse=True)
        check_rows(out, lse, q, k_cache, v_cache, lens, table, causal=True)
    assert entry(kv_ops._CHECKED).lane.calls == 4  # all but the first, which prepares it


def test_kvcache_lane_copies_a_strided_q_every_call():
    """A q whose last dim is strided is copied before the launch, on the lane's calls too."""
    gen = torch.Generator().manual_seed(88)
    k_cache, v_cache = (torch.randn(2, 12, 2, 16, generator=gen).to(DEV) for _ in range(2))
    lens = torch.tensor([4, 11], dtype=torch.int32, device=DEV)
    for _ in range(3):
        q = torch.randn(2, 1, 4, 16, 2, generator=gen).to(DEV)[..., 0]  # last-dim stride 2
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True)
        check_rows(out, lse, q, k_cache, v_cache, lens)
    assert entry(kv_ops._CHECKED).lane.calls == 2


def test_kvcache_lane_with_append_and_return_variants():
    """Appending new keys every step (the lengths grow), with and without the lse returned."""
    gen = torch.Generator().manual_seed(82)
    batch, cap = 2, 16
    k_cache, v_cache = (torch.randn(batch, cap, 2, 16, generator=gen).to(DEV) for _ in range(2))
    lens = torch.tensor([2, 5], dtype=torch.int32, device=DEV)
    for step in range(4):
        q = torch.randn(batch, 1, 4, 16, generator=gen).to(DEV)
        k, v = (torch.randn(batch, 1, 2, 16, generator=gen).to(DEV) for _ in range(2))
        res = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
                                               return_softmax_lse=step % 2 == 1)
        out, lse = res if step % 2 else (res, None)
        assert torch.equal(k_cache[0, int(lens[0])], k[0, 0]) and torch.equal(v_cache[1, int(lens[1])], v[1, 0])
        lens += 1
        if lse is None:
            _, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True)
        check_rows(out, lse, q, k_cache, v_cache, lens)
    lanes = [e.lane for e in kv_ops._CHECKED.entries.values()]
    # appending without and with the lse returned, and the lse-only calls without an append
    assert len(lanes) == 3 and all(lane.calls == 1 for lane in lanes)


def _appended_copy(cache, new, lens, table, cos, sin, interleaved):
    """The cache after appending ``new`` at ``lens`` (rotated there when ``cos`` is given), by torch."""
    want = cache.clone()
    pos = lens.long()[:, None] + torch.arange(new.shape[1])
    if cos is not None:
        new = apply_rotary(new, cos, sin, pos, interleaved)
    if table is None:
        want[torch.arange(len(lens))[:, None], pos] = new
    else:
        page = cache.shape[1]
        want[table.long().gather(1, pos // page), pos % page] = new
    return want


@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appending_lane_steps(backend, monkeypatch, paged, rotary):
    """Four decoding steps of one signature that append two tokens each (rotated, q with them, when
    asked): from the second on, the Triton backend takes the lane at the top of
    flash_attn_with_kvcache (its prepared append, then its attention); every step's cache (new
    slots written, every other slot as it was: the unused ones NaN) and (out, lse) against the
    float64 reference over the keys then in the cache."""
    from tileattn.gpu import kvcache as append_launcher

    steps = []
    step_fn = append_launcher.AppendPlan.step
    monkeypatch.setattr(append_launcher.AppendPlan, "step", lambda self, *a: steps.append(1) or step_fn(self, *a))
    gen = torch.Generator().manual_seed(90)
    batch, new, page, interleaved = 2, 2, 4, rotary == "interleaved"
    lens = torch.tensor([3, 7], dtype=torch.int32)
    table = torch.randperm(11, generator=gen)[:8].view(batch, 4).to(torch.int32) if paged else None
    shape = (11, page, 2, 16) if paged else (batch, 16, 2, 16)
    k_cache, v_cache = (torch.full(shape, float("nan")) for _ in range(2))
    for b, n in enumerate(lens.tolist()):  # the cached keys, the rest NaN
        for p in range(n):
            slot = (b, p) if table is None else (int(table[b, p // page]), p % page)
            k_cache[slot], v_cache[slot] = torch.randn(2, 2, 16, generator=gen)
    cos = sin = None
    if rotary:
        angles = torch.rand(20, 4, generator=gen) * 6.3  # rotary_dim 8 of 16
        cos, sin = angles.cos(), angles.sin()
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    k_cache, v_cache, lens, table, cos, sin = map(dev, (k_cache, v_cache, lens, table, cos, sin))
    for step in range(4):
        q = torch.randn(batch, new, 4, 16, generator=gen)
        k, v = (torch.randn(batch, new, 2, 16, generator=gen) for _ in range(2))
        host_table, host_cos, host_sin = (None if t is None else t.cpu() for t in (table, cos, sin))
        want_k = _appended_copy(k_cache.cpu(), k, lens.cpu(), host_table, host_cos, host_sin, interleaved)
        want_v = _appended_copy(v_cache.cpu(), v, lens.cpu(), host_table, None, None, interleaved)
        out, lse = tileattn.flash_attn_with_kvcache(dev(q), k_cache, v_cache, k=dev(k), v=dev(v), rotary_cos=cos,
                                                    rotary_sin=sin, cache_seqlens=lens, block_table=table, causal=True,
                                                    rotary_interleaved=interleaved, return_softmax_lse=True)
        for got, want in ((k_cache, want_k), (v_cache, want_v)):
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5 if rotary else 0, equal_nan=True)
        lens = lens + new  # a new tensor, as a serving loop's
        if rotary:  # causal: query token i at position lens + i, as its key
            q = apply_rotary(q, host_cos, host_sin, lens.cpu().long()[:, None] - new + torch.arange(new), interleaved)
        check_rows(out, lse, q, k_cache, v_cache, lens, table, causal=True)
    plan = entry(kv_ops._CHECKED)
    assert plan.lane.calls == 3
    assert (plan.direct, len(steps)) == ((True, 3) if backend == "triton" else (False, 0))


@pytest.mark.parametrize("append", [True, False])
def test_kvcache_bad_lengths_after_lane_calls_still_raise(append):
    """Lengths past the capacity in the tensor the lane has seen: the check runs before the append
    (with one) or the launch (without: the direct path of a signature with nothing to derive)."""
    gen = torch.Generator().manual_seed(83)
    k_cache, v_cache = (torch.randn(2, 8, 2, 16, generator=gen).to(DEV) for _ in range(2))
    q = torch.randn(2, 1, 4, 16, generator=gen).to(DEV)
    new = dict(k=torch.randn(2, 1, 2, 16, generator=gen).to(DEV)) if append else {}
    new = {**new, "v": new["k"]} if append else new
    lens = torch.tensor([3, 6], dtype=torch.int32, device=DEV)
    for _ in range(2):
        tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, **new)
    assert entry(kv_ops._CHECKED).lane.calls == 1
    lens.copy_(torch.tensor([3, 8 if append else 9], dtype=torch.int32))
    before = k_cache.clone()
    with pytest.raises(IndexError, match="room" if append else "capacity"):
        tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, **new)
    assert torch.equal(k_cache, before), "a rejected call wrote into the cache"
    assert entry(kv_ops._CHECKED).lane.calls == 1


@pytest.mark.skipif(DEV != "cpu", reason="a failing device assertion leaves the CUDA context unusable")
def test_kept_device_check_reads_each_calls_values(monkeypatch):
    """The value check as on a GPU (one kernel and an asynchronous assertion), its launch kept in the
    memo entry: later calls of the signature check their own lengths and block-table entries."""
    monkeypatch.setattr(V, "value_mode", lambda t: "device")
    gen = torch.Generator().manual_seed(84)
    pool_k, pool_v = (torch.randn(4, 4, 2, 16, generator=gen) for _ in range(2))
    q = torch.randn(2, 1, 4, 16, generator=gen)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([3, 6], dtype=torch.int32)
    for _ in range(2):
        tileattn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=table)
    kept = entry(kv_ops._CHECKED).device_check
    assert kept is not None
    for bad_lens, bad_table in (([3, 9], [[2, 0], [1, 3]]), ([3, 6], [[2, 0], [1, 4]]), ([-1, 6], [[2, 0], [1, 3]])):
        lens.copy_(torch.tensor(bad_lens, dtype=torch.int32))
        table.copy_(torch.tensor(bad_table, dtype=torch.int32))
        with pytest.raises(RuntimeError, match="cache_seqlens"):
            tileattn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=table)
    assert entry(kv_ops._CHECKED).device_check is kept


def test_dense_lane_new_values_then_grad_then_no_grad():
    """flash_attn_func's lane: new values each call; a call that needs a graph has its own
    signature, whose lane (after its first call) is a graph lane (tests/test_graph_lane.py), and
    its gradient flows; no-grad calls after it take the no-grad lane again."""
    gen = torch.Generator().manual_seed(85)
    shape = (2, 3, 4, 16)
    for _ in range(3):
        q, k, v = (torch.randn(shape, generator=gen).to(DEV) for _ in range(3))
        out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert_attention(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), causal=True)
    assert entry(dense_ops._CHECKED).lane.calls == 2
    dense_ops._CHECKED.clear()
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        tileattn.flash_attn_func(qg, k, v, causal=True)
        tileattn.flash_attn_func(qg, k, v, causal=True)
    no_grad = entry(dense_ops._CHECKED)
    out = tileattn.flash_attn_func(qg, k, v, causal=True)
    assert out.requires_grad and no_grad.lane.calls == 1
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    graph_entry = next(e for e in dense_ops._CHECKED.entries.values() if e is not no_grad)
    assert isinstance(graph_entry.lane, GraphLane) and graph_entry.lane.calls == 0
    qg.grad = None
    tileattn.flash_attn_func(qg, k, v, causal=True).sum().backward()
    assert graph_entry.lane.calls == 1 and torch.isfinite(qg.grad).all()
    with torch.no_grad():
        tileattn.flash_attn_func(qg, k, v, causal=True)
    assert no_grad.lane.calls == 2


def test_dense_dropout_takes_no_lane(backend):
    """A seed per call: never a lane, on either backend; the same call without dropout gets one,
    the CPU tiles' (``tileattn.cpu.prepared``) or the Triton backend's."""
    gen = torch.Generator().manual_seed(86)
    q = torch.randn(1, 3, 2, 16, generator=gen).to(DEV)
    tileattn.flash_attn_func(q, q, q, dropout_p=0.25)
    tileattn.flash_attn_func(q, q, q, dropout_p=0.25)
    assert entry(dense_ops._CHECKED).lane is False
    dense_ops._CHECKED.clear()
    tileattn.flash_attn_func(q, q, q)
    tileattn.flash_attn_func(q, q, q)
    lane = entry(dense_ops._CHECKED).lane
    assert lane.calls == 1 and type(lane).__module__ == f"tileattn.{'gpu' if backend == 'triton' else 'cpu'}.prepared"


TRITON_ONLY = pytest.mark.parametrize("backend", ["triton"], indirect=True)  # the Triton backend's plans


@TRITON_ONLY
def test_prepare_fwd_asks_the_hopper_rule_per_call_for_prefill_shapes(monkeypatch):
    """Prefill shapes (MIN_SEQLEN_Q rows and more, no cache, no split count) whose device, dtypes,
    head dims, strides and options the Hopper kernel takes get a launch that asks the rest of its
    rule (the environment, the pointers' alignment) on every call (tests/test_graph_lane.py runs it
    both ways); decoding shapes, caches, operands the kernel cannot take (fp32) and devices it cannot
    run on get one that never asks."""
    from tileattn.gpu import hopper

    params = AttnParams(0.25)
    rows = prepared.MIN_SEQLEN_Q
    q = torch.empty(1, rows, 2, 64, device=DEV, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, rows, device=DEV)
    opts = dict(params=params, alibi_slopes=None, max_seqlen_q=rows, max_seqlen_k=rows, seqused_k=None,
                block_table=None, learnable_sink=None, k_descale=None)
    on_hopper = hopper.device_kind_reason(q) is None
    assert (prepared.prepare_fwd(q, q, q, q, lse, num_splits=1, **opts).hopper is not None) == on_hopper
    monkeypatch.setattr(hopper, "device_kind_reason", lambda q: None)  # the device as an H200's
    assert prepared.prepare_fwd(q, q, q, q, lse, num_splits=1, **opts).hopper is not None
    q32 = q.float()
    assert prepared.prepare_fwd(q32, q32, q32, q32, lse, num_splits=1, **opts).hopper is None
    q1 = q[:, :1]
    for num_splits in (1, 2):
        assert prepared.prepare_fwd(q1, q, q, q1, lse[..., :1], num_splits=num_splits, **opts).hopper is None


@TRITON_ONLY
def test_clear_plans_sends_a_prepared_launch_back_to_attn_fwd(monkeypatch):
    """New tile constants (the tile sweep) come with clear_plans: a lane made before must not keep
    launching the old plan."""
    gen = torch.Generator().manual_seed(87)
    q = torch.randn(1, 2, 4, 16, generator=gen).to(DEV)
    k, v = (torch.randn(1, 5, 2, 16, generator=gen).to(DEV) for _ in range(2))
    ref = tileattn.flash_attn_func(q, k, v)
    calls = []
    real = A.attn_fwd
    monkeypatch.setattr(A, "attn_fwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    A.clear_plans()
    out = tileattn.flash_attn_func(q, k, v)
    assert calls == [1] and entry(dense_ops._CHECKED).lane.calls == 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@TRITON_ONLY
def test_an_autotuned_prefill_gets_its_lane_after_the_first_call(monkeypatch):
    """The first call tunes the prefill tile (its plan has no launch before); the lane, prepared
    after that call, launches the tuned one."""
    monkeypatch.setenv("TILEATTN_AUTOTUNE", "1")
    A.clear_plans()
    gen = torch.Generator().manual_seed(89)
    q, k, v = (torch.randn(1, 80, 2, 16, generator=gen).to(DEV) for _ in range(3))  # 80 rows: the prefill tile
    first = tileattn.flash_attn_func(q, k, v, causal=True)
    second = tileattn.flash_attn_func(q, k, v, causal=True)
    assert entry(dense_ops._CHECKED).lane.calls == 1
    torch.testing.assert_close(second, first, rtol=0, atol=0)


CPU_ONLY = [pytest.mark.skipif(DEV != "cpu", reason="the CPU tiles' lane"),
            pytest.mark.parametrize("backend", ["cpu"], indirect=True)]


def count_attn_fwd(monkeypatch):
    """Counts the CPU lane's calls of ``attn_fwd`` (those ``fwd_one_tile`` left to it)."""
    from tileattn.cpu import prepared as cpu_prepared

    calls, original = [], cpu_prepared.attn_fwd

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu_prepared, "attn_fwd", counted)
    return calls


def poison_new_empty(monkeypatch):
    """``Tensor.new_empty`` (how the lane and the ops allocate outputs) fills floats with NaN."""
    original = torch.Tensor.new_empty

    def poisoned(t, *args, **kwargs):
        x = original(t, *args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)


def nan_cache(gen, lens, cap, dtype):
    """A contiguous (batch, cap, 2, 16) cache pair whose slots past each length hold NaN."""
    caches = [torch.randn(len(lens), cap, 2, 16, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2)]
    for c in caches:
        for b, n in enumerate(lens):
            c[b, n:] = float("nan")
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True, softcap=3.0), dict(window_size=(5, 0))])
@pytest.mark.parametrize("lens", [[13], [9, 9]])
@pytest.mark.usefixtures("backend")
@CPU_ONLY[0]
@CPU_ONLY[1]
def test_cpu_lane_decodes_in_one_tile_step(monkeypatch, dtype, opts, lens):
    """A decoding signature (equal lengths, no ALiBi or splits, contiguous cache) goes to the
    one-tile step (``fwd_one_tile``), not ``attn_fwd``; its own outputs (out in q's dtype, lse
    fp32, fp64 for fp64 inputs) match the reference on each call's values, and the NaN slots
    past the lengths stay unread."""
    calls = count_attn_fwd(monkeypatch)
    gen = torch.Generator().manual_seed(91)
    lengths = torch.tensor(lens, dtype=torch.int32)
    for _ in range(3):
        q = torch.randn(len(lens), 1, 4, 16, generator=gen, dtype=torch.float64).to(dtype)
        k_cache, v_cache = nan_cache(gen, lens, 24, dtype)
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                    return_softmax_lse=True, **opts)
        assert out.dtype == dtype and out.shape == q.shape and lse.shape == (len(lens), 4, 1)
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        check_rows(out, lse, q, k_cache, v_cache, lengths, **opts)
    assert entry(kv_ops._CHECKED).lane.calls == 2 and not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.usefixtures("backend")
@CPU_ONLY[0]
@CPU_ONLY[1]
def test_cpu_lane_prefill_with_sinks_in_one_tile_step(monkeypatch, dtype):
    """flash_attn_func's lane: a causal GQA prefill with learnable sinks in the one-tile step."""
    calls = count_attn_fwd(monkeypatch)
    gen = torch.Generator().manual_seed(92)
    sink = torch.randn(4, generator=gen)
    for _ in range(3):
        q = torch.randn(2, 7, 4, 16, generator=gen, dtype=dtype)
        k, v = (torch.randn(2, 7, 2, 16, generator=gen, dtype=dtype) for _ in range(2))
        out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
        assert_attention(out, lse, q, k, v, causal=True, learnable_sink=sink)
    assert entry(dense_ops._CHECKED).lane.calls == 2 and not calls


@pytest.mark.parametrize("case", ["ragged", "alibi", "splits", "long", "empty rows"])
@pytest.mark.usefixtures("backend")
@CPU_ONLY[0]
@CPU_ONLY[1]
def test_cpu_lane_leaves_other_problems_to_attn_fwd(monkeypatch, case):
    """What the one-tile step does not compute takes ``attn_fwd`` on the lane, into outputs
    poisoned with NaN: lengths that differ, ALiBi, forced splits, more keys than a tile, and
    rows that see no key (causal, more queries than keys)."""
    calls = count_attn_fwd(monkeypatch)
    gen = torch.Generator().manual_seed(93)
    poison_new_empty(monkeypatch)
    for _ in range(3):
        if case == "empty rows":
            q, k, v = (torch.randn(1, n, 4, 16, generator=gen) for n in (6, 3, 3))
            out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
            assert_attention(out, lse, q, k, v, causal=True)
            continue
        lens = {"ragged": [5, 17], "long": [600]}.get(case, [11, 11])
        lengths = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(len(lens), 1, 4, 16, generator=gen)
        k_cache, v_cache = nan_cache(gen, lens, 640 if case == "long" else 24, torch.float32)
        opts = dict(alibi_slopes=torch.rand(4, generator=gen)) if case == "alibi" else {}
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                    num_splits=2 if case == "splits" else 0,
                                                    return_softmax_lse=True, **opts)
        check_rows(out, lse, q, k_cache, v_cache, lengths, **opts)
    assert len(calls) == 2
