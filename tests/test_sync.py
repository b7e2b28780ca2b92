"""No host-device synchronisation in any public function (issue #17), on the GPU.

Each call runs once to compile and autotune, then again under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising CUDA call
(``.item()``, ``.cpu()``, ``.tolist()``, synchronous copies). The value checks of CUDA
tensors are asynchronous device assertions (``tileattn.ops._validate``), so they run here too.
"""

import contextlib

import pytest
import torch

import tileattn
from graphs import captured
from tolerance import assert_same_to_rounding

@contextlib.contextmanager
def sync_forbidden():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # a failed device assertion surfaces here


def warm_then_forbid(fn):
    """fn() once to compile and autotune, then again with synchronisation forbidden."""
    fn()
    with sync_forbidden():
        return fn()


def rand(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_dense_forward_and_backward(dropout_p):
    gen = torch.Generator(device="cuda").manual_seed(81)
    q, k, v = (rand(2, 128, 8, 64, gen=gen).requires_grad_() for _ in range(3))

    def step():
        out = tileattn.flash_attn_func(q, k, v, causal=True, dropout_p=dropout_p)
        out.backward(torch.ones_like(out))

    warm_then_forbid(step)


@pytest.mark.gpu
def test_varlen_forward_and_backward():
    gen = torch.Generator(device="cuda").manual_seed(82)
    cu = torch.tensor([0, 50, 51, 170], dtype=torch.int32, device="cuda")
    q, k, v = (rand(170, 8, 64, gen=gen).requires_grad_() for _ in range(3))

    def step():
        out = tileattn.flash_attn_varlen_func(q, k, v, cu, cu, 119, 119, causal=True)
        out.backward(torch.ones_like(out))

    warm_then_forbid(step)


@pytest.mark.gpu
def test_varlen_over_a_paged_pool():
    gen = torch.Generator(device="cuda").manual_seed(83)
    q = rand(7, 8, 64, gen=gen)
    pool = rand(16, 16, 2, 64, gen=gen)
    table = torch.randperm(16, device="cuda", generator=gen)[:8].view(2, 4).to(torch.int32)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 40, 90], dtype=torch.int32, device="cuda")
    warm_then_forbid(lambda: tileattn.flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 4, 50, causal=True,
                                                             block_table=table))


@pytest.mark.gpu
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "paged", "leftpad", "batch_idx"])
def test_with_kvcache(layout, append):
    gen = torch.Generator(device="cuda").manual_seed(84)
    batch = 3
    q = rand(batch, 1, 32, 128, gen=gen)
    k_new, v_new = (rand(batch, 1, 8, 128, gen=gen) for _ in range(2)) if append else (None, None)
    lens = torch.tensor([1, 300, 700], dtype=torch.int32, device="cuda")
    opts = dict(k=k_new, v=v_new, cache_seqlens=lens, causal=True)
    if layout == "paged":
        k_cache, v_cache = rand(200, 16, 8, 128, gen=gen), rand(200, 16, 8, 128, gen=gen)
        opts["block_table"] = torch.randperm(200, device="cuda", generator=gen)[:3 * 50].view(3, 50).to(torch.int32)
    else:
        rows = batch + 2 if layout == "batch_idx" else batch
        k_cache, v_cache = rand(rows, 1024, 8, 128, gen=gen), rand(rows, 1024, 8, 128, gen=gen)
        if layout == "leftpad":
            opts["cache_leftpad"] = torch.tensor([0, 10, 100], dtype=torch.int32, device="cuda")
        if layout == "batch_idx":
            opts["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    warm_then_forbid(lambda: tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, **opts))


@pytest.mark.gpu
def test_with_kvcache_rotary_append():
    gen = torch.Generator(device="cuda").manual_seed(85)
    q = rand(2, 2, 8, 64, gen=gen)
    k_cache, v_cache = rand(2, 256, 2, 64, gen=gen), rand(2, 256, 2, 64, gen=gen)
    k_new, v_new = rand(2, 2, 2, 64, gen=gen), rand(2, 2, 2, 64, gen=gen)
    angles = torch.rand(300, 16, device="cuda", generator=gen)
    lens = torch.tensor([5, 100], dtype=torch.int32, device="cuda")
    warm_then_forbid(lambda: tileattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=angles.cos(), rotary_sin=angles.sin(), cache_seqlens=lens,
        causal=True))


@pytest.mark.gpu
def test_with_a_paged_kv_cache_helper():
    """A decoding step with PagedKVCache: its tensors (copied from pinned memory) and the call."""
    gen = torch.Generator(device="cuda").manual_seed(86)
    cache = tileattn.PagedKVCache(1, num_blocks=64, block_size=16, nheads_k=8, headdim=128, dtype=torch.bfloat16,
                                  device="cuda")
    ids = [cache.allocate() for _ in range(3)]
    for seq_id, n in zip(ids, (5, 100, 300)):
        cache.reserve([seq_id], n)
        cache.advance([seq_id], n)
    q, k_new = rand(3, 1, 32, 128, gen=gen), rand(3, 1, 8, 128, gen=gen)

    def step():
        cache.reserve(ids, 1)
        table, lens = cache.block_table(ids), cache.seqlens(ids)
        return tileattn.flash_attn_with_kvcache(q, cache.k_cache[0], cache.v_cache[0], k=k_new, v=k_new,
                                                cache_seqlens=lens, block_table=table, causal=True)

    warm_then_forbid(step)


@pytest.mark.gpu
def test_merge_states():
    gen = torch.Generator(device="cuda").manual_seed(87)
    o_a, o_b = rand(2, 5, 4, 64, gen=gen), rand(2, 5, 4, 64, gen=gen)
    lse_a, lse_b = (torch.randn(2, 4, 5, device="cuda", generator=gen) for _ in range(2))
    warm_then_forbid(lambda: (tileattn.merge_states(o_a, lse_a, o_b, lse_b),
                              tileattn.merge_many([o_a, o_b], [lse_a, lse_b])))


@pytest.mark.gpu
def test_debug_checks_name_the_problem(monkeypatch):
    """With TILEATTN_DEBUG_CHECKS=1 the values are read on the host and a bad one gets its message."""
    monkeypatch.setenv("TILEATTN_DEBUG_CHECKS", "1")
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.float16)
    cache = torch.randn(2, 32, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(IndexError, match="cache_seqlens must be within 0..32"):
        tileattn.flash_attn_with_kvcache(q, cache, cache,
                                         cache_seqlens=torch.tensor([3, 40], dtype=torch.int32, device="cuda"))


# ------------------------------------------------------------------ the device checks' logic, on the CPU


@pytest.mark.parametrize("lens,pads,table,ok", [
    ([3, 8], None, None, True),
    ([3, 9], None, None, False),
    ([-1, 2], None, None, False),
    ([3, 6], [0, 6], None, True),
    ([3, 6], [4, 0], None, False),
    ([3, 6], [-1, 0], None, False),
    ([2, 6], None, [[0, 9], [1, 2]], True),  # entry 9 lies past sequence 0's pages: never read
    ([5, 6], None, [[0, 9], [1, 2]], False),
    ([3, 6], None, [[0, 1], [2, -1]], False),
])
def test_device_checks_accept_and_refuse_what_the_host_checks_do(device_checks, lens, pads, table, ok):
    """The cache check is a Triton kernel, which reads CPU tensors only in the interpreter (on where
    there is no GPU); on a GPU host tests/test_checks.py runs it compiled against the same rule and
    test_a_bad_value_on_the_gpu_fails_by_a_device_assertion checks the assertion."""
    from tileattn.gpu._tuning import interpreting

    if not interpreting():
        pytest.skip("the cache check kernel reads CPU tensors only in Triton's interpreter")
    lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, 1, 2, 16)
    new = torch.randn(2, 2, 1, 16)
    if table is None:
        k_cache = torch.zeros(2, 10, 1, 16)
        opts = dict(cache_leftpad=None if pads is None else torch.tensor(pads, dtype=torch.int32))
    else:
        k_cache = torch.zeros(4, 4, 1, 16)
        opts = dict(block_table=torch.tensor(table, dtype=torch.int32))
    call = lambda: tileattn.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k=new, v=new, cache_seqlens=lens,  # noqa: E731
                                                    **opts)
    if ok:
        call()
    else:
        with pytest.raises(RuntimeError, match="tileattn: cache_seqlens"):
            call()


@pytest.mark.parametrize("cu_k,ok", [([0, 3, 8], True), ([0, 5, 3], False), ([1, 3, 8], False), ([0, 3, 7], False),
                                     ([0, 1, 8], False)])
def test_device_checks_of_cu_seqlens(device_checks, cu_k, ok):
    q = torch.randn(8, 2, 16)
    call = lambda: tileattn.flash_attn_varlen_func(  # noqa: E731
        q, q, q, torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 5, 5)
    if ok:
        call()
    else:
        with pytest.raises(RuntimeError, match="tileattn: cu_seqlens_k"):
            call()


# (setup, valid arguments, bad arguments) of flash_attn_with_kvcache per case, as source text; the
# setup makes every tensor (a host-to-device copy under the sync-debug mode would raise)
_BAD_VALUES = {
    # one program: a length past the capacity
    "length": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
               "c = torch.randn(2, 32, 2, 64, device='cuda', dtype=torch.float16)\n"
               "good = torch.tensor([3, 32], dtype=torch.int32, device='cuda')\n"
               "bad = torch.tensor([3, 40], dtype=torch.int32, device='cuda')\n",
               "q, c, c, cache_seqlens=good", "q, c, c, cache_seqlens=bad"),
    # one program: a left pad past its sequence's length
    "leftpad": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                "c = torch.randn(2, 32, 2, 64, device='cuda', dtype=torch.float16)\n"
                "lens = torch.tensor([3, 20], dtype=torch.int32, device='cuda')\n"
                "good = torch.tensor([0, 5], dtype=torch.int32, device='cuda')\n"
                "bad = torch.tensor([0, 21], dtype=torch.int32, device='cuda')\n",
                "q, c, c, cache_seqlens=lens, cache_leftpad=good", "q, c, c, cache_seqlens=lens, cache_leftpad=bad"),
    # the decoding lane's own check (the forward kernel's CHECK_CACHE): a negative length, a length
    # past a paged cache's capacity, a block id past the pool or below 0 in the last page in use of
    # a sequence split across programs
    "negative length": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                        "c = torch.randn(2, 4096, 2, 64, device='cuda', dtype=torch.float16)\n"
                        "good = torch.tensor([3, 4000], dtype=torch.int32, device='cuda')\n"
                        "bad = torch.tensor([-1, 4000], dtype=torch.int32, device='cuda')\n",
                        "q, c, c, cache_seqlens=good", "q, c, c, cache_seqlens=bad"),
    "paged length": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                     "c = torch.randn(64, 16, 2, 64, device='cuda', dtype=torch.float16)\n"
                     "t = torch.arange(64, dtype=torch.int32, device='cuda').view(2, 32)\n"
                     "good = torch.tensor([3, 512], dtype=torch.int32, device='cuda')\n"
                     "bad = torch.tensor([3, 513], dtype=torch.int32, device='cuda')\n",
                     "q, c, c, cache_seqlens=good, block_table=t", "q, c, c, cache_seqlens=bad, block_table=t"),
    "block id, split": ("q = torch.randn(1, 1, 32, 128, device='cuda', dtype=torch.bfloat16)\n"
                        "c = torch.randn(600, 16, 8, 128, device='cuda', dtype=torch.bfloat16)\n"
                        "lens = torch.tensor([8000], dtype=torch.int32, device='cuda')\n"
                        "good = torch.arange(512, dtype=torch.int32, device='cuda').view(1, 512)\n"
                        "bad = good.clone(); bad[0, 499] = 600\n",
                        "q, c, c, cache_seqlens=lens, block_table=good", "q, c, c, cache_seqlens=lens, block_table=bad"),
    "negative block id, split": ("q = torch.randn(1, 1, 32, 128, device='cuda', dtype=torch.bfloat16)\n"
                                 "c = torch.randn(600, 16, 8, 128, device='cuda', dtype=torch.bfloat16)\n"
                                 "lens = torch.tensor([8000], dtype=torch.int32, device='cuda')\n"
                                 "good = torch.arange(512, dtype=torch.int32, device='cuda').view(1, 512)\n"
                                 "bad = good.clone(); bad[0, 3] = -1\n",
                                 "q, c, c, cache_seqlens=lens, block_table=good",
                                 "q, c, c, cache_seqlens=lens, block_table=bad"),
    # the appending lane's own check (the append kernel's CHECK, then the forward kernel's CHECK_CACHE):
    # no room left for the new token, a negative length, a length past the rotary tables' rows, a block
    # id past the pool in the page the append writes, a negative one in a page it only reads
    "append, no room": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                        "c = torch.randn(2, 32, 2, 64, device='cuda', dtype=torch.float16)\n"
                        "n = torch.randn(2, 1, 2, 64, device='cuda', dtype=torch.float16)\n"
                        "good = torch.tensor([3, 31], dtype=torch.int32, device='cuda')\n"
                        "bad = torch.tensor([3, 32], dtype=torch.int32, device='cuda')\n",
                        "q, c, c, k=n, v=n, cache_seqlens=good", "q, c, c, k=n, v=n, cache_seqlens=bad"),
    "append, negative length": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                                "c = torch.randn(2, 32, 2, 64, device='cuda', dtype=torch.float16)\n"
                                "n = torch.randn(2, 1, 2, 64, device='cuda', dtype=torch.float16)\n"
                                "good = torch.tensor([3, 20], dtype=torch.int32, device='cuda')\n"
                                "bad = torch.tensor([-1, 20], dtype=torch.int32, device='cuda')\n",
                                "q, c, c, k=n, v=n, cache_seqlens=good", "q, c, c, k=n, v=n, cache_seqlens=bad"),
    "append rotary, past the tables": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                                       "c = torch.randn(2, 32, 2, 64, device='cuda', dtype=torch.float16)\n"
                                       "n = torch.randn(2, 1, 2, 64, device='cuda', dtype=torch.float16)\n"
                                       "a = torch.rand(20, 32, device='cuda')\n"
                                       "cos, sin = a.cos().half(), a.sin().half()\n"
                                       "good = torch.tensor([3, 19], dtype=torch.int32, device='cuda')\n"
                                       "bad = torch.tensor([3, 20], dtype=torch.int32, device='cuda')\n",
                                       "q, c, c, k=n, v=n, rotary_cos=cos, rotary_sin=sin, cache_seqlens=good",
                                       "q, c, c, k=n, v=n, rotary_cos=cos, rotary_sin=sin, cache_seqlens=bad"),
    "append paged, block id written": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                                       "c = torch.randn(64, 16, 2, 64, device='cuda', dtype=torch.float16)\n"
                                       "n = torch.randn(2, 1, 2, 64, device='cuda', dtype=torch.float16)\n"
                                       "lens = torch.tensor([3, 100], dtype=torch.int32, device='cuda')\n"
                                       "good = torch.arange(64, dtype=torch.int32, device='cuda').view(2, 32)\n"
                                       "bad = good.clone(); bad[1, 6] = 64\n",
                                       "q, c, c, k=n, v=n, cache_seqlens=lens, block_table=good",
                                       "q, c, c, k=n, v=n, cache_seqlens=lens, block_table=bad"),
    "append paged, block id read": ("q = torch.randn(2, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                                    "c = torch.randn(64, 16, 2, 64, device='cuda', dtype=torch.float16)\n"
                                    "n = torch.randn(2, 1, 2, 64, device='cuda', dtype=torch.float16)\n"
                                    "lens = torch.tensor([3, 100], dtype=torch.int32, device='cuda')\n"
                                    "good = torch.arange(64, dtype=torch.int32, device='cuda').view(2, 32)\n"
                                    "bad = good.clone(); bad[1, 2] = -1\n",
                                    "q, c, c, k=n, v=n, cache_seqlens=lens, block_table=good",
                                    "q, c, c, k=n, v=n, cache_seqlens=lens, block_table=bad"),
    # a grid of programs (64 sequences x 256 pages): a block id past the pool in the last rows
    "block table": ("q = torch.randn(64, 1, 4, 64, device='cuda', dtype=torch.float16)\n"
                    "c = torch.randn(300, 16, 2, 64, device='cuda', dtype=torch.float16)\n"
                    "lens = torch.full((64,), 1000, dtype=torch.int32, device='cuda')\n"
                    "good = torch.arange(64 * 256, dtype=torch.int32, device='cuda').view(64, 256) % 300\n"
                    "bad = good.clone(); bad[60, 62] = 300\n",
                    "q, c, c, cache_seqlens=lens, block_table=good", "q, c, c, cache_seqlens=lens, block_table=bad"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(_BAD_VALUES))
def test_a_bad_value_on_the_gpu_fails_by_a_device_assertion(case):
    """In a fresh process (a failed device assertion ends the CUDA context): a bad value in the
    cache's lengths, left pads or block table, no synchronisation in the call, the failure at the
    next synchronisation, raised by the check kernel's own assertion (its message in the output).
    A valid call comes first: a kernel's first launch in a process loads its module, which waits
    for the device (and would report the failed assertion there, inside the call). The call after
    it takes the signature's lane: without left pads the forward kernel asserts itself (its
    ``CHECK_CACHE``, no separate check launched; the script prints which kernels checked), with
    them the check kernel does; with an append, the append kernel (its ``CHECK``) and then the
    forward kernel, each what it writes or reads by. A split lane's forward kernel is the merged one
    (``MERGE_SPLITS``: one launch for the attention; the script prints whether the checking launch merged)."""
    import os
    import subprocess
    import sys

    setup, good, bad = _BAD_VALUES[case]
    script = (
        "import torch, tileattn\n" + setup +
        f"tileattn.flash_attn_with_kvcache({good})\n"
        f"tileattn.flash_attn_with_kvcache({good})\n"  # the lane's first call: its kernels loaded too
        "torch.cuda.synchronize()\n"
        "from tileattn.gpu import _launch, checks\n"
        "def launched():\n"
        "    return (sum(l.fast_calls for l in checks._LAUNCHES.values()),\n"
        "            *(sum(l.fast_calls for l in _launch._LAUNCHES.values() if l.constexprs.get(flag))\n"
        "              for flag in ('CHECK', 'CHECK_CACHE')),\n"
        "            sum(l.fast_calls for l in _launch._LAUNCHES.values()\n"
        "                if l.constexprs.get('CHECK_CACHE') and l.constexprs.get('MERGE_SPLITS')))\n"
        "before = launched()\n"
        "torch.cuda.set_sync_debug_mode('error')\n"
        f"tileattn.flash_attn_with_kvcache({bad})\n"
        "after = launched()\n"
        "names = [name for name, b, a in zip(('check', 'append', 'forward'), before, after) if a > b]\n"
        "print('CHECKED BY', ' + '.join(names) or 'none', flush=True)\n"
        "print('MERGED', 'yes' if after[3] > before[3] else 'no', flush=True)\n"
        "torch.cuda.set_sync_debug_mode('default')\n"
        "print('CALL RETURNED', flush=True)\n"
        "torch.cuda.synchronize()\n"
        "print('NOT REPORTED', flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TILEATTN_DEBUG_CHECKS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "CALL RETURNED" in done.stdout and "NOT REPORTED" not in done.stdout, done.stdout + done.stderr
    assert "device-side assert" in done.stderr, done.stderr[-2000:]
    assert "tileattn: a KV cache's lengths" in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]
    checker = "check" if case == "leftpad" else "append + forward" if case.startswith("append") else "forward"
    assert f"CHECKED BY {checker}\n" in done.stdout, done.stdout
    if case.endswith(", split"):  # the H200's rule splits 8k keys of 8 KV heads: the merged kernel checked
        assert "MERGED yes" in done.stdout, done.stdout


# ------------------------------------------------------------------ the check folded into the decoding launch


_FOLD_BAD = {  # (cache_seqlens, block table or None): each out of range in a value some program reads by
    "length past the capacity": ([5, 13], None),
    "negative length": ([-1, 3], None),
    "largest length": ([5, 2**31 - 1], None),
    "block id past the pool": ([5, 12], [[3, 1, 0], [2, 5, 9]]),
    "negative block id": ([5, 12], [[-2, 1, 0], [2, 5, 8]]),
    "largest paged length": ([5, 2**31 - 1], [[3, 1, 0], [2, 5, 8]]),
}


def _count_check_launches(monkeypatch) -> list:
    """A list that grows by one per launch of the separate cache check (``gpu.checks.CacheCheck``)."""
    from tileattn.gpu import checks

    seen, call = [], checks.CacheCheck.__call__
    monkeypatch.setattr(checks.CacheCheck, "__call__", lambda self, *args: seen.append(1) or call(self, *args))
    return seen


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("paged", [False, True])
def test_the_decoding_lane_checks_the_cache_in_its_own_kernel(device_checks, asserting_interpreter, monkeypatch, paged,
                                                              num_splits):
    """A kept signature's decoding call (no append) launches no separate check: the forward kernel's
    programs assert the values they read by (``CHECK_CACHE``), with the check kernel's message,
    and give the bits the unchecked kernel gave; a bad entry in a page not in use passes."""
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    gen = torch.Generator().manual_seed(88)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    cache = torch.randn(9, 4, 2, 16, generator=gen) if paged else torch.randn(2, 12, 2, 16, generator=gen)
    good_table = torch.tensor([[3, 1, 0], [2, 5, 8]], dtype=torch.int32) if paged else None

    def call(lens, table=good_table):
        return tileattn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                                block_table=table, num_splits=num_splits)

    first = call([5, 12])  # the signature's first call: the separate check, then the lane is prepared
    checks = _count_check_launches(monkeypatch)
    from tileattn.gpu import _launch

    launch, kinds = _launch.Launch.__call__, []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self, *args: kinds.append(
        (self.constexprs.get("CHECK_CACHE"), self.constexprs.get("MERGE_SPLITS"))) or launch(self, *args))
    assert torch.equal(call([5, 12]), first) and not checks
    assert kinds == [(True, num_splits > 1)]  # split: one launch, checked and merged
    if paged:  # entry 9 lies in sequence 1's third page, which 8 keys do not reach
        call([5, 8], torch.tensor([[3, 1, 0], [2, 5, 9]], dtype=torch.int32))
    for name, (lens, table) in _FOLD_BAD.items():
        if (table is None) != (not paged):
            continue
        with pytest.raises(Exception, match="tileattn: a KV cache's lengths"):
            call(lens, None if table is None else torch.tensor(table, dtype=torch.int32))
    assert not checks
    from tileattn.gpu import attention

    attention.clear_plans()  # the lane's plan forgotten (new tiles): the check launched apart, then attn_fwd
    with pytest.raises(Exception, match="tileattn: a KV cache's lengths"):
        call([5, 13] if not paged else [5, 12], None if not paged else torch.tensor([[3, 1, 0], [2, 5, 9]],
                                                                                  dtype=torch.int32))
    assert checks


def test_a_program_that_finds_a_bad_value_reads_no_key(device_checks, monkeypatch):
    """Were the device assertion to return (it traps: ``__assertfail`` is noreturn), the program that
    found the bad value would read no key: its rows come out empty (0, lse -inf), the other
    sequence's as before (the interpreter, whose assertions are off by default, stands for that)."""
    from tileattn.gpu._tuning import interpreting
    from tileattn.ops import _validate

    if not interpreting():
        pytest.skip("Triton's interpreter only")
    monkeypatch.setattr(_validate, "kernel_asserts", lambda t: True)  # the fold taken, its assertion off
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    gen = torch.Generator().manual_seed(89)
    q, cache = torch.randn(2, 1, 4, 16, generator=gen), torch.randn(3, 12, 2, 16, generator=gen)
    kc = cache[:2]  # rows 0 and 1; a length past 12 would read row 1's, then row 2's keys

    def call(lens):
        return tileattn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                                return_softmax_lse=True)

    call([5, 12])
    good_out, good_lse = call([5, 12])
    out, lse = call([5, 30])
    assert torch.equal(out[0], good_out[0]) and torch.equal(lse[0], good_lse[0])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def _folded_launches(flag: str = "CHECK_CACHE") -> int:
    """Launches of a kernel with the cache check folded in (the forward's ``CHECK_CACHE``, the append's
    ``CHECK``), so far, through the fast path (a variant's first launch goes through Triton's path and
    is not counted)."""
    from tileattn.gpu import _launch

    return sum(launch.fast_calls for launch in _launch._LAUNCHES.values() if launch.constexprs.get(flag))


_FOLD_LAYOUTS = {  # name: (batch, page size or 0, num_splits)
    "contiguous, split as the rule says": (1, 0, 0),
    "contiguous, batch 3, unsplit": (3, 0, 1),
    "paged 16, split as the rule says": (1, 16, 0),
    "paged 16, batch 3, 5 splits": (3, 16, 5),
    "paged 64, batch 3, split as the rule says": (3, 64, 0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(_FOLD_LAYOUTS))
def test_the_folded_check_gives_the_same_bits_eager_and_replayed(layout, monkeypatch):
    """The decoding lane with the check folded in (the default on CUDA tensors) against the same
    lane without any check (TILEATTN_DEBUG_CHECKS=0): eager, bitwise; replayed from a CUDA graph as
    captured by default (no value check during capture) and with the folded kernel captured (value
    checks forced on during the capture), bitwise one against the other. The eager split calls merge
    in their launch and the captured ones launch the combine: those agree to rounding."""
    from tileattn.gpu import _launch
    from tileattn.ops import _validate

    folded, launch = [], _launch.Launch.__call__  # each launch of a forward kernel with the check folded in

    def counted(self, *args):  # its first launch (through Triton's path) too, which fast_calls leaves out
        if self.constexprs.get("CHECK_CACHE"):
            folded.append(1)
        return launch(self, *args)

    monkeypatch.setattr(_launch.Launch, "__call__", counted)
    batch, page, splits = _FOLD_LAYOUTS[layout]
    gen = torch.Generator(device="cuda").manual_seed(90)
    q = rand(batch, 1, 32, 128, gen=gen)
    lens = torch.tensor([8000, 17, 4096][:batch], dtype=torch.int32, device="cuda")
    if page:
        blocks = 8192 // page
        k_cache, v_cache = rand(batch * blocks + 7, page, 8, 128, gen=gen), rand(batch * blocks + 7, page, 8, 128, gen=gen)
        table = torch.randperm(batch * blocks + 7, device="cuda", generator=gen)[:batch * blocks]
        table = table.view(batch, blocks).to(torch.int32)
    else:
        k_cache, v_cache, table = rand(batch, 8192, 8, 128, gen=gen), rand(batch, 8192, 8, 128, gen=gen), None

    def call():
        return tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                num_splits=splits, return_softmax_lse=True)

    monkeypatch.setenv("TILEATTN_DEBUG_CHECKS", "0")
    call()
    plain = call()  # the lane, unchecked
    monkeypatch.delenv("TILEATTN_DEBUG_CHECKS")
    call()
    before = len(folded)
    checked = call()
    assert len(folded) == before + 1
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(checked, plain))

    replayed = {}
    for force in (False, True):
        if force:
            monkeypatch.setattr(_validate, "value_mode", lambda t: "device")
        before = len(folded)
        graph, _, static = captured(call)
        # the warm-up call's launch (merged when split), then the capture's (split: the unmerged kernel's
        # first launch, which Launch.fast_calls would not count)
        assert len(folded) == before + force + 1
        graph.replay()
        torch.cuda.synchronize()
        replayed[force] = static
        for name, a, b in zip(("out", "lse"), static, plain):  # captured: two launches; eager: merged if split
            assert_same_to_rounding(f"captured {'folded' if force else 'plain'} {name}", a, b)
    assert all(torch.equal(a, b) for a, b in zip(*replayed.values())), "captured folded != captured plain"


# ------------------------------------------------------------------ the check folded into the appending lane


_APPEND_LAYOUTS = {  # name: (batch, page size or 0, rotary)
    "contiguous": (1, 0, False),
    "contiguous, batch 3, rotary": (3, 0, True),
    "paged 16": (1, 16, False),
    "paged 16, batch 3, rotary": (3, 16, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(_APPEND_LAYOUTS))
def test_the_folded_append_gives_the_same_bits_eager_and_replayed(layout, monkeypatch):
    """The appending lane with the check folded into its two launches (the default on CUDA tensors)
    against the same lane without any check (TILEATTN_DEBUG_CHECKS=0), outputs and caches: eager,
    bitwise; replayed from a CUDA graph as captured by default (no value check during capture) and
    with the checked kernels captured (value checks forced on during the capture), bitwise one against
    the other; eager (split calls merged in their launch) against captured (the combine launched) to
    rounding, the caches bitwise. Every call appends the same token at the same lengths, so every
    cache ends alike."""
    from tileattn.ops import _validate

    batch, page, rotary = _APPEND_LAYOUTS[layout]
    gen = torch.Generator(device="cuda").manual_seed(94)
    q, k_new, v_new = rand(batch, 1, 32, 128, gen=gen), rand(batch, 1, 8, 128, gen=gen), rand(batch, 1, 8, 128, gen=gen)
    lens = torch.tensor([8000, 17, 4096][:batch], dtype=torch.int32, device="cuda")
    angles = torch.rand(8192, 64, device="cuda", generator=gen)
    rope = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin()) if rotary else {}
    if page:
        blocks = 8192 // page
        caches = (rand(batch * blocks + 7, page, 8, 128, gen=gen), rand(batch * blocks + 7, page, 8, 128, gen=gen))
        table = torch.randperm(batch * blocks + 7, device="cuda", generator=gen)[:batch * blocks]
        table = table.view(batch, blocks).to(torch.int32)
    else:
        caches, table = (rand(batch, 8192, 8, 128, gen=gen), rand(batch, 8192, 8, 128, gen=gen)), None

    def on(kv):
        return lambda: tileattn.flash_attn_with_kvcache(q, *kv, k=k_new, v=v_new, **rope, cache_seqlens=lens,
                                                        block_table=table, causal=True, return_softmax_lse=True)

    monkeypatch.setenv("TILEATTN_DEBUG_CHECKS", "0")
    plain_kv = tuple(c.clone() for c in caches)
    on(plain_kv)()
    plain = on(plain_kv)()  # the lane, unchecked
    monkeypatch.delenv("TILEATTN_DEBUG_CHECKS")
    folded_kv = tuple(c.clone() for c in caches)
    on(folded_kv)()  # the checked kernels' first launches compile them through Triton's path (not counted)
    before = _folded_launches("CHECK"), _folded_launches()
    folded = on(folded_kv)()
    assert (_folded_launches("CHECK"), _folded_launches()) == (before[0] + 1, before[1] + 1)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(folded, plain))
    assert all(torch.equal(a, b) for a, b in zip(folded_kv, plain_kv))

    replayed = {}
    for force in (False, True):
        if force:
            monkeypatch.setattr(_validate, "value_mode", lambda t: "device")
        graph_kv = tuple(c.clone() for c in caches)
        before = _folded_launches("CHECK")
        graph, _, static = captured(on(graph_kv))
        assert _folded_launches("CHECK") == before + force + 1  # the warm-up call's launch, then the capture's
        graph.replay()
        torch.cuda.synchronize()
        replayed[force] = static
        for name, a, b in zip(("out", "lse"), static, plain):  # captured: two launches; eager: merged if split
            assert_same_to_rounding(f"captured {'folded' if force else 'plain'} {name}", a, b)
        assert all(torch.equal(a, b) for a, b in zip(graph_kv, plain_kv)), f"captured {'folded' if force else 'plain'}"
    assert all(torch.equal(a, b) for a, b in zip(*replayed.values())), "captured folded != captured plain"
