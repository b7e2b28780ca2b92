"""Ring attention on real gloo process groups (CPU) against the float64 reference.

Each world size (1, 2, 3, 4) is spawned ONCE: its processes run every case and write what
failed to a file per rank, which the test of that world reads. A case draws seeded inputs of
the whole sequence (or packed batch), shards them, runs the ring function forward and backward
on every rank, and checks this rank's rows of out, lse, dq, dk, dv against the same rows of the
float64 reference under the tolerance rule (tests/tolerance.py), the budget set by plain
attention in the same dtype on the whole sequence (per document for packed batches).

Packed batches are given in units that every world size divides: zigzag documents of
``units * 2W`` tokens; llama3 documents of the given lengths, the last one padded so that W
divides the total — documents then straddle rank borders, and zero-length ones sit among them.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from interpreter_rounding import round_like_the_gpu
from tolerance import GRAD_FACTOR, as_f64, assert_within, max_err, plain_attention

from tileattn.distributed import (
    contiguous_shard,
    contiguous_shard_varlen,
    contiguous_unshard,
    contiguous_unshard_varlen,
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
    ring_flash_attn_varlen_qkvpacked_func,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_func,
    zigzag_shard,
    zigzag_shard_varlen,
    zigzag_unshard,
    zigzag_unshard_varlen,
)
from tileattn import flash_attn_func, flash_attn_varlen_func
from tileattn.distributed.ring import DensePlan
from tileattn.ops.attention import draw_dropout_seed
from tileattn.reference import attention_naive, attention_naive_grad

WORLD_SIZES = (1, 2, 3, 4)
DROPOUT_SEED = 4242  # torch.manual_seed on every rank before a dropout case's ring call
DENSE = {("contiguous", None): ring_flash_attn_func, ("contiguous", "kvpacked"): ring_flash_attn_kvpacked_func,
         ("contiguous", "qkvpacked"): ring_flash_attn_qkvpacked_func, ("zigzag", None): zigzag_ring_flash_attn_func,
         ("zigzag", "kvpacked"): zigzag_ring_flash_attn_kvpacked_func,
         ("zigzag", "qkvpacked"): zigzag_ring_flash_attn_qkvpacked_func}
# a world's processes compile every case's kernels first: minutes on a cold GPU host (tests/run_gpu.sh
# gives the NCCL test a step of its own and more time)
SPAWN_DEADLINE_S = float(os.environ.get("TILEATTN_RING_TEST_DEADLINE_S", "240"))

# dense: seqlen is the LOCAL length per rank; "views" passes non-contiguous shards; "pairs" (world
# 4 only) runs two independent rings of 2 ranks on sub-groups; "form" picks a packed form.
CASES = {
    # issue 15.6: causal=True on contiguous shards (the old default assumed zigzag: wrong output)
    "contiguous-causal": dict(kind="contiguous", causal=True, dtype="float32", batch=2, seqlen=13, heads=(4, 2),
                              hdim=16),
    "contiguous-full-bf16-kvpacked": dict(kind="contiguous", causal=False, dtype="bfloat16", batch=1, seqlen=11,
                                          heads=(2, 1), hdim=16, form="kvpacked"),
    "contiguous-sliding-window": dict(kind="contiguous", causal=True, window=(5, -1), dtype="float32", batch=1,
                                      seqlen=12, heads=(2, 2), hdim=16),
    "zigzag-causal-mqa": dict(kind="zigzag", causal=True, dtype="float32", batch=2, seqlen=14, heads=(4, 1), hdim=16),
    "zigzag-causal-views": dict(kind="zigzag", causal=True, dtype="float32", batch=1, seqlen=10, heads=(2, 2),
                                hdim=40, views=True),
    "zigzag-full-softcap-scale": dict(kind="zigzag", causal=False, dtype="float32", batch=1, seqlen=10, heads=(4, 2),
                                      hdim=16, softcap=2.0, softmax_scale=0.3),
    "zigzag-window-both-sides": dict(kind="zigzag", causal=False, window=(3, 7), dtype="float32", batch=1, seqlen=12,
                                     heads=(2, 1), hdim=16, softcap=5.0),
    "zigzag-causal-window-bf16": dict(kind="zigzag", causal=True, window=(9, -1), dtype="bfloat16", batch=1,
                                      seqlen=18, heads=(4, 2), hdim=40),
    "zigzag-causal-pairs-qkvpacked": dict(kind="zigzag", causal=True, dtype="float32", batch=1, seqlen=12,
                                          heads=(2, 2), hdim=16, pairs=True, form="qkvpacked"),
    "contiguous-varlen-causal-qkvpacked": dict(kind="contiguous-varlen", causal=True, dtype="float32",
                                               units=(3, 0, 1, 5), heads=(2, 2), hdim=16, form="qkvpacked"),
    "contiguous-varlen-window-bf16": dict(kind="contiguous-varlen", causal=True, window=(4, -1), dtype="bfloat16",
                                          units=(2, 5), heads=(4, 2), hdim=16),
    "zigzag-varlen-causal": dict(kind="zigzag-varlen", causal=True, dtype="float32", units=(3, 0, 1, 2),
                                 heads=(4, 2), hdim=16),
    "zigzag-varlen-window-softcap": dict(kind="zigzag-varlen", causal=False, window=(4, 2), softcap=3.0,
                                         dtype="float32", units=(2, 0, 3), heads=(2, 1), hdim=16),
    "zigzag-varlen-bf16": dict(kind="zigzag-varlen", causal=True, dtype="bfloat16", units=(1, 3), heads=(2, 2),
                               hdim=16),
    "llama3-causal": dict(kind="llama3", causal=True, dtype="float32", docs=(5, 0, 17, 1, 9), heads=(4, 2), hdim=16,
                          stride=1),
    "llama3-full": dict(kind="llama3", causal=False, dtype="float32", docs=(7, 13, 0, 6), heads=(2, 2), hdim=16,
                        stride=2),
    "llama3-window-softcap": dict(kind="llama3", causal=False, window=(6, 3), softcap=4.0, dtype="float32",
                                  docs=(7, 2, 0, 18), heads=(4, 2), hdim=16, stride=1),
    "llama3-causal-alibi-bf16-kvpacked": dict(kind="llama3", causal=True, alibi=True, window=(7, -1),
                                              dtype="bfloat16", docs=(9, 15, 3), heads=(4, 4), hdim=16, stride=2,
                                              form="kvpacked"),
    # ALiBi: each block's diagonal moved to its global place (AttnParams.diag_shift)
    "zigzag-causal-alibi-gqa": dict(kind="zigzag", causal=True, alibi=True, dtype="float32", batch=2, seqlen=10,
                                    heads=(4, 2), hdim=16),
    "contiguous-full-alibi-softcap": dict(kind="contiguous", causal=False, alibi=True, softcap=3.0, dtype="float32",
                                          batch=1, seqlen=9, heads=(2, 2), hdim=16),
    "zigzag-window-alibi-bf16": dict(kind="zigzag", causal=False, window=(3, 7), alibi=True, dtype="bfloat16",
                                     batch=1, seqlen=12, heads=(2, 1), hdim=16),
    "zigzag-varlen-causal-alibi": dict(kind="zigzag-varlen", causal=True, alibi=True, dtype="float32",
                                       units=(3, 0, 1, 2), heads=(4, 2), hdim=16),
    "contiguous-varlen-window-alibi": dict(kind="contiguous-varlen", causal=True, window=(4, -1), alibi=True,
                                           dtype="float32", units=(2, 5), heads=(2, 2), hdim=16),
    # dropout: each call hashes its elements' positions in the whole batch (AttnParams.dropout_base)
    "zigzag-causal-dropout-gqa": dict(kind="zigzag", causal=True, dropout=0.3, dtype="float32", batch=2, seqlen=10,
                                      heads=(4, 2), hdim=16),
    "contiguous-window-dropout-alibi-bf16": dict(kind="contiguous", causal=True, window=(5, -1), dropout=0.2,
                                                 alibi=True, dtype="bfloat16", batch=1, seqlen=12, heads=(2, 1),
                                                 hdim=16),
    "zigzag-full-dropout-triton": dict(kind="zigzag", causal=False, dropout=0.25, dtype="float32", batch=1, seqlen=8,
                                       heads=(2, 2), hdim=16, backend="triton"),
    "zigzag-window-alibi-triton": dict(kind="zigzag", causal=False, window=(3, 2), alibi=True, dtype="float32",
                                       batch=1, seqlen=12, heads=(2, 1), hdim=16, backend="triton"),
    # packed documents: each call hashes its document's index in the global cu_seqlens (zero-length ones
    # counted), its chunk of heads and its positions inside the document, as flash_attn_varlen_func does
    "zigzag-varlen-causal-dropout-gqa": dict(kind="zigzag-varlen", causal=True, dropout=0.3, dtype="float32",
                                             units=(3, 0, 1, 2), heads=(4, 2), hdim=16),
    "zigzag-varlen-full-dropout-bf16": dict(kind="zigzag-varlen", causal=False, dropout=0.2, dtype="bfloat16",
                                            units=(2, 0, 3), heads=(2, 1), hdim=16),
    "zigzag-varlen-window-dropout-sink-dlse": dict(kind="zigzag-varlen", causal=False, window=(4, 2), dropout=0.25,
                                                   dtype="float32", units=(0, 2, 3), heads=(4, 1), hdim=16,
                                                   sink=True, dlse=True),
    "contiguous-varlen-causal-dropout-qkvpacked": dict(kind="contiguous-varlen", causal=True, dropout=0.3,
                                                       dtype="float32", units=(3, 0, 1, 5), heads=(2, 2), hdim=16,
                                                       form="qkvpacked"),
    "contiguous-varlen-window-dropout-alibi": dict(kind="contiguous-varlen", causal=True, window=(4, -1),
                                                   dropout=0.2, alibi=True, dtype="float32", units=(2, 0, 5),
                                                   heads=(4, 2), hdim=16),
    "llama3-causal-dropout-stride1": dict(kind="llama3", causal=True, dropout=0.3, dtype="float32",
                                          docs=(5, 0, 17, 1, 9), heads=(4, 2), hdim=16, stride=1),
    "llama3-full-dropout-stride2-bf16": dict(kind="llama3", causal=False, dropout=0.2, dtype="bfloat16",
                                             docs=(7, 13, 0, 6), heads=(8, 4), hdim=16, stride=2),
    # window (0, 3): a document begun on an earlier rank whose keys are all here is a home call at a position > 0
    "llama3-window-dropout-sink-dlse-kvpacked": dict(kind="llama3", causal=False, window=(0, 3), dropout=0.25,
                                                     dtype="float32", docs=(5, 0, 17, 1, 9), heads=(4, 2), hdim=16,
                                                     stride=1, sink=True, dlse=True, form="kvpacked"),
    "llama3-causal-dropout-alibi": dict(kind="llama3", causal=True, window=(7, -1), dropout=0.3, alibi=True,
                                        dtype="float32", docs=(9, 0, 15, 3), heads=(2, 2), hdim=16, stride=1),
    # learnable sinks (once per row, their gradient summed over the ranks) and a gradient reaching the LSE
    "zigzag-causal-sink-dlse-gqa": dict(kind="zigzag", causal=True, dtype="float32", batch=2, seqlen=10, heads=(4, 2),
                                        hdim=16, sink=True, dlse=True),
    "contiguous-window-sink-dlse-bf16": dict(kind="contiguous", causal=True, window=(5, -1), dtype="bfloat16",
                                             batch=1, seqlen=12, heads=(2, 1), hdim=16, sink=True, dlse=True),
    "contiguous-full-dlse-softcap": dict(kind="contiguous", causal=False, dtype="float32", batch=1, seqlen=9,
                                         heads=(2, 2), hdim=16, softcap=3.0, dlse=True),
    "zigzag-varlen-sink-dlse": dict(kind="zigzag-varlen", causal=True, dtype="float32", units=(2, 0, 3), heads=(4, 1),
                                    hdim=16, sink=True, dlse=True),
    "contiguous-varlen-window-sink-dlse": dict(kind="contiguous-varlen", causal=False, window=(3, 2),
                                               dtype="float32", units=(3, 1), heads=(2, 1), hdim=16, sink=True,
                                               dlse=True),
    "llama3-causal-sink-dlse-gqa": dict(kind="llama3", causal=True, dtype="float32", docs=(5, 0, 17, 1, 9),
                                        heads=(4, 2), hdim=16, stride=1, sink=True, dlse=True),
    # fp32: in bf16 at world 3, flash_attn_varlen_func itself misses the rule on dsink (2.3e-3 against
    # plain torch's 3.7e-4 on this draw) and the ring equals it
    "llama3-full-window-sink-dlse": dict(kind="llama3", causal=False, window=(4, 6), dtype="float32",
                                         docs=(11, 19, 2), heads=(2, 2), hdim=16, stride=2, sink=True, dlse=True),
    # the Triton kernels under the interpreter (world 2 only: slow), fp32 state written in place
    "zigzag-causal-gqa-triton": dict(kind="zigzag", causal=True, dtype="float32", batch=1, seqlen=8, heads=(2, 1),
                                     hdim=16, backend="triton"),
    "contiguous-causal-bf16-triton": dict(kind="contiguous", causal=False, window=(-1, 0), dtype="bfloat16",
                                          batch=1, seqlen=8, heads=(2, 2), hdim=16, backend="triton"),
    "zigzag-varlen-triton": dict(kind="zigzag-varlen", causal=True, dtype="float32", units=(1, 0, 2), heads=(2, 1),
                                 hdim=16, backend="triton"),
    "llama3-window-triton": dict(kind="llama3", causal=False, window=(3, 2), dtype="float32", docs=(5, 9, 0, 2),
                                 heads=(2, 1), hdim=16, stride=1, backend="triton"),
    "llama3-causal-sink-dlse-triton": dict(kind="llama3", causal=True, dtype="float32", docs=(7, 9), heads=(2, 1),
                                           hdim=16, stride=1, sink=True, dlse=True, backend="triton"),
    "zigzag-varlen-dropout-triton": dict(kind="zigzag-varlen", causal=True, dropout=0.3, dtype="float32",
                                         units=(1, 0, 2), heads=(2, 1), hdim=16, backend="triton"),
    "llama3-full-dropout-triton": dict(kind="llama3", causal=False, dropout=0.25, dtype="float32", docs=(5, 0, 9),
                                       heads=(4, 2), hdim=16, stride=1, backend="triton"),
    # v with a head dim of its own (hdim_v; issue #18 item 2): out and dv have it, the shard travels as k ++ v
    # (last in this table: a case's seed is its index, so the cases above keep their draws)
    "zigzag-causal-hdimv-192-128": dict(kind="zigzag", causal=True, dtype="float32", batch=2, seqlen=10, heads=(4, 2),
                                        hdim=192, hdim_v=128),
    "zigzag-causal-hdimv-views-bf16": dict(kind="zigzag", causal=True, dtype="bfloat16", batch=1, seqlen=12,
                                           heads=(2, 1), hdim=24, hdim_v=40, views=True),
    "contiguous-window-hdimv-sink-dlse": dict(kind="contiguous", causal=True, window=(5, -1), dtype="float32",
                                              batch=1, seqlen=12, heads=(2, 1), hdim=40, hdim_v=24, sink=True,
                                              dlse=True),
    "contiguous-varlen-hdimv": dict(kind="contiguous-varlen", causal=True, dtype="float32", units=(3, 0, 1, 5),
                                    heads=(2, 2), hdim=48, hdim_v=16),
    "zigzag-varlen-window-hdimv": dict(kind="zigzag-varlen", causal=False, window=(4, 2), dtype="float32",
                                       units=(2, 0, 3), heads=(4, 1), hdim=24, hdim_v=40),
    # bf16, MLA training's dtype: on NCCL the fp32 case's packed backward at head dim 192 (tiles of
    # 256) spent over 140 s in ptxas on a cold host (2026-11-30 19:59, stacks in the deadline message)
    "llama3-causal-hdimv-192-128-bf16": dict(kind="llama3", causal=True, dtype="bfloat16", docs=(5, 0, 17, 1, 9),
                                             heads=(4, 2), hdim=192, hdim_v=128, stride=1),
    "llama3-window-hdimv-bf16": dict(kind="llama3", causal=False, window=(6, 3), dtype="bfloat16",
                                     docs=(7, 13, 0, 6), heads=(4, 2), hdim=40, hdim_v=24, stride=2, sink=True,
                                     dlse=True),
    # ... and under the interpreter
    "zigzag-causal-hdimv-triton": dict(kind="zigzag", causal=True, dtype="float32", batch=1, seqlen=8, heads=(2, 1),
                                       hdim=24, hdim_v=40, backend="triton"),
    "llama3-causal-hdimv-triton": dict(kind="llama3", causal=True, dtype="float32", docs=(5, 9, 0, 2), heads=(2, 1),
                                       hdim=40, hdim_v=16, stride=1, backend="triton"),
    # float64 on the CPU path: within 1e-12 of the reference, LSE float64, as the single call (the ring's
    # state and accumulators were fp32: fp32-accurate results, an fp32 LSE, and a crash on the ranks whose
    # first call wrote a float64 tile into the fp32 state while the others waited in the ring)
    "contiguous-full-window-f64": dict(kind="contiguous", causal=False, window=(20, 1), dtype="float64", batch=1,
                                       seqlen=6, heads=(4, 2), hdim=8, cpu_only=True),
    "zigzag-causal-sink-dlse-alibi-f64": dict(kind="zigzag", causal=True, alibi=True, dtype="float64", batch=2,
                                              seqlen=6, heads=(4, 2), hdim=8, sink=True, dlse=True, cpu_only=True),
    "zigzag-varlen-window-f64": dict(kind="zigzag-varlen", causal=False, window=(4, 2), dtype="float64",
                                     units=(2, 0, 3), heads=(2, 1), hdim=8, dlse=True, cpu_only=True),
    "llama3-causal-sink-dlse-f64": dict(kind="llama3", causal=True, dtype="float64", docs=(5, 0, 17, 1, 9),
                                        heads=(4, 2), hdim=8, stride=1, sink=True, dlse=True, cpu_only=True),
}


def _cases_for(world: int, device_type: str = "cpu"):
    return [name for name, c in CASES.items()
            if (not c.get("pairs") or world == 4) and (c.get("backend") is None or (world == 2 and _INTERPRETED))
            and not (c.get("cpu_only") and device_type != "cpu")]


# The cases that force the Triton backend on CPU tensors need Triton's interpreter, which conftest
# turns on only where there is no GPU; on a GPU host the NCCL test runs the Triton kernels.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------- inputs and oracle


def _doc_lengths(case, world: int) -> list[int]:
    if case["kind"] == "zigzag-varlen":
        return [u * 2 * world for u in case["units"]]
    if case["kind"] == "contiguous-varlen":
        return [u * world for u in case["units"]]
    if case["kind"] == "llama3":
        docs = list(case["docs"])
        docs[-1] += -sum(docs) % world
        return docs
    return []


def _randn(shape, g, dtype):
    return torch.randn(shape, generator=g).to(dtype)


def _inputs(case, world: int, seed: int):
    """Seeded q, k, v, dout of the whole sequence (the same on every rank); alibi slopes, sinks and
    the gradient reaching the LSE (fp32, lse's layout), each or None."""
    g = torch.Generator().manual_seed(seed)
    nheads, nheads_k = case["heads"]
    dtype = getattr(torch, case["dtype"])
    hdim, hdim_v = case["hdim"], case.get("hdim_v", case["hdim"])  # v (and out, dout) may have a head dim of its own
    if case["kind"] in ("contiguous", "zigzag"):
        lead = (case["batch"], case["seqlen"] * world)
    else:
        lead = (sum(_doc_lengths(case, world)),)
    q = _randn(lead + (nheads, hdim), g, dtype)
    k, v = _randn(lead + (nheads_k, hdim), g, dtype), _randn(lead + (nheads_k, hdim_v), g, dtype)
    dout = _randn(lead + (nheads, hdim_v), g, dtype)
    slopes = torch.rand(nheads, generator=g) * 0.5 + 0.1 if case.get("alibi") else None
    sink = torch.randn(nheads, generator=g) if case.get("sink") else None
    lse_shape = (lead[0], nheads, lead[1]) if len(lead) == 2 else (nheads, lead[0])
    dlse = torch.randn(lse_shape, generator=g) if case.get("dlse") else None
    return q, k, v, dout, slopes, sink, dlse


def _oracle(case, q, k, v, dout, slopes, sink, dlse, world: int, device):
    """(ref64, plain) lists for out, lse, dq, dk, dv (and dsink with sinks) of the whole sequence /
    packed batch, for the loss sum(out * dout) + sum(lse * dlse). With dropout, the seed the
    whole-sequence call would draw on the ring's ``device`` (CUDA and CPU generators differ), and
    the mask of the single call: flash_attn_varlen_func hashes document b as batch entry b (its
    index in cu_seqlens, zero-length documents counted), so each document's dense oracle runs
    as entry b of a batch whose entries before it are zeros."""
    opts = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0),
                softmax_scale=case.get("softmax_scale"))
    if case.get("dropout"):  # the seed the ring draws after torch.manual_seed(DROPOUT_SEED), as one call would
        torch.manual_seed(DROPOUT_SEED)
        opts.update(dropout_p=case["dropout"], dropout_seed=draw_dropout_seed(case["dropout"], device))
    alibi = None if slopes is None else slopes.double().numpy()
    sink64 = None if sink is None else sink.double().numpy()

    def one(qs, ks, vs, ds, dl, at=0):  # (B, S, H, D) tensors, dl (B, H, S) or None; at: their first entry
        if at and "dropout_p" in opts:  # entries of zeros before (their dsink terms are 0: dout = dlse = 0)
            pad = lambda t: torch.cat([t.new_zeros((at,) + t.shape[1:]), t])  # noqa: E731
            results = one(*(pad(t) for t in (qs, ks, vs, ds)), None if dl is None else pad(dl))
            return [[x if i == 5 else x[at:] for i, x in enumerate(r)] for r in results]
        ref_out, ref_lse = attention_naive(qs.double().numpy(), ks.double().numpy(), vs.double().numpy(),
                                           alibi_slopes=alibi, learnable_sink=sink64, **opts)
        ref_grads = attention_naive_grad(qs.double().numpy(), ks.double().numpy(), vs.double().numpy(),
                                         ds.double().numpy(), dlse=None if dl is None else dl.double().numpy(),
                                         alibi_slopes=alibi, learnable_sink=sink64, **opts)
        pq, pk, pv = (t.clone().requires_grad_() for t in (qs, ks, vs))
        leaves = (pq, pk, pv) if sink is None else (pq, pk, pv, sink.clone().requires_grad_())
        plain_out, plain_lse = plain_attention(pq, pk, pv, alibi_slopes=slopes,
                                               learnable_sink=None if sink is None else leaves[3], **opts)
        outputs, grads_in = (plain_out,), (ds,)
        if dl is not None:
            outputs, grads_in = (plain_out, plain_lse), (ds, dl.to(plain_lse.dtype))
        plain_grads = torch.autograd.grad(outputs, leaves, grads_in)
        refs = [torch.from_numpy(x) for x in (ref_out, ref_lse, *ref_grads)]
        return refs, [plain_out.detach(), plain_lse.detach(), *plain_grads]

    if case["kind"] in ("contiguous", "zigzag"):
        return one(q, k, v, dout, dlse)
    parts = 5 if sink is None else 6
    refs, plains = [[] for _ in range(parts)], [[] for _ in range(parts)]
    start = 0
    for b, n in enumerate(_doc_lengths(case, world)):
        if n:
            dl = None if dlse is None else dlse[:, start:start + n].unsqueeze(0)
            r, p = one(*(t[start:start + n].unsqueeze(0) for t in (q, k, v, dout)), dl, at=b)
            for i in range(parts):  # packed layouts: tokens first, lse (heads, tokens); dsink summed below
                refs[i].append(r[i] if i == 5 else r[i][0])
                plains[i].append(p[i] if i == 5 else p[i][0])
        start += n
    return ([sum(x) if i == 5 else torch.cat(x, 1 if i == 1 else 0) for i, x in enumerate(refs)],
            [sum(x) if i == 5 else torch.cat(x, 1 if i == 1 else 0) for i, x in enumerate(plains)])


# ----------------------------------------------------------------------------- one case, one rank


def _view(shard):
    """A non-contiguous view (heads-first strides, padded rows) holding the same values."""
    batch, seqlen, nheads, hdim = shard.shape
    padded = torch.full((batch, nheads, seqlen, hdim + 8), float("nan"), dtype=shard.dtype, device=shard.device)
    padded[..., :hdim] = shard.transpose(1, 2)
    view = padded[..., :hdim].transpose(1, 2)
    assert not view.is_contiguous()
    return view


def _run_case(name: str, rank: int, world: int, group, device) -> None:
    case = CASES[name]
    kind, form = case["kind"], case.get("form")
    q, k, v, dout, slopes, sink, dlse = _inputs(case, world, seed=list(CASES).index(name))
    sink_leaf = None if sink is None else sink.clone().to(device).requires_grad_()
    opts = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)),
                softmax_scale=case.get("softmax_scale"), return_attn_probs=True, group=group,
                softcap=case.get("softcap", 0.0), learnable_sink=sink_leaf)
    docs = torch.tensor([0] + _doc_lengths(case, world), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if slopes is not None and kind != "llama3":  # (nheads,): every sequence the same slopes (llama3: below)
        opts["alibi_slopes"] = slopes.to(device)
    if case.get("dropout"):  # every rank seeded alike: one mask, the whole-sequence call's
        opts["dropout_p"] = case["dropout"]
        torch.manual_seed(DROPOUT_SEED)
    if kind == "contiguous":
        mine = lambda x, dim=1: contiguous_shard(torch.as_tensor(x), rank, world, dim)  # noqa: E731
    elif kind == "zigzag":
        mine = lambda x, dim=1: zigzag_shard(torch.as_tensor(x), rank, world, dim)  # noqa: E731
    elif kind == "zigzag-varlen":
        mine = lambda x, dim=0: zigzag_shard_varlen(torch.as_tensor(x), docs, rank, world, dim)  # noqa: E731
    elif kind == "contiguous-varlen":
        mine = lambda x, dim=0: contiguous_shard_varlen(torch.as_tensor(x), docs, rank, world, dim)  # noqa: E731
    else:
        mine = lambda x, dim=0: contiguous_shard(torch.as_tensor(x), rank, world, dim)  # noqa: E731
    local = [mine(t).to(device) for t in (q, k, v)]
    if case.get("views"):
        local = [_view(t) for t in local]
    lq, lk, lv = (t.detach().requires_grad_() for t in local)
    if kind in ("contiguous", "zigzag"):
        if kind == "contiguous" and case["causal"] and "window" not in case and not case.get("dlse"):
            # the call a port from ring-flash-attention makes (issue 15.6): no layout argument
            out = ring_flash_attn_func(lq, lk, lv, causal=True, group=group, learnable_sink=sink_leaf)
            _, lse, _ = ring_flash_attn_func(lq.detach(), lk.detach(), lv.detach(), **opts)
        elif form == "kvpacked":
            out, lse, _ = DENSE[kind, form](lq, torch.stack([lk, lv], dim=2), **opts)
        elif form == "qkvpacked":
            out, lse, _ = DENSE[kind, form](torch.stack([lq, lk, lv], dim=2), **opts)
        else:
            out, lse, _ = DENSE[kind, form](lq, lk, lv, **opts)
    elif kind == "zigzag-varlen":
        cu = (docs // world).to(device)
        max_len = int((cu[1:] - cu[:-1]).max())
        out, lse, _ = zigzag_ring_flash_attn_varlen_func(lq, lk, lv, cu, max_len, **opts)
    elif kind == "contiguous-varlen":
        cu = (docs // world).to(device)
        max_len = int((cu[1:] - cu[:-1]).max())
        if form == "qkvpacked":
            out, lse, _ = ring_flash_attn_varlen_qkvpacked_func(torch.stack([lq, lk, lv], dim=1), cu, max_len, **opts)
        else:
            out, lse, _ = ring_flash_attn_varlen_func(lq, lk, lv, cu, max_len, **opts)
    else:
        cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(docs.to(device), case["causal"],
                                                                                  rank, world)
        n_local = cu_q.shape[0] - 1
        if slopes is not None:  # per-sequence slopes (n_local, nheads): every sequence gets the same here
            opts["alibi_slopes"] = slopes.to(device).expand(n_local, -1).contiguous()
        if case.get("dropout"):  # the global offsets, whose document indices the single call's mask hashes
            opts["cu_seqlens"] = docs.to(device)
        if form == "kvpacked":
            out, lse, _ = llama3_flash_attn_varlen_kvpacked_func(lq, torch.stack([lk, lv], dim=1), cu_q, cu_k, max_q,
                                                                 max_k, case["stride"], k_slice, **opts)
        else:
            out, lse, _ = llama3_flash_attn_varlen_func(lq, lk, lv, cu_q, cu_k, max_q, max_k, case["stride"], k_slice,
                                                        **opts)
    lse_dim = 2 if kind in ("contiguous", "zigzag") else 1
    if dlse is None:
        out.backward(mine(dout).to(device))
    else:  # the loss sum(out * dout) + sum(lse * dlse)
        torch.autograd.backward((out, lse), (mine(dout).to(device), mine(dlse, lse_dim).to(device)))
    dsink = None
    if sink is not None:  # each rank holds its rows' share of the sinks' gradient (summed before any check
        dsink = sink_leaf.grad.clone()  # can fail on one rank only: the ranks' collectives stay in step)
        dist.all_reduce(dsink, group=group)

    refs, plains = _oracle(case, q, k, v, dout, slopes, sink, dlse, world, device)
    assert out.dtype == q.dtype and lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    check = _within_f64 if q.dtype == torch.float64 else assert_within
    check(f"{name} out", out, mine(plains[0]), mine(refs[0]))
    check(f"{name} lse", lse, mine(plains[1], lse_dim), mine(refs[1], lse_dim))
    for label, got, plain, ref in zip(("dq", "dk", "dv"), (lq.grad, lk.grad, lv.grad), plains[2:], refs[2:]):
        assert got.dtype == q.dtype
        check(f"{name} {label}", got, mine(plain), mine(ref), factor=GRAD_FACTOR)
    if dsink is not None:  # the sinks are an fp32 parameter: their gradient is fp32 whatever q's dtype
        assert_within(f"{name} dsink", dsink.cpu(), plains[5], refs[5], factor=GRAD_FACTOR)
    if case.get("dropout") and kind not in ("contiguous", "zigzag") and rank == 0:
        # the oracle's mask is the single call's: flash_attn_varlen_func on the whole batch passes it too
        single = _single_call(case, q, k, v, dout, slopes, sink, dlse, docs, device)
        for label, got, plain, ref in zip(("out", "lse", "dq", "dk", "dv", "dsink"), single, plains, refs):
            assert_within(f"{name} single call {label}", got.cpu(), plain, ref,
                          factor=GRAD_FACTOR if label.startswith("d") else 2.0)


def _within_f64(name: str, fast, plain, ref, factor: float = 0.0) -> None:
    """float64 paths compare directly: within 1e-12 of the reference, relative to its largest entry
    (``plain`` and ``factor`` unused: the tolerance rule's arguments)."""
    finite = torch.isfinite(as_f64(ref))
    scale = max(1.0, float(as_f64(ref)[finite].abs().max())) if finite.any() else 1.0
    err = max_err(fast, ref)
    assert err <= 1e-12 * scale, f"{name}: err {err:.3e} > 1e-12 * {scale:.3g}"


def _single_call(case, q, k, v, dout, slopes, sink, dlse, docs, device):
    """out, lse, dq, dk, dv (and dsink) of flash_attn_varlen_func on the whole packed batch, its
    dropout seed drawn as the ring's is (torch.manual_seed(DROPOUT_SEED) on ``device``)."""
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sink is None else sink.to(device).requires_grad_()
    longest = int((docs[1:] - docs[:-1]).max())
    torch.manual_seed(DROPOUT_SEED)
    out, lse, _ = flash_attn_varlen_func(*leaves, docs.to(device), docs.to(device), longest, longest,
                                         dropout_p=case["dropout"], softmax_scale=case.get("softmax_scale"),
                                         causal=case["causal"], window_size=case.get("window", (-1, -1)),
                                         softcap=case.get("softcap", 0.0),
                                         alibi_slopes=None if slopes is None else slopes.to(device),
                                         return_attn_probs=True, learnable_sink=sink_leaf)
    grads_in = (dout.to(device),) if dlse is None else (dout.to(device), dlse.to(device))
    outputs = (out,) if dlse is None else (out, lse)
    grads = torch.autograd.grad(outputs, leaves + ([] if sink_leaf is None else [sink_leaf]), grads_in)
    return [out.detach(), lse.detach(), *grads]


def _worker(rank: int, world: int, init_file: str, result_dir: str, device_type: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    round_like_the_gpu()  # a spawned rank does not load conftest
    # a rank still running near the deadline writes where its threads are, for the failure message
    stack_file = open(f"{result_dir}/rank{rank}.stack", "w")
    faulthandler.dump_traceback_later(max(1.0, SPAWN_DEADLINE_S - 10), file=stack_file)
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    failures = {}
    # new_group must be entered by every rank, in the same order.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None
    for name in cases:
        with open(f"{result_dir}/rank{rank}.progress", "a") as f:  # where a rank was when a deadline struck
            f.write(f"{time.monotonic():.1f} {name}\n")
        pair_case = CASES[name].get("pairs", False)
        group = pairs[rank // 2] if pair_case else None
        forced = CASES[name].get("backend") if device_type == "cpu" else None
        if forced:
            os.environ["TILEATTN_BACKEND"] = forced
        try:
            _run_case(name, rank % 2 if pair_case else rank, 2 if pair_case else world, group, device)
            failures[name] = None
        except Exception:  # recorded and reported by the pytest test of this world
            failures[name] = traceback.format_exc()
        finally:
            os.environ.pop("TILEATTN_BACKEND", None) if forced else None
    faulthandler.cancel_dump_traceback_later()
    with open(f"{result_dir}/rank{rank}.json", "w") as f:
        json.dump(failures, f)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- spawning


def _spawn(world: int, device_type: str, tmp, cases: list[str] | None = None) -> list[dict]:
    """Run ``cases`` (default: every case of this world) on ``world`` fresh processes; per rank
    {case: traceback or None}."""
    cases = _cases_for(world) if cases is None else cases
    start = time.monotonic()
    ctx = mp.start_processes(_worker, args=(world, str(tmp / "pg"), str(tmp), device_type, cases), nprocs=world,
                             join=False, start_method="spawn")
    deadline = start + SPAWN_DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            where = []
            for r in range(world):
                progress = tmp / f"rank{r}.progress"
                lines = progress.read_text().split("\n")[-2:-1] if progress.exists() else []
                stamp, _, name = lines[0].partition(" ") if lines else ("", "", "")
                where.append(f"rank {r}: " + (f"in {name} for {time.monotonic() - float(stamp):.0f} s" if name
                                              else "no case started"))
                stack = tmp / f"rank{r}.stack"
                if stack.exists() and stack.stat().st_size:  # the innermost frames of its main thread
                    where[-1] += "\n" + "\n".join(stack.read_text().splitlines()[:24])
            pytest.fail(f"ring of {world} processes did not finish in {SPAWN_DEADLINE_S} s (hang?); "
                        + "; ".join(where))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _assert_all_passed(per_rank: list[dict]) -> None:
    failed = [f"{name} on rank {r}:\n{tb}" for r, res in enumerate(per_rank) for name, tb in res.items() if tb]
    assert not failed, f"{len(failed)} case(s) failed:\n" + "\n".join(failed)


# One test per process group (not per case), so that pytest-xdist never spawns a world twice;
# the message names every failing case and rank.
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_matches_reference(world, tmp_path):
    per_rank = _spawn(world, "cpu", tmp_path)
    assert all(sorted(res) == sorted(_cases_for(world)) for res in per_rank)
    _assert_all_passed(per_rank)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [name for name, c in CASES.items()
                                  if c.get("backend") is None and not c.get("cpu_only")])
def test_ring_on_nccl_matches_reference(case, tmp_path):
    """The same cases on the GPUs of this host (NCCL, the Triton backend), up to 4 ranks, one
    process group per case: the kernels a world compiles first dominate its time, and cases
    in parallel (pytest-xdist) compile in parallel."""
    world = min(4, torch.cuda.device_count())
    if case not in _cases_for(world, "cuda"):
        pytest.skip(f"{case} runs two rings of 2 ranks: it needs 4 GPUs, this host has {world}")
    _assert_all_passed(_spawn(world, "cuda", tmp_path, [case]))


# ----------------------------------------------------------------------------- no process group needed


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(world):
    seqlen = 2 * world * 3
    x = torch.randn(2, seqlen, 3, 4, generator=torch.Generator().manual_seed(world))
    chunk = seqlen // (2 * world)
    zig = [zigzag_shard(x, r, world) for r in range(world)]
    for r, s in enumerate(zig):
        lo, hi = r * chunk, (2 * world - 1 - r) * chunk
        assert torch.equal(s, torch.cat([x[:, lo:lo + chunk], x[:, hi:hi + chunk]], dim=1))
    assert torch.equal(zigzag_unshard(zig), x)
    cont = [contiguous_shard(x, r, world) for r in range(world)]
    assert torch.equal(cont[world - 1], x[:, (world - 1) * seqlen // world:])
    assert torch.equal(contiguous_unshard(cont), x)
    xt = x.transpose(1, 2)  # the sequence on dim 2
    assert torch.equal(zigzag_unshard([zigzag_shard(xt, r, world, dim=2) for r in range(world)], dim=2), xt)
    # packed documents of 4W, 0 and 2W tokens, each zigzag-cut on its own
    cu = torch.tensor([0, 4 * world, 4 * world, 6 * world], dtype=torch.int32)
    packed = torch.arange(6 * world)
    shards = [zigzag_shard_varlen(packed, cu, r, world) for r in range(world)]
    assert torch.equal(shards[0][:4], torch.tensor([0, 1, 4 * world - 2, 4 * world - 1]))
    assert torch.equal(shards[0][4:], torch.tensor([4 * world, 6 * world - 1]))
    assert torch.equal(zigzag_unshard_varlen(shards, cu), packed)
    cont = [contiguous_shard_varlen(packed, cu, r, world) for r in range(world)]
    assert torch.equal(cont[world - 1][:4], torch.arange(4 * world - 4, 4 * world))
    assert torch.equal(contiguous_unshard_varlen(cont, cu), packed)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_llama3_prepare_cu_seqlens(world, causal):
    """Each rank's sequences are the documents meeting its rows; keys from the document's start to
    the end of its rows (causal) or of the document; zero-length documents left out."""
    lengths = [5, 0, 17, 1, 9 + (-32 % world)]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total = int(cu[-1])
    per = total // world
    doc_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = cu[:-1].long()
    for rank in range(world):
        cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        assert cu_q.dtype == cu_k.dtype == torch.int32 and int(cu_q[-1]) == per
        rows = torch.arange(rank * per, (rank + 1) * per)
        docs = doc_of[rows].unique_consecutive()
        assert len(cu_q) == len(docs) + 1
        for b, doc in enumerate(docs.tolist()):
            q_rows = rows[int(cu_q[b]):int(cu_q[b + 1])]
            assert (doc_of[q_rows] == doc).all() and len(q_rows) == int((doc_of[rows] == doc).sum())
            k_lo, k_hi = k_slice.start + int(cu_k[b]), k_slice.start + int(cu_k[b + 1])
            assert k_lo == starts[doc]
            assert k_hi == (int(q_rows[-1]) + 1 if causal else int(cu[doc + 1]))
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (3, 0), (2, 4), (-1, 5)])
def test_llama3_transfers_carry_only_what_is_read(world, causal, window):
    """llama3's plan: an away document's buffer is its own rows plus rows received from their
    owners, tiling its key range, whose first and last rows some query of it sees (keys beyond the
    window's reach never travel); each rank sends exactly the rows the others receive from it; home
    calls attend their own rows."""
    from tileattn.contract import AttnParams
    from tileattn.distributed.llama3 import _documents, _key_range, _layout

    lengths = [5, 0, 17, 1, 9 + (-32 % world)]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    n = int(cu[-1]) // world
    wl, wr = window
    params = AttnParams(softmax_scale=1.0, window_left=wl, window_right=0 if causal else wr)
    prepared = [llama3_flash_attn_prepare_cu_seqlens(cu, causal, r, world) for r in range(world)]
    docs = [_documents(n, r, p[0], p[1], p[4], params, False) for r, p in enumerate(prepared)]
    ranges = [_key_range(d, n, r) for r, d in enumerate(docs)]
    plans = [_layout(d, ranges, n, r, params, prepared[r][0], 1, 2) for r, d in enumerate(docs)]
    received = {}
    for r, plan in enumerate(plans):
        lo = r * n
        for call in plan.home:
            assert call.q == call.kv and 0 <= call.q.start < call.q.stop <= n
        for a in plan.away:
            pieces = sorted([a.own] + [rows for _, rows in a.sources], key=lambda x: x.start)
            assert pieces[0].start == a.keys.start and pieces[-1].stop == a.keys.stop
            assert all(x.stop == y.start for x, y in zip(pieces[:-1], pieces[1:]))
            assert not (r * n <= a.keys.start and a.keys.stop <= (r + 1) * n), "a home document made away"
            first_q, last_q = lo + a.call.q.start, lo + a.call.q.stop - 1
            right = params.window_right
            assert right < 0 or a.keys.stop - 1 <= last_q + right  # the last key is seen
            assert wl < 0 or a.keys.start >= first_q - wl  # and the first
            for p, rows in a.sources:
                received.setdefault((p, r), []).append((rows.start, rows.stop))
    sent = {(p, r): [(p * n + rows.start, p * n + rows.stop)] for p, plan in enumerate(plans)
            for r, rows in plan.exports}
    assert sent == received


def _global_mask(seqlen, window):
    wl, wr = window
    i, j = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    seen = torch.ones(seqlen, seqlen, dtype=torch.bool)
    if wr >= 0:
        seen &= j <= i + wr
    if wl >= 0:
        seen &= j >= i - wl
    return seen


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 0), (0, 3), (2, 5), (7, -1), (-1, 1), (0, 0)])
def test_plans_cover_the_mask_exactly(world, zigzag, window):
    """The calls of every (rank, src), each masked the way the backend masks (bottom-right aligned,
    the moved window), tile the global mask with no overlap; with zigzag and a causal mask every
    rank computes the same number of score entries; a (rank, src) that sees nothing has no call."""
    from tileattn.distributed.plan import dense_pairs
    from tileattn.contract import AttnParams

    local = 6
    seqlen = local * world
    params = AttnParams(softmax_scale=1.0, window_left=window[0], window_right=window[1])
    pos = torch.arange(seqlen).view(1, seqlen)
    shard = zigzag_shard if zigzag else contiguous_shard
    rows = [shard(pos, r, world)[0] for r in range(world)]  # global positions held by each rank
    covered = torch.zeros(seqlen, seqlen, dtype=torch.int64)
    work = []
    for rank in range(world):
        entries = 0
        for src in range(world):
            for pair in dense_pairs(rank, src, world, local, params, zigzag):
                qi, kj = rows[rank][pair.q], rows[src][pair.kv]
                off = len(kj) - len(qi)
                il, jl = torch.arange(len(qi))[:, None], torch.arange(len(kj))[None, :]
                seen = torch.ones(len(qi), len(kj), dtype=torch.bool)
                if pair.params.window_right >= 0:
                    seen &= jl <= il + off + pair.params.window_right
                if pair.params.window_left >= 0:
                    seen &= jl >= il + off - pair.params.window_left
                assert seen.any(), "a call that sees nothing should not be made"
                covered[qi[:, None], kj[None, :]] += seen.long()
                entries += len(qi) * len(kj)
        work.append(entries)
    assert torch.equal(covered, _global_mask(seqlen, window).long())
    if zigzag and window == (-1, 0):
        assert len(set(work)) == 1, work


def test_bad_input_raises_before_any_communication():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match="even"):
        zigzag_ring_flash_attn_func(q[:, :7], k[:, :7], v[:, :7])
    with pytest.raises(ValueError, match="seqlen_local"):
        ring_flash_attn_func(q, k[:, :6], v[:, :6])
    with pytest.raises(TypeError, match="dtype"):
        ring_flash_attn_func(q, k.double(), v)
    with pytest.raises(ValueError, match="multiple"):
        ring_flash_attn_func(torch.randn(1, 8, 3, 16, generator=g), k, v)
    with pytest.raises(TypeError, match="causal"):
        ring_flash_attn_func(q, k, v, causal=1)
    with pytest.raises(ValueError, match="window_size"):
        zigzag_ring_flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match="kv must be"):
        ring_flash_attn_kvpacked_func(q, k)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_flash_attn_func(q, k, v, causal=True)
    # what dist.new_group returns on a rank outside the group (an int: was reported as 'got int')
    with pytest.raises(ValueError, match="not a member of group"):
        zigzag_ring_flash_attn_func(q, k, v, causal=True, group=dist.GroupMember.NON_GROUP_MEMBER)
    packed = q[0]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="even"):
        zigzag_ring_flash_attn_varlen_func(packed, packed, packed, cu, 5)
    with pytest.raises(RuntimeError, match="init_process_group"):  # dropout taken, the missing group refused
        ring_flash_attn_varlen_func(packed, packed, packed, cu, 5, dropout_p=0.1)
    with pytest.raises(ValueError, match="heads_k_stride"):
        llama3_flash_attn_varlen_func(packed, packed, packed, cu, cu, 5, 5, 3, slice(0, 8))
    with pytest.raises(ValueError, match="not a member of group"):
        llama3_flash_attn_varlen_func(packed, packed, packed, cu, cu, 5, 5, 1, slice(0, 8),
                                      group=dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(ValueError, match="not a member of group"):
        ring_flash_attn_varlen_func(packed, packed, packed, cu, 5, group=dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(ValueError, match="divisible"):
        zigzag_shard(q[:, :7], 0, 2)
    with pytest.raises(ValueError, match="rank"):
        contiguous_shard(q, 2, 2)
    with pytest.raises(ValueError, match="divisible by 4"):
        zigzag_shard_varlen(packed, cu, 0, 2)
    with pytest.raises(ValueError, match="divisible by world_size"):
        llama3_flash_attn_prepare_cu_seqlens(torch.tensor([0, 3, 7], dtype=torch.int32), True, 0, 2)


def test_llama3_dropout_needs_the_global_offsets():
    """With dropout, llama3 needs the global cu_seqlens (the document indices its mask hashes) and
    checks that they hold each local sequence; each sequence's document and position come from them."""
    from tileattn.contract import AttnParams
    from tileattn.distributed.llama3 import _documents, _global_offsets

    cu = torch.tensor([0, 5, 5, 22, 23, 32], dtype=torch.int32)  # documents 5, 0, 17, 1, 9 on 2 ranks
    with pytest.raises(ValueError, match="dropout_p > 0 needs cu_seqlens"):
        _global_offsets(None, 32, cu.device, 0.1)
    assert _global_offsets(None, 32, cu.device, 0.0) is None
    assert _global_offsets(cu, 32, cu.device, 0.0) is None  # checked, not needed
    with pytest.raises(ValueError, match="end at the 30"):
        _global_offsets(cu, 30, cu.device, 0.1)
    with pytest.raises(TypeError, match="int32"):
        _global_offsets(cu.long(), 32, cu.device, 0.1)
    bounds = _global_offsets(cu, 32, cu.device, 0.1)
    params = AttnParams(softmax_scale=1.0, window_right=0, dropout_p=0.1)
    cu_q, cu_k, _, _, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, True, 1, 2)
    docs = _documents(16, 1, cu_q, cu_k, k_slice, params, False, bounds)
    assert [(b, doc, pos) for b, _, _, doc, pos in docs] == [(0, 2, 11), (1, 3, 0), (2, 4, 0)]
    with pytest.raises(ValueError, match="not within one document"):
        _documents(16, 1, cu_q, cu_k, k_slice, params, False, [0, 20, 32])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_transfers_carry_only_what_is_read(world):
    """Causal contiguous shards: no transfer to a rank before the owner; causal zigzag: the first
    half of a shard travels to the ranks after its owner, all of it to those before; a window
    reaching less than one shard: one step, the rows within reach."""
    from tileattn.contract import AttnParams
    from tileattn.distributed.engine import _span

    causal = AttnParams(softmax_scale=1.0, window_right=0)
    local = 8
    contiguous, zigzag = DensePlan(world, local, causal, zigzag=False), DensePlan(world, local, causal, zigzag=True)
    for rank in range(world):
        for src in range(world):
            assert (_span(contiguous.calls(rank, src), local) is None) == (src > rank)
            want = slice(0, local // 2) if src < rank else slice(0, local)
            assert _span(zigzag.calls(rank, src), local) == want
    window = DensePlan(world, local, AttnParams(softmax_scale=1.0, window_left=3, window_right=0), zigzag=False)
    assert window.steps(world) == [0, 1]
    assert _span(window.calls(1, 0), local) == slice(local - 3, local)


# ----------------------------------------------------------------------------- ranks that disagree


def _disagreements(rank: int, world: int):
    """[(name, call)]: calls whose inputs differ across the ranks, or that only one rank refuses."""
    g = torch.Generator().manual_seed(rank)
    last = rank == world - 1

    def dense(seqlen=4, heads_k=2, causal=True, fn=ring_flash_attn_func):
        q = torch.randn(1, seqlen, 2, 8, generator=g)
        k, v = (torch.randn(1, seqlen, heads_k, 8, generator=g) for _ in range(2))
        return lambda: fn(q, k, v, causal=causal)

    def zigzag_varlen(cu):
        q, k, v = (torch.randn(8, 2, 8, generator=g) for _ in range(3))
        return lambda: zigzag_ring_flash_attn_varlen_func(q, k, v, torch.tensor(cu, dtype=torch.int32), 6, causal=True)

    def llama3(rows=8, causal=True, alibi=False):
        cu = torch.tensor([0, 5, rows * world], dtype=torch.int32)
        q, k, v = (torch.randn(rows, 2, 8, generator=g) for _ in range(3))
        if rows != 8:  # the offsets of 8 rows a rank: a rank with another count is refused by the others
            cu = torch.tensor([0, 5, 8 * world], dtype=torch.int32)
        cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        if rows != 8:
            cu_q = torch.tensor([0, rows], dtype=torch.int32)
            cu_k, max_q, max_k, k_slice = cu_q, rows, rows, slice(rank * rows, (rank + 1) * rows)
        slopes = torch.full((2,), 0.25) if alibi else None
        return lambda: llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=causal,
                                                     alibi_slopes=slopes)

    return [
        ("seqlen_local differs", dense(seqlen=6 if last else 4)),
        ("nheads_k differs", dense(heads_k=1 if last else 2, fn=zigzag_ring_flash_attn_func)),
        ("window_right differs", dense(causal=not last)),
        ("cu_seqlens differs", zigzag_varlen([0, 2, 8] if last else [0, 4, 8])),
        # odd local lengths on the last rank only: it says why, the others that it refused
        ("must be even" if last else "refused their inputs", zigzag_varlen([0, 3, 8] if last else [0, 4, 8])),
        ("total_local differs", llama3(rows=6 if last else 8)),
        # ALiBi with causal=False: only the ranks whose first document's keys run past their rows refuse
        (None, llama3(causal=False, alibi=True)),
    ]


def _disagree_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    results = []
    for expected, call in _disagreements(rank, world):
        try:
            call()
            results.append((expected, "no exception"))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append((expected, f"{type(e).__name__}: {e}"))
    # the group is still usable: a valid call after all those refused
    g = torch.Generator().manual_seed(11)
    whole = [torch.randn(1, 4 * world, 2, 8, generator=g) for _ in range(3)]
    out = ring_flash_attn_func(*(contiguous_shard(t, rank, world) for t in whole), causal=True)
    ref = contiguous_shard(flash_attn_func(*whole, causal=True), rank, world)
    results.append(("valid call", float((out - ref).abs().max())))
    with open(f"{result_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_all_raise(world, tmp_path):
    """Shapes or options that differ across the ranks, or inputs that one rank refuses, raise a
    ValueError on EVERY rank before the ring exchanges anything (one small all-gather of each
    rank's call signature and verdict), instead of a hang, a gloo size mismatch or, with local
    offsets that differ, silently wrong outputs; the group stays usable."""
    ctx = mp.start_processes(_disagree_worker, args=(world, str(tmp_path / "pg"), str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 150
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ranks that disagree: a world of {world} did not finish (hang)")
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, results in enumerate(per_rank):
        *refused, (_, err) = results
        for expected, got in refused:
            assert got.startswith(("ValueError", "NotImplementedError")), f"rank {r}, {expected}: {got}"
            assert expected is None or expected in got, f"rank {r}: expected {expected!r}, got {got}"
        assert err < 1e-5, f"rank {r}: the valid call after the refused ones is off by {err}"
    alibi = [results[-2][1] for results in per_rank]  # its own reason where a rank refused, else the others'
    assert any("keys may not run past" in x for x in alibi) and all(
        "keys may not run past" in x or "refused their inputs" in x for x in alibi), alibi
