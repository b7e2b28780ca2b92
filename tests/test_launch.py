"""The launch fast path (``tileattn.gpu._launch``) and the forward's launch plans.

A ``Launch`` keeps the ``CompiledKernel`` of its first call and launches it directly after
that; here a fake jit function stands in for Triton's (the interpreter compiles nothing), so
the tests see which calls went through Triton and what the direct launches were handed.
The plan cache of ``attn_fwd`` runs for real: in the interpreter on CPU tensors, or compiled
on the GPU when there is one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import tileattn.gpu._launch as L
import tileattn.gpu.attention as A
from tileattn import reference
from tileattn.contract import AttnParams
from tolerance import assert_within, plain_attention


G = (4, 1, 1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


class _Param:
    def __init__(self, name, is_constexpr=False, do_not_specialize=False):
        self.name, self.is_constexpr, self.do_not_specialize = name, is_constexpr, do_not_specialize


class _Compiled(CompiledKernel):
    """A compiled kernel whose launcher records its arguments."""

    def __init__(self, log):
        self.function, self.packed_metadata, self.module = "fn", "meta", "mod"
        self._run = lambda *a: log.append(a)


class _Jit:
    """Stands in for a JITFunction: (X, Y, n, seqlen, BLOCK); ``seqlen`` is not specialised."""

    def __init__(self):
        self.params = [_Param("X"), _Param("Y"), _Param("n"), _Param("seqlen", do_not_specialize=True),
                       _Param("BLOCK", is_constexpr=True)]
        self.slow, self.fast = [], []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.slow.append((grid, args, meta))
            return _Compiled(self.fast)
        return run


@pytest.fixture
def jit(monkeypatch):
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_current_stream", lambda device: 1234)
    return _Jit()


def test_second_call_launches_the_kept_kernel_directly(jit):
    launch = L.Launch(jit, {"BLOCK": 32}, {"num_warps": 4})
    x, y = torch.zeros(8), torch.zeros(8)
    launch((6, 2, 1), x, y, 48, 7)
    assert len(jit.slow) == 1 and not jit.fast
    grid, args, meta = jit.slow[0]
    assert grid == (6, 2, 1) and args == (x, y, 48, 7) and meta == {"BLOCK": 32, "num_warps": 4}
    launch((6, 2, 1), x, y, 48, 9)
    launch((3, 1, 1), y, x, 48, 11)
    assert len(jit.slow) == 1 and launch.fast_calls == 2
    # grid, stream, function, metadata, no launch metadata or hooks, raw pointers, ints, constexprs
    assert jit.fast[0] == (6, 2, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), y.data_ptr(), 48, 9, 32)
    assert jit.fast[1][:3] == (3, 1, 1) and jit.fast[1][9:11] == (y.data_ptr(), x.data_ptr())


class _DescCompiled(CompiledKernel):
    """A compiled kernel with two TMA descriptor arguments whose launcher is Triton's own
    ``CudaLauncher`` over a recording C launcher (descriptor metadata as the compiler writes it)."""

    SIGNATURE = {"X": "*bf16", "D1": "tensordesc<bf16[64, 64]>", "n": "i32", "D2": "tensordesc<fp16[32, 64]>",
                 "BLOCK": "constexpr"}
    META = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 64], fp4_padded=False),
            dict(swizzle=2, elem_size=2, elem_type=6, block_size=[32, 64], fp4_padded=False)]

    def __init__(self, log):
        from types import SimpleNamespace

        from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

        self.function, self.packed_metadata, self.module = "fn", "meta", "mod"
        self.metadata = SimpleNamespace(tensordesc_meta=self.META)
        run = CudaLauncher.__new__(CudaLauncher)
        run.launch = wrap_handle_tensordesc(lambda *a: log.append(a), self.SIGNATURE, self.META)
        run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
        self._run = run


def test_descriptor_kernels_hand_the_c_launcher_what_tritons_wrapper_would(jit, monkeypatch):
    """A kernel with TMA descriptors: the direct launch encodes each descriptor (CUtensorMap,
    shape, strides) at its position and calls the C launcher with exactly the arguments Triton's
    wrapper (``compiled.run``) gives it for the same call."""
    from types import SimpleNamespace

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    from tileattn.gpu import hopper

    def fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):  # the driver's encoder
        return ("map", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)

    monkeypatch.setattr(driver, "_active", SimpleNamespace(utils=SimpleNamespace(fill_tma_descriptor=fill)))
    jit.params = [_Param("X"), _Param("D1"), _Param("n"), _Param("D2"), _Param("BLOCK", is_constexpr=True)]
    log = []
    compiled = _DescCompiled(log)
    monkeypatch.setattr(_Jit, "__getitem__", lambda self, grid: lambda *a, **m: self.slow.append(a) or compiled)

    def descriptor(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), hopper._smem_layout(block, t.dtype))

    launch = L.Launch(jit, {"BLOCK": 32}, {})
    x = torch.zeros(64)
    for step in range(3):
        a = torch.randn(128, 64).to(torch.bfloat16)
        b = torch.randn(96, 64).to(torch.float16)[:, :64]
        args = (x, descriptor(a, (64, 64)), 7 + step, descriptor(b, (32, 64)))
        launch((2, 3, 1), *args)
        if step == 0:
            assert len(jit.slow) == 1 and not log and launch.descs
            continue
        direct = log.pop()
        compiled.run(2, 3, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), args[1], 7 + step, args[3], 32)
        assert direct == log.pop() and direct[14] == ("map", a.data_ptr(), 3, 2, 9, (64, 64), (128, 64), (64, 1), False)
    assert launch.fast_calls == 2 and len(jit.slow) == 1


class _PlainCompiled(_DescCompiled):
    """A compiled kernel without descriptors under Triton's own ``CudaLauncher``, whose
    ``wrap_handle_tensordesc`` hands back the recording C launcher itself."""

    SIGNATURE = {"X": "*fp32", "Y": "*fp32", "n": "i32", "seqlen": "i32", "BLOCK": "constexpr"}
    META = None


@pytest.mark.parametrize("scratch", [0, 64])
def test_plain_kernels_hand_the_c_launcher_what_the_cuda_launcher_would(jit, monkeypatch, scratch):
    """A kernel without descriptors: once kept, its launches call the C launcher itself with the
    arguments ``CudaLauncher.__call__`` would pass it (flags, no scratch); a kernel that needs
    global scratch memory per launch keeps going through ``compiled.run``, which allocates it."""
    log = []
    compiled = _PlainCompiled(log)
    compiled._run.global_scratch_size = scratch
    allocations = []
    monkeypatch.setattr(_Jit, "__getitem__", lambda self, grid: lambda *a, **m: self.slow.append(a) or compiled)
    if scratch:
        from triton.runtime import _allocation

        monkeypatch.setattr(_allocation, "_allocator", SimpleNamespace(
            get=lambda: lambda size, align, stream: allocations.append(size) or "scratch"))
    launch = L.Launch(jit, {"BLOCK": 32}, {})
    x, y = torch.zeros(8), torch.zeros(8)
    launch((6, 2, 1), x, y, 48, 7)
    assert len(jit.slow) == 1 and not log
    for seqlen in (9, 11):
        launch((6, 2, 1), x, y, 48, seqlen)
        direct = log.pop()
        compiled.run(6, 2, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), y.data_ptr(), 48, seqlen, 32)
        assert direct == log.pop()
        assert direct[5:9] == (False, False, "scratch" if scratch else None, None)
    assert launch.fast_calls == 2 and bool(launch.direct) == (not scratch) and len(allocations) == (4 if scratch else 0)


class _GluonCompiled(_DescCompiled):
    """As ``_DescCompiled``, with a Gluon kernel's argument order: the tensors (two read through
    descriptors), then the numbers, then the constexprs ``GluonLaunch`` passes."""

    SIGNATURE = {"D1": "tensordesc<bf16[64, 64]>", "X": "*fp32", "D2": "tensordesc<fp16[32, 64]>", "n": "i32",
                 "A": "constexpr", "CONSUMER_REGS": "constexpr", "PRODUCER_REGS": "constexpr"}


def test_a_kept_gluon_launch_encodes_each_set_of_bases_once(jit, monkeypatch):
    """A kept ``GluonLaunch`` whose ``Launch`` launches directly encodes its descriptors (the driver's
    CUtensorMap encoder) once per set of base pointers: a later call on the same bases encodes none,
    one on another set encodes that set, and every call hands the C launcher the arguments Triton's
    wrapper would give it for fresh descriptors of that call's tensors. The sets kept are bounded."""
    from types import SimpleNamespace

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    from tileattn.gpu import hopper

    fills = []

    def fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):  # the driver's encoder
        fills.append(ptr)
        return ("map", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)

    monkeypatch.setattr(driver, "_active", SimpleNamespace(utils=SimpleNamespace(fill_tma_descriptor=fill)))
    jit.params = [_Param("D1"), _Param("X"), _Param("D2"), _Param("n")] + [
        _Param(name, is_constexpr=True) for name in ("A", "CONSUMER_REGS", "PRODUCER_REGS")]
    jit.arg_names, jit.do_not_specialize = [p.name for p in jit.params], []
    log = []
    compiled = _GluonCompiled(log)
    monkeypatch.setattr(_Jit, "__getitem__", lambda self, grid: lambda *a, **m: self.slow.append(a) or compiled)
    blocks = ((64, 64), None, (32, 64))
    kept = hopper.GluonLaunch(jit, (2, 3, 1), dict(A=1), blocks + (None,), (7,))
    x = torch.zeros(64)

    def tensors():
        return torch.randn(128, 64).to(torch.bfloat16), x, torch.randn(96, 64).to(torch.float16)

    def expected(a, b):  # Triton's wrapper over fresh descriptors of a and b
        args = [TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), hopper._smem_layout(block, t.dtype))
                if block else t.data_ptr() for t, block in zip((a, x, b), blocks)] + [7]
        compiled.run(2, 3, 1, 1234, "fn", "meta", None, None, None, *args, *kept.launch.tail)
        del fills[:]  # the wrapper's own encodes
        return log.pop()

    a, _, b = tensors()
    kept(a, x, b)  # the first call goes through Triton
    assert len(jit.slow) == 1 and not log and not fills and kept.launch.descs
    for step in range(3):
        kept(a, x, b)
        assert fills == ([a.data_ptr(), b.data_ptr()] if step == 0 else []), step
        assert log.pop() == expected(a, b)
    a2, _, b2 = tensors()
    for step in range(2):
        kept(a2, x, b2)
        assert fills == ([a2.data_ptr(), b2.data_ptr()] if step == 0 else [])
        assert log.pop() == expected(a2, b2)
    kept(a, x, b)
    assert not fills and log.pop() == expected(a, b) and len(kept.encoded) == 2
    monkeypatch.setattr(hopper, "_MAX_ENCODED", 2)
    a3, _, b3 = tensors()
    kept(a3, x, b3)
    assert log.pop() == expected(a3, b3) and len(kept.encoded) == 1
    assert kept.launch.fast_calls == 7 and len(jit.slow) == 1


def test_what_the_fast_path_cannot_vouch_for_goes_through_triton(jit, monkeypatch):
    launch = L.Launch(jit, {"BLOCK": 16}, {})
    buf = torch.zeros(64)
    x, y = buf[:8], buf[8:16]
    launch(G, x, y, 5, 3)
    launch(G, buf[1:9], y, 5, 3)  # a pointer off 16-byte alignment: Triton specialises on it
    launch(G, x, y, 5, 2**31)  # an unspecialised int past i32: Triton types it i64
    monkeypatch.setattr(L, "_current_device", lambda: 1)  # the kernel was loaded on device 0
    launch(G, x, y, 5, 3)
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)  # a profiler listens: it gets Triton's launch metadata
    try:
        launch(G, x, y, 5, 3)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(jit.slow) == 5 and launch.fast_calls == 0
    launch(G, x, y, 5, 3)
    assert launch.fast_calls == 1


def test_nothing_is_kept_from_an_unaligned_first_call_or_the_interpreter(jit):
    launch = L.Launch(jit, {"BLOCK": 16}, {})
    buf = torch.zeros(64)
    launch(G, buf[1:9], buf[16:24], 5, 3)
    launch(G, buf[:8], buf[16:24], 5, 3)  # kept now
    launch(G, buf[:8], buf[16:24], 5, 3)
    assert len(jit.slow) == 2 and launch.fast_calls == 1

    jit.__class__ = type("_Interpreted", (_Jit,), {"__getitem__": lambda self, grid: lambda *a, **m: None})
    interpreted = L.Launch(jit, {"BLOCK": 16}, {})
    interpreted(G, buf[:8], buf[16:24], 5, 3)
    assert interpreted.compiled is None


def _decode_inputs(seed, cap=40, batch=2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, 4, 32, generator=gen)
    k, v = (torch.randn(batch, cap, 2, 32, generator=gen) for _ in range(2))
    lens = torch.tensor([cap - 3, 1][:batch], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, 4, 1), float("nan"))
    return tuple(t.to(DEV) for t in (q, k, v, out, lse, lens))


def test_a_shape_class_is_planned_once(monkeypatch):
    A.clear_plans()
    built = []

    class Counted(A.FwdPlan):
        def __init__(self, key):
            built.append(key)
            super().__init__(key)

    monkeypatch.setattr(A, "FwdPlan", Counted)
    params = AttnParams(32**-0.5)
    q, k, v, out, lse, lens = _decode_inputs(1)
    A.attn_fwd(q, k, v, out, lse, params=params, seqused_k=lens, num_splits=3)
    first = out.clone()
    q2, k2, v2, out2, lse2, lens2 = _decode_inputs(2)  # new values, same shape class
    A.attn_fwd(q2, k2, v2, out2, lse2, params=AttnParams(0.3, softcap=0.0), seqused_k=lens2, num_splits=3)
    assert len(built) == 1
    A.attn_fwd(q, k, v, out, lse, params=params, seqused_k=lens, num_splits=3)
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    assert len(built) == 1
    # each of these is another class: strides, split count, a flag, an optional tensor
    A.attn_fwd(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, out, lse, params=params, seqused_k=lens,
               num_splits=3)
    A.attn_fwd(q, k, v, out, lse, params=params, seqused_k=lens, num_splits=2)
    # (a left window: a right one is no flag for one query per sequence, which sees every key)
    A.attn_fwd(q, k, v, out, lse, params=AttnParams(32**-0.5, window_left=8), seqused_k=lens, num_splits=3)
    A.attn_fwd(q, k, v, out, lse, params=params, num_splits=3)
    assert len(built) == 5 and len(set(built)) == 5


def test_the_plan_names_everything_the_launch_reads():
    """Two calls that differ only in what ``_plan_key`` leaves out get one plan whose integer
    arguments fit both: the strides of q, k, v, out, lse are in the key, values are not."""
    A.clear_plans()
    params = AttnParams(32**-0.5)
    q, k, v, out, lse, lens = _decode_inputs(3)
    A.attn_fwd(q, k, v, out, lse, params=params, seqused_k=lens, num_splits=2)
    (key, plan), = A._PLANS.items()
    q2, k2, v2, out2, lse2, lens2 = _decode_inputs(4)
    assert A._plan_key(q2, k2, v2, out2, lse2, AttnParams(0.5, dropout_seed=9), None, None, None, 0, 0, lens2,
                       None, 2) == key
    assert plan.ints == A.FwdPlan(key).ints and plan.num_splits == 2


def test_the_autotuned_prefill_plan_keeps_the_chosen_config(monkeypatch):
    monkeypatch.setenv("TILEATTN_AUTOTUNE", "1")
    A.clear_plans()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 80, 2, 16, generator=gen).to(DEV) for _ in range(3))  # 80 rows: the prefill tile
    out, lse = torch.full_like(q, float("nan")), torch.full((1, 2, 80), float("nan"), device=DEV)
    A.attn_fwd(q, k, v, out, lse, params=AttnParams(0.25))
    (plan,) = A._PLANS.values()
    assert plan.tuned is not None and plan.fwd is not None
    assert plan.fwd.constexprs["BLOCK_M"] == plan.tuned.best(plan.tune_key).kwargs["BLOCK_M"]
    assert plan.grid == (2 * -(-80 // plan.fwd.constexprs["BLOCK_M"]), 1, 1)
    before = out.clone()
    out.fill_(float("nan"))
    A.attn_fwd(q, k, v, out, lse, params=AttnParams(0.25))
    torch.testing.assert_close(out, before, rtol=0, atol=0)


def test_a_growing_cache_through_the_public_api_keeps_one_plan(monkeypatch):
    """flash_attn_func passes its shapes as max_seqlen_q/k: a dense plan key must not hold them,
    or transformers' cache, one key longer every step, makes a plan per step (measured: 103
    instead of 55 µs per call on the CPU machine's stand-in launch)."""
    import tileattn

    if DEV == "cpu":
        monkeypatch.setenv("TILEATTN_BACKEND", "triton")  # the Triton launcher, interpreted
    A.clear_plans()
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 1, 4, 32, generator=gen).to(DEV)
    cache = torch.randn(1, 2, 80, 32, generator=gen).to(DEV)
    for n in (40, 41, 57):
        kv = cache[:, :, :n].transpose(1, 2)
        out = tileattn.flash_attn_func(q, kv, kv, causal=True)
        ref, _ = reference.attention_naive(*(t.double().cpu().numpy() for t in (q, kv, kv)), causal=True)
        assert_within(f"{n} keys", out, plain_attention(q, kv, kv, causal=True)[0], ref)
    assert len(A._PLANS) == 1


def test_a_serving_loop_reuses_its_plan(monkeypatch):
    """A paged varlen call as a serving loop makes it, the longest sequence one key longer every
    step: the plan takes max_seqlen_q/k as upper bounds rounded to a power of two, so the steps
    share one plan, and every step still matches the reference on each sequence's own keys."""
    import tileattn

    if DEV == "cpu":
        monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    A.clear_plans()
    gen = torch.Generator().manual_seed(10)
    pool = torch.randn(12, 8, 2, 32, generator=gen)
    table = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], dtype=torch.int32)
    q = torch.randn(2, 4, 32, generator=gen)  # one decoding token per sequence
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    for n in (33, 34, 40):
        used = torch.tensor([n, n - 20], dtype=torch.int32)
        out = tileattn.flash_attn_varlen_func(q.to(DEV), pool.to(DEV), pool.to(DEV), cu_q.to(DEV), None, 1, n,
                                              seqused_k=used.to(DEV), block_table=table.to(DEV), causal=True)
        for b in range(2):
            keys = pool[table[b].long()].flatten(0, 1)[:int(used[b])][None]
            ref, _ = reference.attention_naive(q[b][None, None].double().numpy(), keys.double().numpy(),
                                               keys.double().numpy(), causal=True)
            plain, _ = plain_attention(q[b][None, None], keys, keys, causal=True)
            assert_within(f"step {n} sequence {b}", out[b][None, None].cpu(), plain, ref)
    assert len(A._PLANS) == 1


def test_a_growing_dense_cache_keeps_one_plan():
    """transformers hands flash_attn_func its whole KV cache every step, one key longer each time
    (a (B, Hk, S, D) tensor seen through a transpose): one plan serves every step, taking the
    keys' strides and length per call, and each step matches the reference."""
    A.clear_plans()
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, 4, 32, generator=gen).to(DEV)
    params = AttnParams(32**-0.5)
    for keys in (48, 49, 64, 113):
        k, v = (torch.randn(2, 2, keys, 32, generator=gen).to(DEV).transpose(1, 2) for _ in range(2))
        out, lse = torch.full_like(q, float("nan")), torch.full((2, 4, 1), float("nan"), device=DEV)
        A.attn_fwd(q, k, v, out, lse, params=params)
        ref_out, ref_lse = reference.attention_naive(*(t.double().cpu().numpy() for t in (q, k, v)))
        plain_out, plain_lse = plain_attention(q, k, v)
        assert_within(f"{keys} keys out", out, plain_out, ref_out)
        assert_within(f"{keys} keys lse", lse, plain_lse, ref_lse)
    (plan,) = A._PLANS.values()
    assert plan.kv_per_call
    wide = torch.randn(2, 48, 2, 33, generator=gen).to(DEV)[..., :32]  # a row stride of 66: not a multiple of 16
    A.attn_fwd(q, wide, wide, out, lse, params=params)
    assert len(A._PLANS) == 2 and A._PLANS[A._plan_key(q, wide, wide, out, lse, params, None, None, None, 0, 0, None,
                                                       None, 1)].fwd is not plan.fwd



def test_a_growing_packed_cache_keeps_one_plan_per_stride_class():
    """A DecodePlan over transformers' left-padded caches reads each row in place as packed keys
    (tokens, Hk, D) whose token count and head stride grow with the cache (``kvcache.as_tokens``):
    one plan serves the steps whose strides Triton classifies alike, taking the strides per call,
    and every step matches the reference; a head stride of another class (head dim 40: 40 x an odd
    slot count is no multiple of 16) gets a plan and launch of its own. The same call after the
    plans are dropped gives the same bits."""
    A.clear_plans()
    gen = torch.Generator().manual_seed(12)
    params = AttnParams(40**-0.5)
    batch, pads = 2, [3, 0]
    outs = {}
    for slots in (22, 24, 23, 30):  # head strides 880, 960 (multiples of 16), 920 (not), 1200
        cache = [torch.randn(batch, 2, slots, 40, generator=gen).to(DEV) for _ in range(2)]
        k, v = (c.transpose(1, 2) for c in cache)  # (batch, slots, 2, 40), rows 2 * slots tokens apart
        pitch = 2 * slots
        k_tok, v_tok = (c.as_strided(((batch - 1) * pitch + slots, 2, 40), c.stride()[1:], c.storage_offset())
                        for c in (k, v))
        q = torch.randn(batch, 4, 40, generator=gen).to(DEV)  # one query per sequence, packed
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([b * pitch + pads[b] for b in range(batch)] + [k_tok.shape[0]], dtype=torch.int32,
                            device=DEV)
        used = torch.tensor([slots - p for p in pads], dtype=torch.int32, device=DEV)
        out, lse = torch.full_like(q, float("nan")), torch.full((4, batch), float("nan"), device=DEV)
        call = dict(params=params, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=slots,
                    seqused_k=used)
        A.attn_fwd(q, k_tok, v_tok, out, lse, **call)
        for b in range(batch):
            keys, values = (x[b:b + 1, pads[b]:] for x in (k, v))
            ref, _ = reference.attention_naive(q[b][None, None].double().cpu().numpy(),
                                               keys.double().cpu().numpy(), values.double().cpu().numpy())
            plain, _ = plain_attention(q[b][None, None], keys, values)
            assert_within(f"{slots} slots, sequence {b}", out[b][None, None], plain, ref)
        outs[slots] = (out, (q, k_tok, v_tok, call))
    plans = list(A._PLANS.values())
    assert len(plans) == 2 and all(p.kv_per_call == "packed" for p in plans)
    assert plans[0].fwd is not plans[1].fwd  # 16 and 17: compiled apart
    for slots, (out, (q, k_tok, v_tok, call)) in outs.items():  # a plan made for this call alone
        A.clear_plans()
        again, lse = torch.full_like(q, float("nan")), torch.full((4, batch), float("nan"), device=DEV)
        A.attn_fwd(q, k_tok, v_tok, again, lse, **call)
        assert torch.equal(again, out), f"{slots} slots"

def _kernel(X, n, m, BLOCK: tl.constexpr):
    pass


def test_int_class_reads_do_not_specialize_from_either_kind_of_jit_function():
    for fn in (JITFunction(_kernel, do_not_specialize=["m"]), InterpretedFunction(_kernel, do_not_specialize=["m"])):
        assert L.int_class(fn, 1, (16, 16)) == ((False, True, True), (True,))
        assert L.int_class(fn, 1, (1, 2**31)) == ((True, False, True), (False,))


@pytest.mark.gpu
def test_gpu_direct_launches_equal_triton_launches_and_never_sync():
    """On the GPU the second call of each shape class launches the kept kernels directly: its
    outputs equal the first call's bit for bit (forward with and without splits, an autotuned
    prefill, the backward, the append), and no launch synchronises with the device."""
    from tileattn import gpu
    import tileattn.gpu.backward as B

    A.clear_plans()
    B.clear_plans()  # plans of earlier tests in this process launched once each
    gen = torch.Generator(device="cuda").manual_seed(7)
    dt = torch.bfloat16
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=dt, generator=gen)
    kc, vc = (torch.randn(2, 4096, 8, 128, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    lens = torch.tensor([4000, 77], dtype=torch.int32, device="cuda")
    qp, kp, vp, dout = (torch.randn(1, 512, 8, 128, device="cuda", dtype=dt, generator=gen) for _ in range(4))
    causal = AttnParams(128**-0.5, window_right=0)

    def calls():
        outs = []
        for splits in (1, 0):
            out, lse = torch.empty_like(q), torch.empty((2, 32, 1), device="cuda")
            A.attn_fwd(q, kc, vc, out, lse, params=AttnParams(128**-0.5), seqused_k=lens, num_splits=splits)
            outs += [out, lse]
        out, lse = torch.empty_like(qp), torch.empty((1, 8, 512), device="cuda")
        A.attn_fwd(qp, kp, vp, out, lse, params=causal)
        grads = [torch.empty_like(t) for t in (qp, kp, vp)]
        B.attn_bwd(dout, qp, kp, vp, out, lse, *grads, params=causal)
        k_cache = kc.clone()
        gpu.append_kv(k_cache, k_cache, q[:, :, :8], q[:, :, :8], lens)
        return outs + [out, lse, *grads, k_cache[:, 4000], k_cache[:, 77]]

    first = calls()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(first, second):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    launches = {id(x): x for plan in A._PLANS.values() for x in (plan.fwd, plan.combine) if x is not None}
    assert launches and all(x.fast_calls > 0 for x in launches.values())
    assert all(k.launch.fast_calls > 0 for plan in B._PLANS.values() for k in plan.kernels)


@pytest.mark.parametrize("packed", [False, True])
def test_one_query_per_sequence_drops_the_right_mask(packed):
    """A causal (or right-windowed) call with one query per sequence sees every key (bottom-right
    aligned): its plan has no right mask, and its output is the unmasked one, bit for bit; two
    queries keep the mask."""
    gen = torch.Generator().manual_seed(13)
    for rows, masked in ((1, False), (2, True)):
        A.clear_plans()
        q = torch.randn(3, rows, 4, 16, generator=gen).to(DEV)
        k, v = (torch.randn(3, 50, 2, 16, generator=gen).to(DEV) for _ in range(2))
        outs = []
        for params in (AttnParams(0.25, -1, 0), AttnParams(0.25, -1, -1), AttnParams(0.25, 20, 3)):
            out, lse = torch.full_like(q, float("nan")), torch.full((3, 4, rows), float("nan"), device=DEV)
            if packed:  # three sequences of `rows` queries over packed keys
                cu_q = torch.arange(0, 3 * rows + 1, rows, dtype=torch.int32, device=DEV)
                cu_k = torch.arange(0, 151, 50, dtype=torch.int32, device=DEV)
                o, l = out.view(3 * rows, 4, 16), torch.full((4, 3 * rows), float("nan"), device=DEV)
                A.attn_fwd(q.view(3 * rows, 4, 16), k.view(150, 2, 16), v.view(150, 2, 16), o, l, params=params,
                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=rows, max_seqlen_k=50)
            else:
                A.attn_fwd(q, k, v, out, lse, params=params)
            outs.append(out.clone())
        flags = [plan.flags["MASK_RIGHT"] for plan in A._PLANS.values()]
        assert flags == ([True, False, True] if masked else [False, False]), flags  # causal and (-1, -1) share a plan
        if not masked:
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        else:
            assert not torch.equal(outs[0], outs[1])


def test_arg_classes_name_what_triton_specialises():
    """``arg_classes`` (the Gluon launches' per-call signature) tells apart what makes Triton
    compile another kernel: a tensor's dtype or absence, an integer equal to 1 or divisible by 16
    (unless the kernel leaves it unspecialised), a descriptor's block shape and dtype; values
    that specialise alike give one class."""
    from types import SimpleNamespace

    from tileattn.gpu._launch import arg_classes

    fn = SimpleNamespace(arg_names=["X", "S", "n", "m", "d"], do_not_specialize=["m"])
    t32, t16 = torch.empty(4), torch.empty(4, dtype=torch.float16)
    desc = SimpleNamespace(block_shape=[1, 64, 1, 128], base=t16)

    def cls(*args):
        return arg_classes(fn, args)

    base = cls(t32, None, 32, 5, desc)
    assert cls(torch.empty(9), None, 48, 7, desc) == base  # same dtype, 48 % 16 == 0, m unspecialised
    assert cls(t16, None, 32, 5, desc) != base
    assert cls(t32, t32, 32, 5, desc) != base  # an optional tensor given
    assert cls(t32, None, 1, 5, desc) != base and cls(t32, None, 33, 5, desc) != base
    assert cls(t32, None, 32, 1, desc) == base  # m is not specialised: only its i32 range counts
    assert cls(t32, None, 32, 2**40, desc) != base
    wider = SimpleNamespace(block_shape=[1, 128, 1, 128], base=t16)
    assert cls(t32, None, 32, 5, wider) != base


def test_arg_classes_equal_the_isinstance_chain():
    """``arg_classes`` tells plain ints, None, floats, bools and tensors apart by their exact type
    first: for every kind of argument (subclasses of int and float, numpy floats, descriptors) it
    gives what the chain of isinstance tests gives."""
    import enum
    from types import SimpleNamespace

    import numpy as np

    from tileattn.gpu._launch import _I32_MAX, _I32_MIN, arg_classes

    def chain(fn, args):
        out = []
        for name, v in zip(fn.arg_names, args):
            if isinstance(v, torch.Tensor):
                out.append(v.dtype)
            elif v is None or isinstance(v, (bool, float)):
                out.append(v if v is None else type(v))
            elif isinstance(v, int):
                out.append((_I32_MIN <= v <= _I32_MAX,) if name in fn.do_not_specialize
                           else (v == 1, v % 16 == 0, _I32_MIN <= v <= _I32_MAX))
            else:
                out.append((tuple(v.block_shape), v.base.dtype))
        return tuple(out)

    class Small(enum.IntEnum):
        ONE = 1
        BIG = 2**40

    desc = SimpleNamespace(block_shape=[1, 64, 1, 128], base=torch.empty(1, dtype=torch.float16))
    values = [1, 0, 16, 17, -16, 2**31, -(2**31) - 1, True, False, 0.5, np.float64(2.0), None, Small.ONE, Small.BIG,
              torch.empty(2), torch.nn.Parameter(torch.empty(2, dtype=torch.bfloat16)), desc]
    names = [f"a{i}" for i in range(len(values))]
    for loose in ([], names[::2]):
        fn = SimpleNamespace(arg_names=names, do_not_specialize=loose)
        for shift in range(3):  # each value under a specialised and an unspecialised name
            args = values[shift:] + values[:shift]
            assert arg_classes(fn, args) == chain(fn, args)


@pytest.mark.parametrize("shapes", [((16, 1, 1, 32, 128), (16, 1, 32, 1)), ((3, 2, 5, 7, 40), (3, 2, 7, 5))])
def test_partials_workspace_is_two_contiguous_views_of_one_buffer(shapes):
    """The split partials' (o, lse): contiguous fp32 views of one allocation, lse from the first
    128-byte boundary past o, each writable without touching the other."""
    o_parts, lse_parts = L.partials_workspace(shapes, "cpu")
    o_numel = o_parts.numel()
    assert (o_parts.shape, lse_parts.shape) == shapes
    assert o_parts.is_contiguous() and lse_parts.is_contiguous()
    assert o_parts.dtype == lse_parts.dtype == torch.float32
    assert o_parts.untyped_storage().data_ptr() == lse_parts.untyped_storage().data_ptr()
    assert o_parts.storage_offset() == 0 and lse_parts.storage_offset() == -(-o_numel // 32) * 32
    assert lse_parts.untyped_storage().nbytes() == 4 * (lse_parts.storage_offset() + lse_parts.numel())
    o_parts.fill_(1.0)
    lse_parts.fill_(2.0)
    assert bool((o_parts == 1.0).all()) and bool((lse_parts == 2.0).all())


def test_interpreting_is_what_the_kernels_are(monkeypatch):
    """Whether the kernels run in Triton's interpreter is read from the kernels (Triton's jit decided
    it when they were defined), not from the environment, which a later change cannot make true."""
    from triton.runtime.interpreter import InterpretedFunction

    from tileattn.gpu import _tuning
    from tileattn.kernels.attn_fwd import _attn_fwd_kernel

    expected = isinstance(_attn_fwd_kernel, InterpretedFunction)
    for value in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert _tuning.interpreting() is expected
    assert expected == (not torch.cuda.is_available())  # conftest: the interpreter where there is no GPU


def test_a_launch_names_every_constexpr():
    """``launch_for`` refuses constexprs left to their defaults: ``_through_triton`` would keep no such
    launch, and each of its calls would go through Triton's launch path (a constexpr added with a
    default that one launcher did not pass did this to every plain forward launch once)."""
    from tileattn.gpu import combine
    from tileattn.kernels.combine import _combine_kernel

    key = ((torch.float32,) * 4 + (None,), ())
    full = dict(HEAD_DIM=32, HEAD_DIM_PAD=32, BLOCK_S=2, HAS_SINK=False, SKIP_MARKED=False)
    assert L.launch_for(_combine_kernel, full, dict(num_warps=combine.COMBINE_NUM_WARPS), key) is not None
    partial = {k: v for k, v in full.items() if k != "SKIP_MARKED"}  # the kernel's default, False
    with pytest.raises(AssertionError, match="SKIP_MARKED"):
        L.launch_for(_combine_kernel, partial, dict(num_warps=combine.COMBINE_NUM_WARPS), key)


def _gpus(jit, monkeypatch, kernels):
    """Triton's calls return, in turn, stand-in kernels with the (handle, target) pairs of ``kernels``;
    returns the one-element list whose value is the current device (0 at first)."""
    from types import SimpleNamespace

    kernels = iter(kernels)

    def run(grid):
        def compiled(*args, **meta):
            jit.slow.append((grid, args, meta))
            kernel = _Compiled(jit.fast)
            kernel.function, target = next(kernels)
            kernel.metadata = SimpleNamespace(target=target)
            return kernel
        return compiled

    monkeypatch.setattr(_Jit, "__getitem__", lambda self, grid: run(grid))
    device = [0]
    monkeypatch.setattr(L, "_current_device", lambda: device[0])
    return device


def test_each_gpu_of_the_process_gets_its_own_kept_handle(jit, monkeypatch):
    """A kept launch called on another GPU goes through Triton once there (which loads the kernel on
    that GPU), then launches directly with that GPU's handle; each GPU keeps launching its own. A
    call Triton compiles differently (an unaligned pointer) is not kept as a GPU's handle."""
    device = _gpus(jit, monkeypatch, [("device 0", "sm_90"), ("device 1, unaligned", "sm_90"), ("device 1", "sm_90")])
    launch = L.Launch(jit, {"BLOCK": 16}, {})
    buf = torch.zeros(64)
    x, y = buf[:8], buf[8:16]
    launch(G, x, y, 5, 3)  # device 0: kept
    device[0] = 1
    launch(G, buf[1:9], y, 5, 3)  # unaligned: through Triton, not kept for device 1
    assert len(jit.slow) == 2 and launch.elsewhere == {}
    launch(G, x, y, 5, 3)  # device 1's first vouched call: through Triton, kept
    launch(G, x, y, 5, 4)
    device[0] = 0
    launch(G, x, y, 5, 5)
    assert len(jit.slow) == 3 and launch.fast_calls == 2
    assert [call[4] for call in jit.fast] == ["device 1", "device 0"]
    assert [call[12] for call in jit.fast] == [4, 5]


def test_a_gpu_of_another_model_keeps_going_through_triton(jit, monkeypatch):
    """A kept launch does not keep the handle of a kernel built for another target (a second GPU of
    another model in the process): the C launcher and flags it keeps are the first GPU's."""
    device = _gpus(jit, monkeypatch, [("device 0", "sm_90"), ("device 1", "sm_80"), ("device 1", "sm_80")])
    launch = L.Launch(jit, {"BLOCK": 16}, {})
    x, y = torch.zeros(8), torch.zeros(8)
    launch(G, x, y, 5, 3)
    device[0] = 1
    launch(G, x, y, 5, 3)
    launch(G, x, y, 5, 4)
    assert launch.elsewhere == {} and len(jit.slow) == 3 and launch.fast_calls == 0
