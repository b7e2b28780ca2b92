"""``tileattn.DecodePlan``: a decoding step planned once, run per layer, equal to flash_attn_with_kvcache."""

from __future__ import annotations

import pytest
import torch

import tileattn
from graphs import captured
from tileattn.ops import _validate as V


def _layers(gen, n_layers, batch, cap, paged, device, dtype=torch.float16):
    """Per layer: (q, k_cache, v_cache, k_new, v_new); cache slots past the lengths are NaN."""
    lens = torch.tensor([5, 17, 30][:batch], dtype=torch.int32)
    # one block table for the step (pages of 8 from a shuffled pool of 16), shared by every layer
    table = torch.randperm(16, generator=gen)[:batch * cap // 8].view(batch, cap // 8).to(torch.int32)
    layers = []
    for _ in range(n_layers):
        q = torch.randn(batch, 1, 4, 32, generator=gen).to(dtype)
        kv = [torch.randn(batch, cap, 2, 32, generator=gen).to(dtype) for _ in range(2)]
        for t in kv:
            for b in range(batch):
                t[b, lens[b]:] = float("nan")
        new = [torch.randn(batch, 1, 2, 32, generator=gen).to(dtype) for _ in range(2)]
        if paged:
            pools = [torch.full((16, 8, 2, 32), float("nan"), dtype=dtype) for _ in range(2)]
            for pool, t in zip(pools, kv):
                for b in range(batch):
                    for p in range(cap):
                        pool[table[b, p // 8], p % 8] = t[b, p]
            kv = pools
        layers.append([x.to(device) for x in (q, *kv, *new)])
    return lens.to(device), table.to(device) if paged else None, layers


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [False, True])
def test_plan_runs_each_layer_as_flash_attn_with_kvcache(device, paged, rotary):
    gen = torch.Generator().manual_seed(81)
    lens, table, layers = _layers(gen, 2, 3, 32, paged, device)
    opts = dict(causal=True, softcap=0.0, num_splits=0)
    if rotary:
        angles = torch.rand(40, 8, generator=gen) * 6.3
        opts.update(rotary_cos=angles.cos().to(device), rotary_sin=angles.sin().to(device), rotary_interleaved=False)
    plan = tileattn.DecodePlan(*layers[0][:3], lens, table, seqlen_new=1, return_softmax_lse=True, **opts)
    for q, k_cache, v_cache, k_new, v_new in layers:
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        want = tileattn.flash_attn_with_kvcache(q, k_ref, v_ref, k_new, v_new, cache_seqlens=lens, block_table=table,
                                                return_softmax_lse=True, **opts)
        got = plan.run(q, k_cache, v_cache, k=k_new, v=v_new)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
        assert not got[0].isnan().any()


@pytest.mark.parametrize("layout", ["contiguous", "paged", "left-padded"])
def test_a_plan_reads_the_lengths_as_they_are_when_it_runs(device, layout):
    """A plan's appending runs after cache_seqlens advanced in place (the lengths a replayed graph
    sees): the new keys go to the new positions and attention reads the lengths the append wrote,
    equal to flash_attn_with_kvcache's call with the new lengths (before: attention over the
    lengths worked out when the plan was made, off by the step's new key)."""
    gen = torch.Generator().manual_seed(87)
    lens, table, layers = _layers(gen, 1, 3, 32, layout == "paged", device)
    extra = {} if layout != "left-padded" else {"cache_leftpad": torch.tensor([1, 0, 4], dtype=torch.int32,
                                                                                device=device)}
    q, k_cache, v_cache, k_new, v_new = layers[0]
    plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, table, seqlen_new=1, causal=True, return_softmax_lse=True,
                               **extra)
    k_ref, v_ref, ref_lens = k_cache.clone(), v_cache.clone(), lens.clone()
    for _ in range(2):
        got = plan.run(q, k_cache, v_cache, k=k_new, v=v_new)
        want = tileattn.flash_attn_with_kvcache(q, k_ref, v_ref, k_new, v_new, cache_seqlens=ref_lens,
                                                block_table=table, causal=True, return_softmax_lse=True, **extra)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
        lens += 1
        ref_lens += 1


@pytest.mark.parametrize("paged", [False, True])
def test_plan_over_an_fp8_cache(device, paged):
    """An FP8 cache: the plan quantises each layer's new keys with the step's descales and reads
    the cache as flash_attn_with_kvcache does, bit for bit."""
    gen = torch.Generator().manual_seed(83)
    lens, table, layers = _layers(gen, 2, 3, 32, paged, device, torch.bfloat16)
    descales = [(0.005 + 0.01 * torch.rand(3, 2, generator=gen)).to(device) for _ in range(2)]
    fp8 = [[q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), kn, vn]  # unused slots stay NaN
           for q, k, v, kn, vn in layers]
    opts = dict(causal=True, k_descale=descales[0], v_descale=descales[1])
    plan = tileattn.DecodePlan(*fp8[0][:3], lens, table, seqlen_new=1, **opts)
    for q, k_cache, v_cache, k_new, v_new in fp8:
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        want = tileattn.flash_attn_with_kvcache(q, k_ref, v_ref, k_new, v_new, cache_seqlens=lens, block_table=table,
                                                **opts)
        got = plan.run(q, k_cache, v_cache, k=k_new, v=v_new)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
        assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
        assert not got.isnan().any()
    with pytest.raises(ValueError, match="needs k_descale"):
        tileattn.DecodePlan(*fp8[0][:3], lens, table, seqlen_new=1, causal=True)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("seqlen_new", [0, 1])
def test_plan_with_cache_leftpad_runs_each_layer_as_flash_attn_with_kvcache(device, sinks, seqlen_new):
    """Left-padded rows over caches in transformers' (batch, nheads_k, slots, headdim) order (slots
    before the pad NaN), each layer with its own sinks: the plan's runs equal
    flash_attn_with_kvcache's calls bit for bit, appends included."""
    gen = torch.Generator().manual_seed(84)
    batch, slots, dtype = 3, 24, torch.float16
    pads = torch.tensor([0, 7, 15], dtype=torch.int32).to(device)
    lens = torch.tensor([20, 19, 23 - seqlen_new], dtype=torch.int32).to(device)
    layers = []
    for _ in range(2):
        kv = [torch.randn(batch, 2, slots, 32, generator=gen).to(dtype) for _ in range(2)]
        for t in kv:
            for b in range(batch):
                t[b, :, :pads[b]] = float("nan")
        new = [torch.randn(batch, seqlen_new, 2, 32, generator=gen).to(dtype) for _ in range(2)]
        sink = torch.randn(4, generator=gen) if sinks else None
        layers.append([x if x is None else x.to(device) for x in
                       (torch.randn(batch, 1, 4, 32, generator=gen).to(dtype), *(t.transpose(1, 2) for t in kv),
                        *new, sink)])
    opts = dict(causal=True, window_size=(11, 11), cache_leftpad=pads)
    q, k_cache, v_cache, _, _, sink = layers[0]
    plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, seqlen_new=seqlen_new, return_softmax_lse=True,
                               learnable_sink=sink, **opts)
    for q, k_cache, v_cache, k_new, v_new, sink in layers:
        new = dict(k=k_new, v=v_new) if seqlen_new else {}
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        want = tileattn.flash_attn_with_kvcache(q, k_ref, v_ref, cache_seqlens=lens, return_softmax_lse=True,
                                                learnable_sink=sink, **new, **opts)
        got = plan.run(q, k_cache, v_cache, learnable_sink=sink, **new)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert not got[0].isnan().any()
        torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    if sinks:
        with pytest.raises(ValueError, match="pass each layer's"):
            plan.run(q, k_cache, v_cache, **new)
    else:
        with pytest.raises(ValueError, match="without learnable_sink"):
            plan.run(q, k_cache, v_cache, learnable_sink=torch.zeros(4, device=device), **new)


def _growing_steps(gen, device, steps, dtype=torch.float16, headdim=32, grow=None):
    """Per step (batch, left pads, lengths): q and caches in transformers' (batch, nheads_k, slots,
    headdim) order, transposed, fresh each step with one slot more than the step before (as
    DynamicCache's torch.cat gives them; ``grow``: per step, how many more); slots before a row's
    pad or past its length NaN."""
    made, slots = [], 20
    for (batch, pads, lens), more in zip(steps, grow or [1] * len(steps)):
        slots += more
        kv = [torch.randn(batch, 2, slots, headdim, generator=gen).to(dtype) for _ in range(2)]
        for t in kv:
            for b in range(batch):
                t[b, :, :pads[b]] = float("nan")
                t[b, :, lens[b]:] = float("nan")
        q = torch.randn(batch, 1, 4, headdim, generator=gen).to(dtype)
        lengths = [torch.tensor(x, dtype=torch.int32) for x in (lens, pads)]
        made.append([x.to(device) for x in (q, *(t.transpose(1, 2) for t in kv), *lengths)])
    return made


@pytest.mark.parametrize("leftpad", [True, False])
def test_next_step_equals_a_new_plan_over_growing_caches(device, leftpad):
    """``next_step`` carries a plan from step to step over caches one slot longer each step, with new
    lengths and (with cache_leftpad) new pads: each step's runs equal flash_attn_with_kvcache's calls
    bit for bit. The step whose batch changed gets a plan made anew (nothing of the last one kept);
    the others keep the query offsets and launch plan of the first."""
    gen = torch.Generator().manual_seed(85)
    steps = _growing_steps(gen, device, [(3, [0, 7, 15], [21, 21, 21]), (3, [0, 7, 15], [22, 22, 22]),
                                         (3, [4, 0, 2], [23, 20, 23]), (2, [5, 1], [24, 24]), (2, [5, 1], [25, 25])])
    opts = dict(causal=True, window_size=(11, 11), num_splits=0)
    plan = None
    for t, (q, k_cache, v_cache, lens, pads) in enumerate(steps):
        pad = dict(cache_leftpad=pads) if leftpad else {}
        if not leftpad:  # every slot before the length is a key
            for c in (k_cache, v_cache):
                c.nan_to_num_(0.25)
        if plan is None:
            plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, return_softmax_lse=True, **pad, **opts)
            first = plan
        else:
            last, plan = plan, plan.next_step(q, k_cache, v_cache, lens, **pad)
            assert plan is not last
            assert (plan._options is last._options) == (t != 3), f"step {t}: carried on unless the batch changed"
        for _ in range(2):  # two layers
            want = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True,
                                                    **pad, **opts)
            got = plan.run(q, k_cache, v_cache)
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert not got[0].isnan().any()
    assert first.run(*steps[0][:3])[0].equal(tileattn.flash_attn_with_kvcache(  # the first plan stays valid
        *steps[0][:3], cache_seqlens=steps[0][3], **(dict(cache_leftpad=steps[0][4]) if leftpad else {}), **opts))



def test_next_step_over_caches_grown_by_several_slots_and_new_head_strides(device):
    """The steps' caches grow by 1 to 3 slots, their pads change, and with head dim 40 the packed
    keys' head stride (40 x the slot count) is a multiple of 16 at one step, not at the next (the
    launch plan taken per call must follow: ``gpu.attention._plan_key``). Every step's runs (two
    layers, ``_run_fitted`` as transformers' integration runs them, and ``run``) equal, bit for
    bit, flash_attn_with_kvcache's calls and the runs of a plan made for the step alone after
    every launch plan was dropped. A plan without lse returns a new out per run; with lse, a new
    lse per run too (the one it does not return is its own scratch)."""
    from tileattn.gpu import attention as A

    gen = torch.Generator().manual_seed(87)
    steps = _growing_steps(gen, device, [(3, [0, 7, 15], [21, 21, 21]), (3, [0, 7, 15], [24, 24, 24]),
                                         (3, [4, 0, 2], [26, 23, 26]), (3, [4, 0, 2], [27, 27, 27]),
                                         (3, [1, 1, 9], [28, 28, 28])],
                           headdim=40, grow=[1, 3, 2, 1, 1])
    opts = dict(causal=True, num_splits=0)
    plan = None
    for t, (q, k_cache, v_cache, lens, pads) in enumerate(steps):
        plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, cache_leftpad=pads, **opts) if plan is None else \
            plan.next_step(q, k_cache, v_cache, lens, cache_leftpad=pads)
        got = [plan._run_fitted(q, k_cache, v_cache), plan._run_fitted(q, k_cache, v_cache),
               plan.run(q, k_cache, v_cache)]
        assert got[0].data_ptr() != got[1].data_ptr()
        want = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_leftpad=pads, **opts)
        A.clear_plans()
        alone = tileattn.DecodePlan(q, k_cache, v_cache, lens, cache_leftpad=pads, **opts)
        for g in got + [alone.run(q, k_cache, v_cache)]:
            torch.testing.assert_close(g, want, rtol=0, atol=0)
        assert not want.isnan().any(), f"step {t}"
    q, k_cache, v_cache, lens, pads = steps[-1]
    plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, cache_leftpad=pads, return_softmax_lse=True, **opts)
    (o1, l1), (o2, l2) = plan._run_fitted(q, k_cache, v_cache), plan._run_fitted(q, k_cache, v_cache)
    assert l1.data_ptr() != l2.data_ptr() and torch.equal(l1, l2) and torch.equal(o1, o2)
    want = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_leftpad=pads,
                                            return_softmax_lse=True, **opts)
    assert torch.equal(o1, want[0]) and torch.equal(l1, want[1])

def test_next_step_checks_the_new_lengths_and_caches():
    """What next_step carries on is only what the new step cannot change: its lengths, pads and
    caches are checked as DecodePlan checks them; lengths vouched for on the host (as transformers'
    integration does) are checked there, until the tensor changes."""
    gen = torch.Generator().manual_seed(86)
    (q, k_cache, v_cache, lens, pads), (q2, k2, v2, lens2, pads2) = _growing_steps(
        gen, "cpu", [(3, [0, 7, 15], [21, 21, 21]), (3, [0, 7, 15], [22, 22, 22])], torch.float32)
    plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, cache_leftpad=pads, causal=True)
    with pytest.raises(IndexError, match="cache_seqlens must be within 0..22"):
        plan.next_step(q2, k2, v2, lens2 + 1, cache_leftpad=pads2)
    with pytest.raises(IndexError, match="cache_leftpad must lie within"):
        plan.next_step(q2, k2, v2, lens2, cache_leftpad=torch.tensor([0, 23, 1], dtype=torch.int32))
    with pytest.raises(TypeError, match="cache_leftpad"):
        plan.next_step(q2, k2, v2, lens2, cache_leftpad=pads2.long())
    with pytest.raises(ValueError, match="k_cache has batch 2"):  # made anew: DecodePlan's own checks
        plan.next_step(q2, k2[:2], v2[:2], lens2, cache_leftpad=pads2)
    V.vouch_lengths(lens2, pads2, [22, 22, 22])
    with pytest.raises(IndexError, match="cache_seqlens must be within 0..21"):  # the vouched values, on the host
        plan.next_step(q2, k2[:, :21], v2[:, :21], lens2, cache_leftpad=pads2)
    lens2[0] = 30  # a change voids what was vouched: read again
    with pytest.raises(IndexError, match="cache_seqlens must be within 0..22"):
        plan.next_step(q2, k2, v2, lens2, cache_leftpad=pads2)


@pytest.mark.parametrize("kind", ["paged", "fp8", "paged fp8"])
def test_next_step_of_a_plan_with_a_block_table_or_descales_keeps_them(device, kind):
    """A plan with a block table or FP8 descales is carried on by a plan made anew (``next_step``'s
    docstring): what ``DecodePlan`` makes with the new lengths and this plan's other arguments, the
    block table and descales among them, not a plan that reads the pool as a contiguous cache (or
    refuses an FP8 cache for want of descales)."""
    gen = torch.Generator().manual_seed(88)
    paged, fp8 = "paged" in kind, "fp8" in kind
    lens, table, layers = _layers(gen, 1, 3, 32, paged, device, torch.bfloat16 if fp8 else torch.float16)
    q, k_cache, v_cache, _, _ = layers[0]
    opts = dict(causal=True)
    if fp8:
        k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
        opts.update(k_descale=(0.005 + 0.01 * torch.rand(3, 2, generator=gen)).to(device),
                    v_descale=(0.005 + 0.01 * torch.rand(3, 2, generator=gen)).to(device))
    plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, table, **opts)
    shorter = lens - 1
    got = plan.next_step(q, k_cache, v_cache, shorter).run(q, k_cache, v_cache)
    want = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=shorter, block_table=table, **opts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not got.isnan().any()


def test_plan_rejects_a_layer_it_was_not_made_for():
    gen = torch.Generator().manual_seed(82)
    lens, _, layers = _layers(gen, 1, 2, 32, False, "cpu", torch.float32)
    q, k_cache, v_cache, k_new, v_new = layers[0]
    plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, seqlen_new=1)
    with pytest.raises(ValueError, match="differ from the tensors the plan was made with"):
        plan.run(q.double(), k_cache, v_cache, k=k_new, v=v_new)
    for caches in ((k_cache.to("meta"), v_cache), (k_cache, v_cache.to("meta"))):  # a cache on another device
        with pytest.raises(ValueError, match="differ from the tensors the plan was made with"):
            plan.run(q, *caches, k=k_new, v=v_new)
    with pytest.raises(ValueError, match="the plan appends k"):
        plan.run(q, k_cache, v_cache, k=k_new[:, :0], v=v_new)
    with pytest.raises(ValueError, match="seqlen_new=0"):
        tileattn.DecodePlan(q, k_cache, v_cache, lens).run(q, k_cache, v_cache, k=k_new, v=v_new)
    with pytest.raises(IndexError, match="appending 3 tokens"):
        tileattn.DecodePlan(q, k_cache, v_cache, torch.tensor([5, 30], dtype=torch.int32), seqlen_new=3)


@pytest.mark.gpu
def test_a_step_captured_with_its_plan_replays_over_advancing_lengths():
    """One decoding step captured with its plan made inside the graph (the usage the docs give for
    a graph replayed step after step), then replayed twice with cache_seqlens advanced in place
    between replays: each replay equals flash_attn_with_kvcache's eager step on copies of the
    caches (the append at the new positions, attention over the new lengths), outputs and caches."""
    gen = torch.Generator().manual_seed(89)
    lens, table, layers = _layers(gen, 2, 3, 32, True, "cuda", torch.bfloat16)
    ref_lens, ref_pools = lens.clone(), [(k.clone(), v.clone()) for _, k, v, _, _ in layers]

    def step():
        plan = tileattn.DecodePlan(*layers[0][:3], lens, table, seqlen_new=1, causal=True)
        return [plan.run(q, k, v, k=kn, v=vn) for q, k, v, kn, vn in layers]

    graph, _, static = captured(step)
    for (_, k, v, _, _), (k0, v0) in zip(layers, ref_pools):  # undo the warm-up call's append
        k.copy_(k0)
        v.copy_(v0)
    for _ in range(2):  # lengths 5, 17, 30 in pages of 8 up to 32: two steps fit
        graph.replay()
        want = [tileattn.flash_attn_with_kvcache(q, kr, vr, kn, vn, cache_seqlens=ref_lens, block_table=table,
                                                 causal=True) for (q, _, _, kn, vn), (kr, vr) in zip(layers, ref_pools)]
        torch.cuda.synchronize()
        for s, w in zip(static, want):
            torch.testing.assert_close(s, w, rtol=0, atol=0)
        for (_, k, v, _, _), (kr, vr) in zip(layers, ref_pools):
            torch.testing.assert_close(k, kr, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(v, vr, rtol=0, atol=0, equal_nan=True)
        lens += 1
        ref_lens += 1


@pytest.mark.gpu
def test_planned_step_replays_from_a_cuda_graph():
    """Plan outside, capture two layers' runs, replay: equal to the eager runs, which never
    synchronise with the device (sync debug mode "error")."""
    gen = torch.Generator().manual_seed(83)
    lens, table, layers = _layers(gen, 2, 3, 32, True, "cuda", torch.bfloat16)
    pools = [(k.clone(), v.clone()) for _, k, v, _, _ in layers]
    plan = tileattn.DecodePlan(*layers[0][:3], lens, table, seqlen_new=1, causal=True)
    plan.run(layers[0][0], *pools[0], k=layers[0][3], v=layers[0][4])  # compiles outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = [plan.run(q, k, v, k=kn, v=vn) for (q, _, _, kn, vn), (k, v) in zip(layers, pools)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, _, static = captured(lambda: [plan.run(q, k, v, k=kn, v=vn) for q, k, v, kn, vn in layers])
    graph.replay()
    torch.cuda.synchronize()
    for s, e in zip(static, eager):
        torch.testing.assert_close(s, e, rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_a_split_plan_keeps_the_combine_launch(monkeypatch, split_launches, paged):
    """``DecodePlan.run`` (run per layer, captured in graphs) launches attention and the combine even
    where an eager call merges the splits in its launch (``gpu.combine``'s rule, measured slower in
    graphs); both give the same bits."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TILEATTN_BACKEND", "triton")  # the Triton plan, in the interpreter
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(86)
    lens, table, layers = _layers(gen, 1, 3, 32, paged, device)
    q, k_cache, v_cache, _, _ = layers[0]
    opts = dict(causal=True, num_splits=3, return_softmax_lse=True)
    plan = tileattn.DecodePlan(q, k_cache, v_cache, lens, table, seqlen_new=0, **opts)
    got = plan.run(q, k_cache, v_cache)
    assert split_launches == [False, False]
    for _ in range(2):  # the signature's first call, then its lane's, which merges
        split_launches.clear()
        want = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, **opts)
    assert split_launches == [True]
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and not got[0].isnan().any()
