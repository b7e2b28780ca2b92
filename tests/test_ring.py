"""Ring attention on real gloo process groups (CPU) against the float64 reference.

Each world size (1, 2, 4) is spawned ONCE: its processes run every case and write what
failed to a file per rank, which the test of that world reads. A case
shards seeded full-sequence inputs, runs ``ring_flash_attn_func`` forward and backward on every
rank, and checks this rank's rows of out, lse, dq, dk, dv against the same rows of the float64
reference under the tolerance rule (tests/tolerance.py), the budget set by plain attention
in the same dtype on the whole sequence.
"""

from __future__ import annotations

import json
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tolerance import GRAD_FACTOR, assert_within, plain_attention

from tileattn.distributed import (
    contiguous_shard,
    contiguous_unshard,
    ring_flash_attn_func,
    zigzag_shard,
    zigzag_unshard,
)
from tileattn.distributed.ring import _block
from tileattn.reference import attention_naive, attention_naive_grad

WORLD_SIZES = (1, 2, 4)
SPAWN_DEADLINE_S = 180

# seqlen is the LOCAL length per rank; "views" passes non-contiguous (transposed) shards;
# "pairs" (world 4 only) runs two independent rings of 2 ranks on sub-groups.
CASES = {
    "full-zigzag-gqa": dict(causal=False, layout="zigzag", dtype="float32", batch=2, seqlen=10, heads=(4, 2), hdim=16),
    "causal-zigzag-mqa": dict(causal=True, layout="zigzag", dtype="float32", batch=2, seqlen=14, heads=(4, 1), hdim=16),
    "full-contiguous": dict(causal=False, layout="contiguous", dtype="float32", batch=1, seqlen=13, heads=(2, 2), hdim=40),
    "causal-contiguous-scale": dict(causal=True, layout="contiguous", dtype="float32", batch=2, seqlen=13,
                                    heads=(4, 2), hdim=16, softmax_scale=0.3),
    "causal-zigzag-views": dict(causal=True, layout="zigzag", dtype="float32", batch=1, seqlen=74, heads=(2, 1),
                                hdim=80, views=True),
    "causal-zigzag-bf16": dict(causal=True, layout="zigzag", dtype="bfloat16", batch=1, seqlen=18, heads=(4, 2), hdim=40),
    "full-contiguous-bf16": dict(causal=False, layout="contiguous", dtype="bfloat16", batch=1, seqlen=11, heads=(2, 1),
                                 hdim=16),
    "causal-zigzag-pairs": dict(causal=True, layout="zigzag", dtype="float32", batch=1, seqlen=12, heads=(2, 2), hdim=16,
                                pairs=True),
}


def _cases_for(world: int):
    return [name for name, c in CASES.items() if not c.get("pairs") or world == 4]


# ----------------------------------------------------------------------------- one case, one rank


def _full_inputs(case, world: int, seed: int):
    """Seeded full-sequence q, k, v, dout (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    nheads, nheads_k = case["heads"]
    batch, seqlen, hdim = case["batch"], case["seqlen"] * world, case["hdim"]
    dtype = getattr(torch, case["dtype"])
    q = torch.randn(batch, seqlen, nheads, hdim, generator=g)
    k = torch.randn(batch, seqlen, nheads_k, hdim, generator=g)
    v = torch.randn(batch, seqlen, nheads_k, hdim, generator=g)
    dout = torch.randn(batch, seqlen, nheads, hdim, generator=g)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _local(x, rank, world, layout, views: bool, device):
    """This rank's shard of x on ``device``; with ``views`` a non-contiguous view (heads-first
    strides, padded rows) holding the same values."""
    shard = (zigzag_shard if layout == "zigzag" else contiguous_shard)(x, rank, world, dim=1).to(device)
    if views:
        batch, seqlen, nheads, hdim = shard.shape
        padded = torch.full((batch, nheads, seqlen, hdim + 8), float("nan"), dtype=shard.dtype, device=device)
        padded[..., :hdim] = shard.transpose(1, 2)
        shard = padded[..., :hdim].transpose(1, 2)  # (B, S, H, D) view
        assert not shard.is_contiguous()
    return shard.detach().requires_grad_()


def _run_case(name: str, rank: int, world: int, group, device) -> None:
    case = CASES[name]
    causal, layout, views = case["causal"], case["layout"], case.get("views", False)
    q, k, v, dout = _full_inputs(case, world, seed=list(CASES).index(name))
    scale = case.get("softmax_scale")
    lq, lk, lv = (_local(t, rank, world, layout, views, device) for t in (q, k, v))
    out, lse = ring_flash_attn_func(lq, lk, lv, causal=causal, softmax_scale=scale, group=group,
                                    return_lse=True, layout=layout)
    out.backward(_local(dout, rank, world, layout, False, device))

    ref_out, ref_lse = attention_naive(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                       causal=causal, softmax_scale=scale)
    ref_grads = attention_naive_grad(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                     dout.double().numpy(), causal=causal, softmax_scale=scale)
    pq, pk, pv = (t.clone().requires_grad_() for t in (q, k, v))
    plain_out, plain_lse = plain_attention(pq, pk, pv, causal=causal, softmax_scale=scale)
    plain_grads = torch.autograd.grad(plain_out, (pq, pk, pv), dout)

    def mine(x, dim=1):
        return (zigzag_shard if layout == "zigzag" else contiguous_shard)(torch.as_tensor(x), rank, world, dim=dim)

    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_within(f"{name} out", out, mine(plain_out.detach()), mine(ref_out))
    assert_within(f"{name} lse", lse, mine(plain_lse.detach(), 2), mine(ref_lse, 2))
    for label, got, plain, ref in zip(("dq", "dk", "dv"), (lq.grad, lk.grad, lv.grad), plain_grads, ref_grads):
        assert got.dtype == q.dtype
        assert_within(f"{name} {label}", got, mine(plain), mine(ref), factor=GRAD_FACTOR)


def _worker(rank: int, world: int, init_file: str, result_dir: str, device_type: str) -> None:
    torch.set_num_threads(1)
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    failures = {}
    # new_group must be entered by every rank, in the same order.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None
    for name in _cases_for(world):
        pair_case = CASES[name].get("pairs", False)
        group = pairs[rank // 2] if pair_case else None
        try:
            _run_case(name, rank % 2 if pair_case else rank, 2 if pair_case else world, group, device)
            failures[name] = None
        except Exception:  # recorded and reported by the pytest test of this case
            failures[name] = traceback.format_exc()
    with open(f"{result_dir}/rank{rank}.json", "w") as f:
        json.dump(failures, f)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- spawning


def _spawn(world: int, device_type: str, tmp) -> list[dict]:
    """Run every case on ``world`` fresh processes; per rank {case: traceback or None}."""
    ctx = mp.start_processes(_worker, args=(world, str(tmp / "pg"), str(tmp), device_type), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ring of {world} processes did not finish in {SPAWN_DEADLINE_S} s (hang?)")
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
def test_ring_on_nccl_matches_reference(tmp_path):
    """The same cases on the GPUs of this host (NCCL, the Triton backend), up to 4 ranks."""
    _assert_all_passed(_spawn(min(4, torch.cuda.device_count()), "cuda", tmp_path))


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


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_blocks_cover_the_causal_mask_exactly(world, layout):
    """The blocks of every (rank, step) tile the global causal mask with no overlap, and with
    zigzag every rank computes the same number of score entries."""
    chunk = 3
    seqlen_local = 2 * chunk
    seqlen = seqlen_local * world
    pos = torch.arange(seqlen).view(1, seqlen)
    shard = zigzag_shard if layout == "zigzag" else contiguous_shard
    rows = [shard(pos, r, world)[0] for r in range(world)]  # global positions held by each rank
    covered = torch.zeros(seqlen, seqlen, dtype=torch.int64)
    work = []
    for rank in range(world):
        entries = 0
        for src in range(world):
            blk = _block(rank, src, seqlen_local, True, layout)
            if blk is None:
                continue
            qi, kj = rows[rank][blk.q], rows[src][blk.kv]
            seen = torch.ones(len(qi), len(kj), dtype=torch.bool)
            if blk.causal:
                assert len(qi) == len(kj)
                seen = torch.ones_like(seen).tril()
            covered[qi[:, None], kj[None, :]] += seen.long()
            entries += len(qi) * len(kj)
        work.append(entries)
    assert torch.equal(covered, torch.ones(seqlen, seqlen, dtype=torch.int64).tril())
    if layout == "zigzag":
        assert len(set(work)) == 1, work


def test_bad_input_raises_before_any_communication():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match="layout"):
        ring_flash_attn_func(q, k, v, layout="ring")
    with pytest.raises(ValueError, match="even"):
        ring_flash_attn_func(q[:, :7], k[:, :7], v[:, :7], layout="zigzag")
    with pytest.raises(ValueError, match="seqlen_local"):
        ring_flash_attn_func(q, k[:, :6], v[:, :6])
    with pytest.raises(TypeError, match="dtype"):
        ring_flash_attn_func(q, k.double(), v)
    with pytest.raises(ValueError, match="multiple"):
        ring_flash_attn_func(torch.randn(1, 8, 3, 16, generator=g), k, v)
    with pytest.raises(TypeError, match="causal"):
        ring_flash_attn_func(q, k, v, causal=1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_flash_attn_func(q, k, v, causal=True)
    with pytest.raises(ValueError, match="divisible"):
        zigzag_shard(q[:, :7], 0, 2)
    with pytest.raises(ValueError, match="rank"):
        contiguous_shard(q, 2, 2)
