"""Global torch settings a user may have made: the public functions give what they give without them.

* ``torch.set_default_device``: what the library allocates follows the inputs' device, never the
  default one ("meta" stands in for a user's "cuda" on a CPU-only machine: a tensor left on it
  has no data, so any allocation that forgets ``device=`` fails or differs);
* ``torch.set_default_dtype`` (float64, float16): index, offset, LSE and scratch tensors keep their
  own dtypes;
* ``torch.use_deterministic_algorithms(True)``, ``torch.set_num_threads(1)``, and
  ``torch.set_grad_enabled(False)``.

Each case computes its results under the setting and with torch's defaults (restored for that
call only) from the same CPU inputs, and wants the same bits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import tileattn
from tileattn.bert_padding import pad_input, unpad_input
from tileattn.ops.fp8 import FP8_DTYPE

CPU = torch.device("cpu")

SETTINGS = ["default_device_meta", "default_dtype_float64", "default_dtype_float16", "deterministic",
            "one_thread", "grad_disabled"]


def _apply(name: str) -> None:
    """Make ``name`` (one of SETTINGS) torch's global state."""
    if name == "default_device_meta":
        torch.set_default_device("meta")
    elif name.startswith("default_dtype_"):
        torch.set_default_dtype(getattr(torch, name.removeprefix("default_dtype_")))
    elif name == "deterministic":
        torch.use_deterministic_algorithms(True)
    elif name == "one_thread":
        torch.set_num_threads(1)
    elif name == "grad_disabled":
        torch.set_grad_enabled(False)


def _restore(state: tuple) -> None:
    dtype, threads, deterministic, grad = state
    torch.set_default_device(None)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    torch.set_grad_enabled(grad)


@pytest.fixture(params=SETTINGS)
def setting(request):
    """Sets one global torch setting (e.g. the default device to "meta") for the test and restores
    torch's state after it; the test gets a context manager that undoes the setting for a block
    (the baseline's call)."""
    state = (torch.get_default_dtype(), torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_grad_enabled())

    @contextlib.contextmanager
    def defaults():
        _restore(state)
        try:
            yield
        finally:
            _apply(request.param)

    _apply(request.param)
    try:
        yield defaults
    finally:
        _restore(state)


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float32, device=CPU).to(dtype)


def ints(values):
    return torch.tensor(values, dtype=torch.int32, device=CPU)


def assert_same(got: dict, want: dict):
    """Same keys, devices, dtypes, shapes and bits (NaN where NaN); a gradient the setting left
    out (grad disabled) is skipped."""
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if g is None:  # a gradient with grad disabled (``_backward``)
            continue
        assert (g.device, g.dtype, g.shape) == (w.device, w.dtype, w.shape), name
        if g.dtype.is_floating_point:
            g, w = g.detach().double(), w.detach().double()
            assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.nan_to_num()), (
                f"{name}: differs by {(g - w).abs().nan_to_num(float('inf')).max().item():.3g}")
        else:
            assert torch.equal(g, w), name


def same_under(setting, case, *args):
    with setting():
        want = case(*args)
    assert_same(case(*args), want)


def _backward(out, *leaves):
    """Gradients of out.sum() (None each with grad disabled: nothing to differentiate)."""
    if not torch.is_grad_enabled():
        return [None] * len(leaves)
    out.float().sum().backward()
    return [x.grad for x in leaves]


# ---------------------------------------------------------------------------- the cases


def _dense(q, k, v, alibi, sink):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, alibi_slopes=alibi, return_attn_probs=True)
    dq, dk, dv = _backward(out, q, k, v)
    windowed = tileattn.flash_attn_func(q.detach(), k.detach(), v.detach(), window_size=(5, 3), softcap=30.0,
                                        learnable_sink=sink)
    torch.manual_seed(5)  # dropout draws its seed from torch's CPU generator
    dropped, _, probs = tileattn.flash_attn_func(q.detach(), k.detach(), v.detach(), dropout_p=0.3, causal=True,
                                                 return_attn_probs=True)  # probs: the dropout signs too
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, windowed=windowed, dropped=dropped, probs=probs)


def test_flash_attn_func(device, setting):
    gen = torch.Generator(device=CPU).manual_seed(0)
    q, k, v = rand(gen, 2, 19, 4, 40), rand(gen, 2, 23, 2, 40), rand(gen, 2, 23, 2, 40)
    same_under(setting, _dense, q, k, v, torch.rand(4, generator=gen, dtype=torch.float32, device=CPU), rand(gen, 4))


def _varlen(q, k, v, cu_q, cu_k):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 21, causal=True, return_attn_probs=True)
    dq, dk, dv = _backward(out, q, k, v)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def test_flash_attn_varlen_func(device, setting):
    gen = torch.Generator(device=CPU).manual_seed(1)
    q, k, v = rand(gen, 30, 4, 40, dtype=torch.bfloat16), rand(gen, 33, 2, 40, dtype=torch.bfloat16), \
        rand(gen, 33, 2, 40, dtype=torch.bfloat16)
    same_under(setting, _varlen, q, k, v, ints([0, 7, 7, 30]), ints([0, 10, 12, 33]))


def _kvcache(t):
    t = {name: x.clone() for name, x in t.items()}
    res = {}
    for paged in (False, True):
        kc, vc = (t["pool_k"], t["pool_v"]) if paged else (t["k_cache"], t["v_cache"])
        table = t["table"] if paged else None
        res[f"out{paged}"], res[f"lse{paged}"] = tileattn.flash_attn_with_kvcache(
            t["q"], kc, vc, k=t["k"], v=t["v"], rotary_cos=t["cos"], rotary_sin=t["sin"], cache_seqlens=t["lens"],
            block_table=table, causal=True, return_softmax_lse=True, num_splits=2)
        res[f"k_cache{paged}"] = kc
        plan = tileattn.DecodePlan(t["q"], kc, vc, t["lens"] + 1, table, seqlen_new=1, causal=True,
                                   return_softmax_lse=True)
        res[f"plan_out{paged}"], res[f"plan_lse{paged}"] = plan.run(t["q"], kc, vc, k=t["k"], v=t["v"])
    res["leftpad"] = tileattn.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], cache_seqlens=t["lens"],
                                                      cache_leftpad=t["leftpad"], learnable_sink=t["sink"])
    plan = tileattn.DecodePlan(t["q"], t["k_cache"], t["v_cache"], t["lens"], cache_leftpad=t["leftpad"],
                               learnable_sink=t["sink"], num_splits=2)
    res["plan_leftpad"] = plan.run(t["q"], t["k_cache"], t["v_cache"], learnable_sink=t["sink"])
    return res


def test_flash_attn_with_kvcache_and_decode_plan(device, setting):
    """An append into a contiguous and into a paged cache (rotated), split keys, cache_leftpad."""
    gen = torch.Generator(device=CPU).manual_seed(2)
    dt = torch.bfloat16
    t = dict(q=rand(gen, 2, 1, 4, 40, dtype=dt), k=rand(gen, 2, 1, 2, 40, dtype=dt), v=rand(gen, 2, 1, 2, 40, dtype=dt),
             k_cache=rand(gen, 2, 40, 2, 40, dtype=dt), v_cache=rand(gen, 2, 40, 2, 40, dtype=dt),
             pool_k=rand(gen, 12, 8, 2, 40, dtype=dt), pool_v=rand(gen, 12, 8, 2, 40, dtype=dt),
             table=ints([[3, 7, 1, 0], [5, 2, 9, 11]]), lens=ints([17, 30]), leftpad=ints([3, 0]),
             cos=torch.cos(rand(gen, 64, 20)), sin=torch.sin(rand(gen, 64, 20)), sink=rand(gen, 4))
    same_under(setting, _kvcache, t)


def _paged_cache(k, v, q, fp8):
    cache = tileattn.PagedKVCache(1, 10, 8, 2, 40, dtype=FP8_DTYPE if fp8 else k.dtype, device=CPU)
    a, b = cache.allocate(), cache.allocate()
    cache.reserve([a], 13)
    cache.reserve([b], 12)
    descale = torch.full((2, 2), 0.05, dtype=torch.float32, device=CPU) if fp8 else None
    cache.write_packed(0, [a, b], k, v, [0, 13, 25], k_descale=descale, v_descale=descale)
    cache.advance([a, b], 0)
    cache.advance([a], 13)
    cache.advance([b], 12)
    table, lens = cache.block_table([a, b]), cache.seqlens([a, b])
    table_out = cache.block_table([a, b], out=torch.full((2, 4), -1, dtype=torch.int32, device=CPU))
    out = tileattn.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0], cache_seqlens=lens,
                                           block_table=table, k_descale=descale, v_descale=descale)
    pool = cache.k_cache[0].view(torch.uint8) if fp8 else cache.k_cache[0]
    return dict(out=out, table=table, lens=lens, table_out=table_out, pool=pool)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_paged_kv_cache(device, setting, fp8):
    gen = torch.Generator(device=CPU).manual_seed(3)
    dt = torch.float32 if fp8 else torch.bfloat16
    q = rand(gen, 2, 1, 4, 40, dtype=torch.bfloat16)
    same_under(setting, _paged_cache, rand(gen, 25, 2, 40, dtype=dt), rand(gen, 25, 2, 40, dtype=dt), q, fp8)


def _cascade(q, k, v, pool_k, pool_v):
    pool_k, pool_v = pool_k.clone(), pool_v.clone()
    out, lse = tileattn.cascade_attn_with_kvcache(q, pool_k, pool_v, ints([[4, 6]]), ints([16]),
                                                  ints([[8, 10, 0], [1, 3, 0]]), ints([9, 12]), k=k, v=v,
                                                  causal=True, return_softmax_lse=True, num_splits=3)
    return dict(out=out, lse=lse, pool_k=pool_k)


def test_cascade_attn_with_kvcache(device, setting):
    gen = torch.Generator(device=CPU).manual_seed(4)
    dt = torch.bfloat16
    same_under(setting, _cascade, rand(gen, 2, 1, 4, 40, dtype=dt), rand(gen, 2, 1, 2, 40, dtype=dt),
               rand(gen, 2, 1, 2, 40, dtype=dt), rand(gen, 12, 8, 2, 40, dtype=dt), rand(gen, 12, 8, 2, 40, dtype=dt))


def _merge_and_padding(o_a, lse_a, o_b, lse_b, sink, x, mask):
    o, lse = tileattn.merge_states(o_a, lse_a, o_b, lse_b)
    o_many, lse_many = tileattn.merge_many([o_a, o_b], [lse_a, lse_b])
    o_sink, lse_sink = tileattn.merge_sink(o_a, lse_a, sink)
    x = x.clone().requires_grad_()
    packed, indices, cu, max_len, used = unpad_input(x, mask)
    padded = pad_input(packed * 2, indices, *mask.shape)
    (dx,) = _backward(padded, x)
    return dict(o=o, lse=lse, o_many=o_many, lse_many=lse_many, o_sink=o_sink, lse_sink=lse_sink, packed=packed,
                indices=indices, cu=cu, max_len=torch.tensor(max_len, device=CPU), used=used, padded=padded, dx=dx)


def test_merge_states_and_padding(device, setting):
    gen = torch.Generator(device=CPU).manual_seed(5)
    mask = torch.tensor([[1] * 19, [1] * 11 + [0] * 8], dtype=torch.bool, device=CPU)
    same_under(setting, _merge_and_padding, rand(gen, 2, 19, 4, 40, dtype=torch.bfloat16), rand(gen, 2, 4, 19),
               rand(gen, 2, 19, 4, 40, dtype=torch.bfloat16), rand(gen, 2, 4, 19), rand(gen, 4),
               rand(gen, 2, 19, 160), mask)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A gloo process group of one rank in this process (the ring functions' default group)."""
    if dist.is_initialized():
        pytest.skip("a default process group exists already")
    path = tmp_path_factory.mktemp("gloo") / "init"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ring(q, k, v, cu):
    from tileattn import distributed as D
    res = {}
    for name, fn in (("ring", D.ring_flash_attn_func), ("zigzag", D.zigzag_ring_flash_attn_func)):
        lq, lk, lv = (x.clone().requires_grad_() for x in (q, k, v))
        res[name], res[name + "_lse"], _ = fn(lq, lk, lv, causal=True, return_attn_probs=True)
        res[name + "_dq"], res[name + "_dk"], res[name + "_dv"] = _backward(res[name], lq, lk, lv)
    packed = [x.flatten(0, 1) for x in (q, k, v)]
    for name, fn in (("ring_varlen", D.ring_flash_attn_varlen_func),
                     ("zigzag_varlen", D.zigzag_ring_flash_attn_varlen_func)):
        lq, lk, lv = (x.clone().requires_grad_() for x in packed)
        res[name] = fn(lq, lk, lv, cu, 28, causal=True)
        res[name + "_dq"], res[name + "_dk"], res[name + "_dv"] = _backward(res[name], lq, lk, lv)
    cu_q, cu_k, max_q, max_k, local_k = D.llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, 1)
    lq, lk, lv = (x.clone().requires_grad_() for x in packed)
    res["llama3"] = D.llama3_flash_attn_varlen_func(lq, lk, lv, cu_q, cu_k, max_q, max_k, 1, local_k, causal=True)
    res["llama3_dq"], res["llama3_dk"], res["llama3_dv"] = _backward(res["llama3"], lq, lk, lv)
    return res


def test_ring_functions_on_a_world_of_one(device, setting, world_of_one):
    gen = torch.Generator(device=CPU).manual_seed(6)
    dt = torch.bfloat16
    q, k, v = rand(gen, 2, 18, 4, 32, dtype=dt), rand(gen, 2, 18, 2, 32, dtype=dt), rand(gen, 2, 18, 2, 32, dtype=dt)
    same_under(setting, _ring, q, k, v, ints([0, 8, 8, 36]))


@pytest.mark.parametrize("default", ["torch.set_default_device('meta')", "torch.set_default_dtype(torch.float64)"])
def test_first_call_under_a_default_device_or_dtype(device, default):
    """A fresh process whose first call runs under the user's default device or dtype: the backend
    module is imported then, and what it builds at import (constants) must not take them (a float32
    zero built as float64 broke every small float32 call on the CPU path)."""
    code = (f"import torch\n{default}\nimport tileattn\n"
            "g = torch.Generator(device='cpu').manual_seed(0)\n"
            "q, k, v = (torch.randn(1, 3, 2, 16, generator=g, dtype=torch.float32, device='cpu') for _ in range(3))\n"
            "out = tileattn.flash_attn_func(q, k, v)\n"
            "assert out.device.type == 'cpu' and out.dtype == torch.float32, (out.device, out.dtype)\n"
            "want = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).mT / 4, -1) @ v.transpose(1, 2)\n"
            "torch.testing.assert_close(out, want.transpose(1, 2))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # TILEATTN_BACKEND: the device fixture's
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _two_ranks(rank: int, world: int, init: str, result_dir: str) -> None:
    """One rank of test_ring_of_two_under_a_default_device_of_meta: results with the default
    device "meta" and without, compared; writes 'ok' or what differed or raised."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from tileattn import distributed as D
    gen = torch.Generator(device=CPU).manual_seed(0)
    q, k, v = rand(gen, 1, 16, 4, 32), rand(gen, 1, 16, 2, 32), rand(gen, 1, 16, 2, 32)
    cu = ints([0, 8, 24])

    def run():
        res = {}
        for name, fn, shard in (("ring", D.ring_flash_attn_func, D.contiguous_shard),
                                ("zigzag", D.zigzag_ring_flash_attn_func, D.zigzag_shard)):
            lq, lk, lv = (shard(x, rank, world).clone().requires_grad_() for x in (q, k, v))
            res[name] = fn(lq, lk, lv, causal=True)
            res[name + "_dq"], res[name + "_dk"], res[name + "_dv"] = _backward(res[name], lq, lk, lv)
        packed = [torch.cat([x[0], x[0, :8]]) for x in (q, k, v)]
        lq, lk, lv = (D.zigzag_shard_varlen(x, cu, rank, world) for x in packed)
        res["zigzag_varlen"] = D.zigzag_ring_flash_attn_varlen_func(lq, lk, lv, cu // world, 16 // world, causal=True)
        return res

    want = run()
    torch.set_default_device("meta")
    try:
        assert_same(run(), want)
        verdict = "ok"
    except Exception as e:  # reported by the test
        verdict = f"{type(e).__name__}: {e}"
    finally:
        torch.set_default_device(None)
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(verdict)
    dist.destroy_process_group()


def test_ring_of_two_under_a_default_device_of_meta(tmp_path, monkeypatch):
    """Two gloo ranks (the ranks' agreement on their inputs exchanges a row of ints before the ring)."""
    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    import torch.multiprocessing as mp
    mp.start_processes(_two_ranks, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["ok", "ok"]
