"""Compile the Triton kernels for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter runs the kernels' arithmetic but not the compiler, so code that only the
compiler rejects (a global a jit function may not read, a type the backend refuses) or that
needs more shared memory than an H100/H200 block has would pass CI and fail on the GPU.
This script drives the real launchers of ``tileattn.gpu`` (the Gluon forward for Hopper
included, which has no interpreter at all) over a matrix of features, records
every kernel launch instead of running it, and compiles each recorded launch, for every tile
configuration the autotuner could pick, to a Hopper cubin with the ptxas that Triton ships.

Each line also gives the registers per thread and the local-memory stack (register spills)
that ptxas reports: a cheap first look at a kernel's cost before any GPU time is spent. The
forward's wide tile (head dims above 256, MLA's absorbed decoding) was chosen as the largest that
compiles without spills: a 16-bit wide variant, or the combine after one, that spills fails here.
Each split decode launch whose plan has a merged form (``FwdPlan.merged``, the eager lane's: its
last split programs merge the splits, ``MERGE_SPLITS``) is compiled in that form too, with and
without the folded cache check; a merged or checked variant that spills where the plain launch
(neither) does not fails.

Run without ``TRITON_INTERPRET`` (``tests/test_hopper_compile.py`` starts it so):

    python tests/hopper_compile.py          # prints one line per compiled variant, exit 1 on failure
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TILEATTN_AUTOTUNE"] = "0"  # launch one config; this script compiles all of them

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tileattn.contract import AttnParams  # noqa: E402
from tileattn.gpu import attention as fwd_launcher  # noqa: E402
from tileattn.gpu import checks as check_launcher  # noqa: E402
from tileattn.gpu import combine as combine_launcher  # noqa: E402
from tileattn.gpu import backward as bwd_launcher  # noqa: E402
from tileattn.gpu import hopper as hopper_launcher  # noqa: E402
from tileattn.gpu import hopper_bwd as hopper_bwd_launcher  # noqa: E402
from tileattn.gpu import kvcache as append_launcher  # noqa: E402
from tileattn.gpu import hopper_fp8 as hopper_fp8_launcher  # noqa: E402
from tileattn.kernels import attn_bwd_hopper, attn_fwd_hopper, decode_fp8_hopper  # noqa: E402

# the cases' short sequences take the Gluon backward's dQ reductions too (the deterministic cases
# compile its two-launch form)
hopper_bwd_launcher.REDUCE_MIN_ROWS = 0

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
# The persistent Gluon forward keeps a few per-work-item scalars (strides, offsets) in local
# memory: 24-72 bytes, reloaded once per item, never in the loop over key tiles. A spill of the
# tile loop's accumulators would take hundreds of bytes.
GLUON_STACK_LIMIT = 128
_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
        torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv", torch.bool: "*i1"}


class Recorder:
    """Stands in for a jit kernel: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, fn, launches):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))

    def __getattr__(self, name):  # arg_names, params, do_not_specialize: the launchers read them
        return getattr(self.fn, name)


def compile_launch(fn, args, kwargs):
    """Compile one recorded launch for Hopper, specialised as a real launch would be (pointers
    16-byte aligned, integers equal to 1 folded, integers divisible by 16 marked so)."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "debug", "sanitize_overflow") if k in kwargs}
    parameters = inspect.signature(fn.fn).parameters
    names = list(parameters)
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    bound = {**defaults, **dict(zip(names, args)), **kwargs}
    signature, constexprs, attrs = {}, {}, {}
    aligned = [["tt.divisibility", 16]]
    for i, (name, param) in enumerate(zip(names, fn.params)):
        value = bound[name]
        if param.is_constexpr or value is None:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = _PTR[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[name], constexprs[(i,)] = "constexpr", 1
                continue
            signature[name] = "i64" if not -2**31 <= value < 2**31 else "i32"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = aligned
        else:
            signature[name] = "fp32"
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=HOPPER,
                          options=options)


def wgmma_serialised(compiled) -> bool:
    """True when ptxas made every wgmma wait for the previous one (each HGMMA carries the
    scoreboard wait ``gsb0``): what it does, with only a warning Triton hides, when the
    accumulators do not fit in the registers the pipeline needs."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
    return bool(hgmma) and all("gsb0" in line for line in hgmma)


SASS_OPS = ("LDS", "LDSM", "STS", "SHFL", "PRMT", "F2FP", "HGMMA", "BAR")


def sass_counts(compiled) -> tuple[dict, int]:
    """({op: count} over ``SASS_OPS``, all instructions) of the cubin's SASS (cuobjdump, whole kernel)."""
    import collections

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)",
                                                                sass))
    return {k: ops[k] for k in SASS_OPS}, sum(ops.values())


def registers(compiled) -> str:
    """'REG:n STACK:bytes' of the cubin, read by the cuobjdump that Triton ships (spills show as STACK)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return f"regs={found.group(1)} stack={found.group(2)}" if found else "regs=?"


def forward_cases():
    """(name, launcher kwargs) covering every feature flag of the forward kernel at least once."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    cases = []
    for dtype, d in ((torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256), (torch.float32, 40),
                     (torch.float32, 256)):
        q, k, v = t(2, 300, 8, d, dtype=dtype), t(2, 300, 2, d, dtype=dtype), t(2, 300, 2, d, dtype=dtype)
        cases.append((f"dense causal {dtype} d{d}", q, k, v, dict(params=AttnParams(d**-0.5, -1, 0))))
    q, k, v = t(2, 300, 8, 192), t(2, 300, 8, 192), t(2, 300, 8, 128)  # MLA training: v's own head dim
    cases.append(("dense causal bf16 d192 v128", q, k, v, dict(params=AttnParams(192**-0.5, -1, 0))))
    q, k, v = t(500, 8, 96), t(600, 4, 96), t(600, 4, 96)
    cu_q = torch.tensor([0, 200, 500], dtype=torch.int32)
    cu_k = torch.tensor([0, 250, 600], dtype=torch.int32)
    sink = torch.randn(8, generator=g)
    for cap, form in ((30.0, "cheap"), (1e3, "precise")):  # the two forms of tanh (gpu._tuning.softcap_form)
        cases.append((f"varlen window softcap alibi dropout sink {form}", q, k, v, dict(
            params=AttnParams(0.1, 64, 16, cap, 0.1, 7), alibi_slopes=torch.rand(2, 8),
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=350, learnable_sink=sink)))
    q, k, v = t(2, 300, 8, 128), t(2, 300, 8, 128), t(2, 300, 8, 128)  # Gemma 2's: causal, window, softcap
    for cap, form in ((50.0, "cheap"), (1e3, "precise")):
        cases.append((f"dense causal window softcap {form} bf16 d128", q, k, v,
                      dict(params=AttnParams(128**-0.5, 64, 0, cap))))
    for page in (16, 256):
        pool = t(64, page, 8, 128)
        table = torch.randperm(64, generator=g)[:32].view(4, 8).to(torch.int32)
        sink = torch.randn(32, generator=g) if page == 16 else None  # the sink merged by the combine
        cases.append((f"paged decode page {page} GQA split{' sink' if page == 16 else ''}", t(4, 1, 32, 128), pool,
                      pool.clone(), dict(params=AttnParams(128**-0.5, -1, 0),
                                         seqused_k=torch.tensor([5, 60, 100, 128], dtype=torch.int32),
                                         block_table=table, max_seqlen_q=1, max_seqlen_k=8 * page, num_splits=4,
                                         learnable_sink=sink)))
    cache = t(2 * 64, 2, 128)  # cache_leftpad: a contiguous cache read as packed keys from each row's pad
    cases.append(("cache_leftpad: packed keys, seqused_k, GQA split", t(2, 8, 128), cache, cache.clone(), dict(
        params=AttnParams(128**-0.5, -1, 0), cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([3, 74, 128], dtype=torch.int32), seqused_k=torch.tensor([20, 30], dtype=torch.int32),
        max_seqlen_q=1, max_seqlen_k=64, num_splits=3)))
    for dtype, splits in ((torch.float16, 1), (torch.float32, 3)):  # contiguous cache, hdim 256, MQA
        cache = t(2, 512, 1, 256, dtype=dtype)
        sink = torch.randn(16, generator=g) if splits == 1 else None  # the sink in the decode kernel's epilogue
        cases.append((f"decode {dtype} d256 MQA splits {splits}{' sink' if sink is not None else ''}",
                      t(2, 2, 16, 256, dtype=dtype), cache, cache.clone(),
                      dict(params=AttnParams(256**-0.5, -1, 0), seqused_k=torch.tensor([3, 512], dtype=torch.int32),
                           max_seqlen_q=2, max_seqlen_k=512, num_splits=splits, learnable_sink=sink)))
    # the decoding step docs/perf-notes.md times on the H200 (batch 1, GQA 32/8, hdim 128, 8k keys),
    # with the split counts the rule gives there: 16 (contiguous, one wave), 33 (blocks of 16, two)
    for page, splits in ((0, 16), (16, 33)):
        cache = t(512, 16, 8, 128) if page else t(1, 8192, 8, 128)
        paged = dict(block_table=torch.arange(512, dtype=torch.int32).view(1, 512)) if page else {}
        cases.append((f"decode 8k GQA 32/8 {'paged 16' if page else 'contiguous'} {splits} splits", t(1, 1, 32, 128),
                      cache, cache.clone(), dict(params=AttnParams(128**-0.5, -1, 0), max_seqlen_q=1,
                                                 seqused_k=torch.tensor([8000], dtype=torch.int32),
                                                 max_seqlen_k=8192, num_splits=splits, **paged)))
    # serving: a mixed batch over a paged pool in one call (decode tile split, prefill tile not,
    # the combine skipping the long rows), and an FP8 pool
    pool = t(64, 16, 8, 128)
    table = torch.randperm(64, generator=g)[:48].view(4, 12).to(torch.int32)
    cases.append(("mixed batch paged varlen GQA split", t(69, 32, 128), pool, pool.clone(), dict(
        params=AttnParams(128**-0.5, -1, 0), cu_seqlens_q=torch.tensor([0, 1, 5, 69, 69], dtype=torch.int32),
        block_table=table, seqused_k=torch.tensor([100, 40, 190, 7], dtype=torch.int32), max_seqlen_q=64,
        max_seqlen_k=192, num_splits=3)))
    fp8 = pool.to(torch.float8_e4m3fn)
    cases.append(("fp8 paged decode GQA split", t(4, 1, 32, 128), fp8, fp8.clone(), dict(
        params=AttnParams(128**-0.5, -1, 0), seqused_k=torch.tensor([5, 60, 100, 192], dtype=torch.int32),
        block_table=table, max_seqlen_q=1, max_seqlen_k=192, num_splits=4, k_descale=torch.rand(4, 8),
        v_descale=torch.rand(4, 8))))
    return cases + mla_cases(t, g)


def mla_cases(t, g):
    """Head dims above 256 (the wide tile): MLA's absorbed decoding, one latent of 576 per token whose
    first 512 are the values (v a view of k: V_IS_K), paged in FlashMLA's blocks of 64 or contiguous,
    128 heads over one (PACK_GQA, two 64-row programs) or 16 (the 4-warp tile), split or not; a
    separate v of 512; an FP8 latent; tails other than 64; a causal prefill."""
    cases = []
    pool = t(64, 64, 1, 576)
    table = torch.randperm(64, generator=g)[:32].view(4, 8).to(torch.int32)
    used = torch.tensor([5, 60, 300, 512], dtype=torch.int32)
    for heads, splits in ((128, 3), (128, 1), (16, 2)):
        cases.append((f"MLA decode paged 64 latent h{heads} splits {splits}", t(4, 1, heads, 576), pool,
                      pool[..., :512], dict(params=AttnParams(576**-0.5, -1, 0), seqused_k=used, block_table=table,
                                            max_seqlen_q=1, max_seqlen_k=512, num_splits=splits)))
    cache = t(2, 256, 1, 576, dtype=torch.float16)  # contiguous, fp16, two queries (speculative)
    cases.append(("MLA decode contiguous latent fp16 sq2", t(2, 2, 128, 576, dtype=torch.float16), cache,
                  cache[..., :512], dict(params=AttnParams(576**-0.5, -1, 0),
                                         seqused_k=torch.tensor([3, 256], dtype=torch.int32), max_seqlen_q=2,
                                         max_seqlen_k=256, num_splits=2)))
    cases.append(("MLA decode paged 64 separate v512 h128 split", t(4, 1, 128, 576), pool, t(64, 64, 1, 512),
                  dict(params=AttnParams(576**-0.5, -1, 0), seqused_k=used, block_table=table, max_seqlen_q=1,
                       max_seqlen_k=512, num_splits=3)))
    fp8 = pool.to(torch.float8_e4m3fn)
    descale = torch.rand(4, 1)
    cases.append(("MLA decode fp8 latent paged 64 h128 split", t(4, 1, 128, 576), fp8, fp8[..., :512], dict(
        params=AttnParams(576**-0.5, -1, 0), seqused_k=used, block_table=table, max_seqlen_q=1, max_seqlen_k=512,
        num_splits=3, k_descale=descale, v_descale=descale)))
    for d, dv, heads in ((320, 256, 32), (384, 64, 16)):  # tails of 64 and 128 (256 + 64, 256 + 128)
        kc = t(2, 256, 1, d)
        cases.append((f"wide decode d{d} v{dv} h{heads}", t(2, 1, heads, d), kc, kc[..., :dv] if dv == 256 else
                      t(2, 256, 1, dv), dict(params=AttnParams(d**-0.5, -1, 0), num_splits=2)))
    q = t(69, 16, 576)  # a mixed batch: decoding rows split, a long sequence's rows (8 warps) not
    cases.append(("MLA mixed batch paged varlen h16 split", q, pool, pool[..., :512], dict(
        params=AttnParams(576**-0.5, -1, 0), cu_seqlens_q=torch.tensor([0, 1, 5, 69, 69], dtype=torch.int32),
        block_table=table, seqused_k=torch.tensor([100, 40, 190, 7], dtype=torch.int32), max_seqlen_q=64,
        max_seqlen_k=512, num_splits=3)))
    lat = t(2, 300, 1, 576)
    cases.append(("MLA prefill causal latent h8", t(2, 300, 8, 576), lat, lat[..., :512],
                  dict(params=AttnParams(576**-0.5, -1, 0))))
    return cases


def backward_cases():
    g = torch.Generator().manual_seed(1)

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    cases = []
    for dtype, d, params in ((torch.bfloat16, 128, AttnParams(128**-0.5, -1, 0)),
                             (torch.float16, 64, AttnParams(0.125, 32, 0, 20.0, 0.1, 3)),
                             (torch.bfloat16, 256, AttnParams(256**-0.5)),
                             (torch.float32, 80, AttnParams(80**-0.5, -1, 0)),
                             (torch.float32, 256, AttnParams(256**-0.5))):
        q, k, v = t(2, 300, 8, d, dtype=dtype), t(2, 300, 4, d, dtype=dtype), t(2, 300, 4, d, dtype=dtype)
        out, dout = t(2, 300, 8, d, dtype=dtype), t(2, 300, 8, d, dtype=dtype)
        lse = torch.randn(2, 8, 300, generator=g)
        cases.append((f"bwd {dtype} d{d}", (dout, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k),
                                           torch.empty_like(v)), dict(params=params)))
    q, k, v = t(2, 300, 8, 192), t(2, 300, 8, 192), t(2, 300, 8, 128)  # MLA training: v's own head dim
    out, dout = t(2, 300, 8, 128), t(2, 300, 8, 128)
    cases.append(("bwd bf16 d192 v128", (dout, q, k, v, out, torch.randn(2, 8, 300, generator=g), torch.empty_like(q),
                                         torch.empty_like(k), torch.empty_like(v)),
                  dict(params=AttnParams(192**-0.5, -1, 0))))
    # packed sequences with ALiBi, GQA 3:1, softcap, dropout, a two-sided window, dlse and sinks
    q, k, v = t(500, 6, 96), t(600, 2, 96), t(600, 2, 96)
    out, dout = t(500, 6, 96), t(500, 6, 96)
    lse, alibi = torch.randn(6, 500, generator=g), torch.rand(2, 6)
    dlse, sink = torch.randn(6, 500, generator=g), torch.randn(6, generator=g)
    for cap, form in ((15.0, "cheap"), (1e3, "precise")):  # the two forms of tanh (gpu._tuning.softcap_form)
        cases.append((f"bwd varlen alibi softcap dropout dlse sink {form}",
                      (dout, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
                      dict(params=AttnParams(0.1, 40, 8, cap, 0.2, 5), alibi_slopes=alibi,
                           cu_seqlens_q=torch.tensor([0, 200, 500], dtype=torch.int32),
                           cu_seqlens_k=torch.tensor([0, 250, 600], dtype=torch.int32), max_seqlen_q=300,
                           max_seqlen_k=350, dlse=dlse, learnable_sink=sink, dsink=torch.empty(6))))
    q, k, v, out, dout = (t(2, 300, 8, 128) for _ in range(5))  # Gemma 2's: causal, window, softcap
    lse = torch.randn(2, 8, 300, generator=g)
    for cap, form in ((50.0, "cheap"), (1e3, "precise")):
        cases.append((f"bwd causal window softcap {form} bf16 d128",
                      (dout, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
                      dict(params=AttnParams(128**-0.5, 64, 0, cap))))
    return cases


def append_cases():
    """The KV-cache append: contiguous and paged, with rotary (both pairings, q rotated) or without
    (writing the new lengths, as the ops layer's decoding lane does)."""
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(4, 2, 8, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(4, 2, 32, 128, generator=g).to(torch.bfloat16)
    lens = torch.tensor([0, 5, 60, 100], dtype=torch.int32)
    angles = torch.rand(256, 32, generator=g)
    pool = torch.randn(64, 16, 8, 128, generator=g).to(torch.bfloat16)
    table = torch.randperm(64, generator=g)[:32].view(4, 8).to(torch.int32)
    cache = torch.randn(4, 128, 8, 128, generator=g).to(torch.bfloat16)
    return [("append contiguous", (cache, cache.clone(), k, v, lens), dict(seqused_out=lens.clone())),
            ("append paged", (pool, pool.clone(), k, v, lens, table), dict(seqused_out=lens.clone())),
            ("append paged rotary interleaved", (pool, pool.clone(), k, v, lens, table),
             dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), interleaved=True, q=q)),
            ("append paged fp8 rotary", (pool.to(torch.float8_e4m3fn), pool.to(torch.float8_e4m3fn), k, v, lens, table),
             dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), q=q, k_descale=torch.rand(4, 8),
                  v_descale=torch.rand(4, 8))),
            ("append contiguous rotary neox fp32", (cache.float(), cache.float(), k.float(), v.float(), lens),
             dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), interleaved=False, q=q.float(),
                  q_per_token=False))]


def record(fn, *args, **kwargs):
    """The launches ``fn(*args, **kwargs)`` makes; a backward dK/dV or dQ launch once per tile
    config it could get (the forward's prefill launches are expanded by ``forward_variants``)."""
    launches = []
    names = {fwd_launcher: ("_attn_fwd_kernel",), combine_launcher: ("_combine_kernel",),
             bwd_launcher: ("_attn_bwd_preprocess", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"),
             append_launcher: ("_append_kv_kernel",)}
    originals = {(module, name): getattr(module, name) for module, group in names.items() for name in group}
    plan_caches = (fwd_launcher, bwd_launcher, append_launcher)
    try:
        for (module, name), kernel in originals.items():
            setattr(module, name, Recorder(kernel, launches))
        for module in plan_caches:  # plans made now launch the recorders
            module.clear_plans()
        fn(*args, **kwargs)
        launches += merged_launches(launches)
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)
        for module in plan_caches:
            module.clear_plans()
    expanded = []
    for kernel, args, meta in launches:
        kind = {originals[bwd_launcher, "_attn_bwd_dkdv_kernel"]: "dkdv",
                originals[bwd_launcher, "_attn_bwd_dq_kernel"]: "dq"}.get(kernel)
        if kind is None:
            expanded.append((kernel, args, meta))
            continue
        width = max(meta["HEAD_DIM_PAD"], meta["HEAD_DIM_V_PAD"])  # the configs of the wider of q/k and v
        for cfg in bwd_launcher._configs(kind, (width,), args[0].element_size()):  # the pruned set
            expanded.append((kernel, args, {**meta, **cfg.kwargs, "num_warps": cfg.num_warps,
                                            "num_stages": cfg.num_stages}))
    return expanded


def merged_launches(launches) -> list:
    """The merged form (``FwdPlan.merged``) of each recorded split launch whose plan has one: its
    arguments with the outputs (dtypes as the plan's merged signature names them) and counters in
    their places, the merged launch's constexprs and options."""
    merged = []
    for plan in (p for p in fwd_launcher._PLANS.values() if p.merged is not None):
        outputs = [torch.empty(16, dtype=dtype) for dtype in plan._merged_signature[0][5:8]]
        merged += [(fn, (*args[:5], *outputs, *args[8:]), {**plan.merged.constexprs, **plan.merged.options})
                   for fn, args, kwargs in launches if kwargs == {**plan.fwd.constexprs, **plan.fwd.options}][:1]
    return merged


def forward_variants(launches, q):
    """Each prefill launch once per config the autotuner keeps; decode and combine launches as made."""
    for fn, args, kwargs in launches:
        if fn is fwd_launcher._attn_fwd_kernel and kwargs.get("BLOCK_M", 0) >= 64 and not wide(kwargs):
            configs = fwd_launcher._prune_configs(fwd_launcher._prefill_configs(), {"Q": q},
                                                  HEAD_DIM_PAD=kwargs["HEAD_DIM_PAD"],
                                                  HEAD_DIM_V_PAD=kwargs["HEAD_DIM_V_PAD"])
            for cfg in configs:
                yield fn, args, {**kwargs, **cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        else:
            yield fn, args, kwargs


def checked_variants(todo):
    """The launches the cache's value check is folded into, each again as its checking launch compiles
    it, with Triton's ``debug`` option and ``sanitize_overflow`` off: the forward over a KV cache
    (``FwdPlan.checking_launch``: ``seqused_k``, not packed, no left window) with ``CHECK_CACHE``, and
    every append (``AppendPlan.checking``) with ``CHECK``."""
    for name, fn, args, kwargs in todo:
        if (fn is fwd_launcher._attn_fwd_kernel and kwargs["HAS_SEQUSED_K"] and not kwargs["IS_VARLEN"]
                and not kwargs["MASK_LEFT"]):
            yield name, fn, args, dict(kwargs, CHECK_CACHE=True, CHECK_BLOCK_P=32 * kwargs["num_warps"], debug=True,
                                       sanitize_overflow=False)
        elif fn is append_launcher._append_kv_kernel:
            yield name, fn, args, dict(kwargs, CHECK=True, debug=True, sanitize_overflow=False)


def checked(kwargs) -> bool:
    """Whether a launch has the cache's value check folded in (``checked_variants``)."""
    return bool(kwargs.get("CHECK_CACHE") or kwargs.get("CHECK"))


def wide(meta) -> bool:
    """Whether a forward launch takes the wide tile (fixed, never autotuned)."""
    return fwd_launcher.is_wide(meta["HEAD_DIM_PAD"], meta.get("HEAD_DIM_TAIL_PAD", 0), meta["HEAD_DIM_V_PAD"])


def must_not_spill(fn, meta) -> bool:
    """The wide tile's 16-bit variants and the combines after them: chosen to compile without spills."""
    if fn is combine_launcher._combine_kernel:
        return meta["HEAD_DIM_PAD"] > fwd_launcher.TAIL_ABOVE
    return fn is fwd_launcher._attn_fwd_kernel and wide(meta) and meta["DOT_DTYPE"] != triton.language.float32


def hopper_cases():
    """The Gluon forward through its launcher: every head dim and 16-bit dtype, each mask flag,
    dense (the output through TMA copies at ``TMA_STORE_HEAD_DIMS``) and packed, GQA, learnable
    sinks, and dense causal calls on the dynamic schedule (``DYNAMIC``)."""
    g = torch.Generator().manual_seed(2)
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in hopper_launcher.HOPPER_TILES:
            for left, right, varlen in ((-1, -1, False), (-1, 0, False), (64, 0, False), (-1, 0, True)):
                shape_q, shape_k = ((600, 8), (700, 2)) if varlen else ((2, 300, 8), (2, 350, 2))
                q = torch.randn(*shape_q, d, generator=g).to(dtype)
                k, v = (torch.randn(*shape_k, d, generator=g).to(dtype) for _ in range(2))
                lse = torch.empty((8, 600) if varlen else (2, 8, 300))
                kwargs = dict(params=AttnParams(d**-0.5, left, right))
                if varlen:
                    kwargs.update(cu_seqlens_q=torch.tensor([0, 250, 600], dtype=torch.int32),
                                  cu_seqlens_k=torch.tensor([0, 300, 700], dtype=torch.int32), max_seqlen_q=350,
                                  max_seqlen_k=400)
                if left >= 0 or varlen:  # gpt-oss: sliding-window layers with learnable sinks
                    kwargs.update(learnable_sink=torch.randn(8, generator=g))
                name = (f"hopper {dtype} d{d} window ({left}, {right}){' varlen' if varlen else ''}"
                        f"{' sink' if 'learnable_sink' in kwargs else ''}")
                cases.append((name, (q, k, v, torch.empty_like(q), lse), kwargs))
    # the dynamic schedule (DYNAMIC): dense causal, 9 query blocks x 16 pairs = 144 items over the 132
    # programs the launcher assumes off the GPU, groups of 16 pairs; GQA 4; sinks at head dim 128
    for d in hopper_launcher.HOPPER_TILES:
        q = torch.randn(2, 1100, 8, d, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(2, 1100, 2, d, generator=g).to(torch.bfloat16) for _ in range(2))
        kwargs = dict(params=AttnParams(d**-0.5, -1, 0))
        if d == 128:
            kwargs.update(learnable_sink=torch.randn(8, generator=g))
        cases.append((f"hopper torch.bfloat16 d{d} causal dynamic{' sink' if d == 128 else ''}",
                      (q, k, v, torch.empty_like(q), torch.empty(2, 8, 1100)), kwargs))
    return cases


def hopper_partials_cases():
    """The Gluon forward's split partials over a paged pool (a cascade's prefix): 16- and
    256-key pages, the query heads of a KV head packed as rows (GQA 4 and MQA 8), each head dim."""
    g = torch.Generator().manual_seed(4)
    cases = []
    for d in hopper_launcher.HOPPER_TILES:
        for page, group in ((16, 4), (256, 8)):
            q = torch.randn(1, 64, 8, d, generator=g).to(torch.bfloat16)
            pool = torch.randn(40, page, 8 // group, d, generator=g).to(torch.bfloat16)
            table = torch.randperm(40, generator=g)[:32].view(1, 32).to(torch.int32)
            splits = 4
            o_parts, lse_parts = torch.empty(splits + 1, 1, 64, 8, d), torch.empty(splits + 1, 1, 8, 64)
            cases.append((f"hopper partials d{d} page {page} GQA {group}", (q, pool, pool, o_parts[:-1], lse_parts[:-1]),
                          dict(params=AttnParams(d**-0.5), block_table=table,
                               seqused_k=torch.tensor([32 * page - 5], dtype=torch.int32), max_seqlen_k=32 * page)))
    return cases


def fp8_decode(q, k, v, out, lse, params, block_table, seqused_k, num_splits, k_descale, v_descale):
    """The Gluon FP8 decode's launch for this call (``Fp8DecodePlan``, whose rule needs an H200)."""
    plan = hopper_fp8_launcher.Fp8DecodePlan(q, k, out, lse, params, block_table=block_table, seqused_k=seqused_k,
                                             max_seqlen_k=0, num_splits=num_splits, fallback=None)
    plan.fwd(k, v, q, *plan.new_workspace("cpu"), k_descale, v_descale, seqused_k, block_table)


def hopper_fp8_cases():
    """The Gluon FP8 decode (#19): serving.py's fp8 row (paged 16, GQA 32/8, bf16 q), pages of 256 with
    GQA 8, a contiguous cache without GQA, speculative rows (causal, 2 rows x GQA 4) with fp16 q, and
    serving.py's row again with 2,048 keys a sequence: the others' splits hold one key tile each, an
    integer argument of 1 that Triton specialises, so their kernels have no key-tile loop; this one's
    two splits of 8 tiles compile the loop that real calls run."""
    g = torch.Generator().manual_seed(19)
    cases = []
    for name, page, sq, nheads, dtype, splits, pages in (
            ("paged 16 GQA 4", 16, 1, 32, torch.bfloat16, 0, 8),
            ("paged 256 GQA 8", 256, 1, 64, torch.bfloat16, 3, 8),
            ("contiguous GQA 1", 0, 1, 8, torch.bfloat16, 1, 8),
            ("paged 16 speculative 2 rows causal GQA 4 fp16", 16, 2, 32, torch.float16, 0, 8),
            ("paged 16 GQA 4 2k keys", 16, 1, 32, torch.bfloat16, 0, 128)):
        q = torch.randn(4, sq, nheads, 128, generator=g).to(dtype)
        if page:
            k = torch.randn(8 * pages, page, 8, 128, generator=g).to(torch.float8_e4m3fn)
            table = torch.randperm(8 * pages, generator=g)[:4 * pages].view(4, pages).to(torch.int32)
        else:
            k, table = torch.randn(4, 512, 8, 128, generator=g).to(torch.float8_e4m3fn), None
        descale = torch.rand(4, 8)
        lens = torch.tensor([0, 17, 100, 128] if pages == 8 else [0, 17, 1000, 2048], dtype=torch.int32)
        cases.append((f"hopper fp8 decode {name}", (q, k, k.clone(), torch.empty_like(q), torch.empty(4, nheads, sq),
                                                    AttnParams(128**-0.5, -1, 0), table, lens, splits,
                                                    descale, descale.clone()), {}))
    return cases


def with_overlap_flipped(launches):
    """Each recorded FP8 decode launch, then the same launch with the kernel's ``OVERLAP`` flipped: both
    forms are compiled whichever the launcher's rule (``FP8_DECODE_OVERLAP``) picks."""
    return [v for fn, args, kwargs in launches
            for v in ((fn, args, kwargs), (fn, args, dict(kwargs, OVERLAP=not kwargs["OVERLAP"])))]


def hopper_bwd_cases():
    """The Gluon backward through its launcher (dK/dV with dQ's reductions at head dim 128, else or when
    deterministic dK/dV then dQ): each head dim and 16-bit dtype, no mask, causal
    (bottom-right, seqlen_q != seqlen_k) and a causal window, GQA 1/2/4, dense and packed (causal
    or not)."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in sorted({d for _, d in hopper_bwd_launcher.HOPPER_BWD_TILES}):
            for left, right, group, varlen in ((-1, -1, 1, False), (-1, 0, 4, False), (64, 0, 2, False),
                                               (-1, 0, 2, True), (-1, -1, 1, True)):
                shape_q, shape_k = ((600, 8), (700, 8 // group)) if varlen else ((2, 300, 8), (2, 350, 8 // group))
                q, dout = (torch.randn(*shape_q, d, generator=g).to(dtype) for _ in range(2))
                k, v = (torch.randn(*shape_k, d, generator=g).to(dtype) for _ in range(2))
                ws = torch.empty((8, 600) if varlen else (2, 8, 300))  # lse2 and delta
                kwargs = dict(params=AttnParams(d**-0.5, left, right))
                if varlen:
                    kwargs.update(cu_seqlens_q=torch.tensor([0, 250, 600], dtype=torch.int32),
                                  cu_seqlens_k=torch.tensor([0, 300, 700], dtype=torch.int32), max_seqlen_q=350,
                                  max_seqlen_k=400)
                name = f"hopper bwd {dtype} d{d} window ({left}, {right}) GQA {group}{' varlen' if varlen else ''}"
                grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
                cases.append((name, (dout, q, k, v, *grads, ws, ws.clone()), kwargs))
    # deterministic: dK/dV then dQ, two launches, at head dim 128 too (else one launch reducing dQ)
    for left, right, group, varlen in ((-1, 0, 4, False), (-1, -1, 1, True)):
        name, tensors, kwargs = next(c for c in cases if c[0] == f"hopper bwd torch.bfloat16 d128 window ({left}, {right})"
                                     f" GQA {group}{' varlen' if varlen else ''}")
        cases.append((name + " deterministic", tensors, dict(kwargs, deterministic=True)))
    # fp32 gradients (the ring's accumulators), stored from the accumulator's layout
    for d in sorted({d for _, d in hopper_bwd_launcher.HOPPER_BWD_TILES}):
        q, k, v, dout = (torch.randn(2, 300, 8, d, generator=g).to(torch.bfloat16) for _ in range(4))
        ws = torch.empty(2, 8, 300)
        grads = (torch.empty(q.shape), torch.empty(k.shape), torch.empty(v.shape))
        cases.append((f"hopper bwd torch.bfloat16 d{d} window (-1, 0) fp32 grads",
                      (dout, q, k, v, *grads, ws, ws.clone()), dict(params=AttnParams(d**-0.5, -1, 0))))
    # one query row, one head: lengths and strides equal to 1 become constants in a real launch
    q, dout = (torch.randn(1, 1, 1, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 200, 1, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    ws = torch.empty(1, 1, 1)
    cases.append(("hopper bwd torch.bfloat16 d128 window (-1, 0) GQA 1 seqlen_q 1",
                  (dout, q, k, v, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ws, ws.clone()),
                  dict(params=AttnParams(128**-0.5, -1, 0))))
    return cases


def compile_gluon(fn, args, kwargs):
    """Compile one recorded launch of a Gluon kernel for Hopper: tensor descriptors enter the
    signature with their block shape and shared-memory layout; integers equal to 1 are folded
    into constants, as a real launch specialises them."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    names = list(inspect.signature(fn.fn).parameters)
    bound = {**dict(zip(names, args)), **kwargs}
    options = {k: bound[k] for k in ("num_warps", "maxnreg") if k in bound}
    signature, constexprs = {}, {}
    for name, param in zip(names, fn.params):
        value = bound[name]
        if param.is_constexpr or value is None or (type(value) is int and value == 1 and not param.do_not_specialize):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, TensorDescriptor):
            dtype = _PTR[value.base.dtype][1:]
            signature[name] = f"tensordesc<{dtype}[{', '.join(map(str, value.block_shape))}],{value.layout!r}>"
        elif isinstance(value, torch.Tensor):
            signature[name] = _PTR[value.dtype]
        elif isinstance(value, int):
            signature[name] = "i32"
        else:
            signature[name] = "fp32"
    return triton.compile(GluonASTSource(fn, signature, constexprs=constexprs), target=HOPPER, options=options)


def record_hopper(launcher, module, name, *args, **kwargs):
    """The launches of Gluon kernel ``module.name`` that ``launcher(*args, **kwargs)`` makes."""
    launches = []
    original = getattr(module, name)
    setattr(module, name, Recorder(original, launches))
    try:
        launcher(*args, **kwargs)
    finally:
        setattr(module, name, original)
    return launches


def asserting_check(seqlens, top, leftpad=None, block_table=None, new_tokens=0, block_size=1, num_blocks=0):
    """The KV cache's device check as the ops layer launches it on a GPU: asserting in the kernel."""
    check_launcher.CacheCheck(seqlens, top, leftpad, block_table, new_tokens, block_size, num_blocks,
                              asserting=True)(seqlens, leftpad, block_table)


def check_cases():
    """The KV cache's device check: lengths alone, with left pads, with a block table (one
    program, and a grid of them for a large batch); each writing its flag and asserting."""
    lens = torch.tensor([3, 40, 7], dtype=torch.int32)
    table = torch.zeros(3, 100, dtype=torch.int32)
    lens64, table64 = torch.full((64,), 900, dtype=torch.int32), torch.zeros(64, 1088, dtype=torch.int32)
    return [("cache check", (lens, 64), {}), ("cache check leftpad", (lens, 64), dict(leftpad=lens.clone())),
            ("cache check paged", (lens, 64), dict(block_table=table, new_tokens=1, block_size=16, num_blocks=9)),
            ("cache check paged grid", (lens64, 17408), dict(block_table=table64, block_size=16, num_blocks=9))]


def main() -> int:
    failures = 0
    todo = []
    for name, tensors, kwargs in hopper_cases():
        todo += [(name, *launch) for launch in record_hopper(hopper_launcher.hopper_attn_fwd, attn_fwd_hopper,
                                                             "_attn_fwd_hopper_kernel", *tensors, **kwargs)]
    if not any(launch[3]["DYNAMIC"] for launch in todo):  # the rule moved: the flag would go uncompiled
        print("FAIL no forward case compiles the dynamic schedule (DYNAMIC)")
        failures += 1
    for name, tensors, kwargs in hopper_partials_cases():
        todo += [(name, *launch) for launch in record_hopper(hopper_launcher.hopper_attn_partials, attn_fwd_hopper,
                                                             "_attn_fwd_hopper_kernel", *tensors, **kwargs)]
    for name, tensors, kwargs in hopper_fp8_cases():
        todo += [(name, *launch) for launch in with_overlap_flipped(record_hopper(
            fp8_decode, decode_fp8_hopper, "_decode_fp8_hopper_kernel", *tensors, **kwargs))]
    for name, tensors, kwargs in hopper_bwd_cases():
        launches = record_hopper(hopper_bwd_launcher.hopper_attn_bwd, attn_bwd_hopper, "_attn_bwd_hopper_kernel",
                                 *tensors, **kwargs)
        todo += [(f"{name} {'dkdv' if launch[2]['DKDV'] else 'dq'}", *launch) for launch in launches]
    for name, q, k, v, kwargs in forward_cases():
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])  # v's head dim
        lse = torch.empty((q.shape[1], q.shape[0]) if "cu_seqlens_q" in kwargs else (q.shape[0], q.shape[2], q.shape[1]))
        todo += [(name + (" merged" if variant[2].get("MERGE_SPLITS") else ""), *variant)
                 for variant in forward_variants(record(fwd_launcher.attn_fwd, q, k, v, out, lse, **kwargs), q)]
    for name, tensors, kwargs in append_cases():
        todo += [(name, *launch) for launch in record(append_launcher.append_kv, *tensors, **kwargs)]
    todo += [(name + " checked", *launch) for name, *launch in checked_variants(todo)]
    for name, tensors, kwargs in backward_cases():
        todo += [(name, *launch) for launch in record(bwd_launcher.attn_bwd, *tensors, **kwargs)]
    for name, args, kwargs in check_cases():
        for how, launcher in (("", check_launcher.cache_values_ok), (" asserting", asserting_check)):
            todo += [(name + how, *launch) for launch in record_hopper(launcher, check_launcher, "_cache_check_kernel",
                                                                       *args, **kwargs)]
    plain_stack = {}  # (case, tile) -> local memory of a forward or append launch without the folded check or the merge
    for name, fn, args, kwargs in todo:
        tile = {k: v for k, v in kwargs.items() if k.startswith(("BLOCK", "num_", "STAGES", "maxnreg", "TMA_STORE"))
                or (k in ("DYNAMIC", "OVERLAP", "S_AHEAD", "KV_BAR") and v)}
        if fn is attn_bwd_hopper._attn_bwd_hopper_kernel:  # the streamed column tile, from its descriptor
            tile["BLOCK_C"] = args[2].block_shape[1]
        fp8 = fn is decode_fp8_hopper._decode_fp8_hopper_kernel
        gluon = fp8 or fn in (attn_fwd_hopper._attn_fwd_hopper_kernel, attn_bwd_hopper._attn_bwd_hopper_kernel)
        try:
            compiled = (compile_gluon if gluon else compile_launch)(fn, args, kwargs)
            shared, usage = compiled.metadata.shared, registers(compiled)
            if fp8:  # the FP8 decode's operand conversions: no shuffle but the softmax's reductions
                counts, instructions = sass_counts(compiled)
                usage += f" {' '.join(f'{op}={n}' for op, n in counts.items())} instr={instructions}"
            verdict = "ok" if shared <= SMEM_LIMIT else f"FAIL shared memory {shared} > {SMEM_LIMIT}"
            stack = int(re.search(r"stack=(\d+)", usage).group(1)) if "stack=" in usage else 0
            if gluon and stack > GLUON_STACK_LIMIT:  # the warp-specialised kernel's register split must hold
                verdict = f"FAIL spills ({usage})"
            elif stack and must_not_spill(fn, kwargs):
                verdict = f"FAIL the wide tile spills ({usage})"
            elif (checked(kwargs) or kwargs.get("MERGE_SPLITS")) and stack and not plain_stack.get(
                    (name.removesuffix(" checked").removesuffix(" merged"), str(tile))):
                verdict = f"FAIL the folded check or the merge spills ({usage})"  # where the plain launch does not
            elif gluon and wgmma_serialised(compiled):
                verdict = "FAIL every wgmma serialised by ptxas (registers)"
        except Exception as err:  # noqa: BLE001 - report every variant, then fail
            shared, usage = -1, ""
            verdict = f"FAIL {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if (fn in (fwd_launcher._attn_fwd_kernel, append_launcher._append_kv_kernel) and not checked(kwargs)
                and not kwargs.get("MERGE_SPLITS")):
            plain_stack[name, str(tile)] = int(re.search(r"stack=(\d+)", usage).group(1)) if "stack=" in usage else 0
        failures += not verdict.startswith("ok")
        print(f"{verdict:>4}  {fn.__name__:24s} {name:38s} {tile} smem={shared} {usage}", flush=True)
    failures += check_read_floor_hint()
    print(f"{len(todo)} variants compiled for sm_90, {failures} failed")
    return 1 if failures else 0


def check_read_floor_hint() -> int:
    """benchmarks/common.py's read floor with and without ``EVICT="evict_first"``: the hinted variant's
    every load carries the L2 policy (createpolicy + ld.global...L2::cache_hint), the plain one none.
    (Triton 3.6 keeps the hint only on loads it does not software-pipeline; Gluon's cp.async drops it
    and Gluon's TMA copy has no such argument: docs/perf-notes.md, "Batch-1 decoding toward the read
    floor".) Returns the number of failures."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import common as bench_common

    kernel, failures = bench_common._read_kernel(), 0
    for evict in ("", "evict_first"):
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature={"X": "*i32", "Sink": "*i32", "n": "i32",
                                                                      "BLOCK": "constexpr", "EVICT": "constexpr"},
                                                constexprs={"BLOCK": 4096, "EVICT": evict},
                                                attrs={(0,): [["tt.divisibility", 16]],
                                                       (1,): [["tt.divisibility", 16]]}),
                                      target=HOPPER, options={"num_warps": 8})
            ptx = compiled.asm["ptx"]
            loads = len(re.findall(r"ld\.global", ptx))
            hinted = len(re.findall(r"ld\.global[^\n]*L2::cache_hint", ptx))
            ok = loads > 0 and hinted == (loads if evict else 0)
            verdict = "ok" if ok else f"FAIL {hinted} of {loads} loads hinted"
            usage = f"{registers(compiled)} loads={loads} hinted={hinted}"
        except Exception as err:  # noqa: BLE001
            verdict, usage = f"FAIL {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", ""
        failures += not verdict.startswith("ok")
        print(f"{verdict:>4}  {'read_all':24s} {'read floor EVICT=' + repr(evict):38s} {usage}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
