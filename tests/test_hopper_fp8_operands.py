"""The Gluon FP8 decode's operand conversions alone (tests/hopper_fp8_operands.py, #19): fp8 K and V
tiles as fp16 register A operands of wgmma.

On the GPU (marker ``gpu``): S^T = K Q^T and O^T = V^T P^T against torch, with random values
(fp32 accumulation in another order than torch's: atol = rtol = 1e-4, where a wrong column
relabelling errs by O(1)) and exactly with one-hot Q / P rows that pick single columns / keys of
tiles holding every finite e4m3 byte (the conversion of each byte and the position it lands in).
Without a GPU: the index algebra of the relabellings mirrored in torch, and the offline sm_90
compile (every mechanism's SASS has no shuffle, the fp16 A operand is converted in registers).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
# the finite e4m3 bytes (0x7f and 0xff are NaN), tiled over a 64 x 128 tile in a scrambled order
_BYTES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


def _all_bytes_tile(seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(_BYTES), (64 * 128,), generator=g)
    idx[: len(_BYTES)] = torch.randperm(len(_BYTES), generator=g)  # every byte at least once
    return _BYTES[idx].view(torch.float8_e4m3fn).reshape(64, 128)


# ------------------------------------------------------------------ index algebra, no GPU


def _logical_col(kk):  # mirrors hopper_fp8_operands._logical_col
    return (kk // 16) * 16 + ((kk // 2) % 4) * 4 + ((kk // 8) % 2) * 2 + kk % 2


def _physical_d(dl):  # mirrors hopper_fp8_operands._physical_d
    bits = (2, 3, 4, 0, 5, 6, 1)
    return sum(((dl >> i) & 1) << b for i, b in enumerate(bits))


def test_k_relabelling_is_a_permutation_q_follows():
    k, q = torch.randn(64, 128, dtype=torch.float64), torch.randn(8, 128, dtype=torch.float64)
    kk = torch.arange(128)
    assert sorted(_logical_col(kk).tolist()) == list(range(128))
    # the kernel's chain: reshape [64, 8, 4, 2, 2], permute (0, 1, 3, 2, 4), reshape [64, 128]
    k_rel = k.reshape(64, 8, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(64, 128)
    assert torch.equal(k_rel, k[:, _logical_col(kk)])
    torch.testing.assert_close(k_rel @ q[:, _logical_col(kk)].T, k @ q.T)


def test_v_transpose_and_d_relabelling():
    v = torch.randn(64, 128, dtype=torch.float64)
    # what the inline asm leaves at tile position (key 2 kp + a, d 4 dq + 2 bh + bl):
    # V[2 kp + bl, 4 dq + 2 a + bh] (input element e = 4 a + 2 bh + bl of a pack holds V[k + a, d0 + 2 bh + bl])
    kp, a, dq, bh, bl = torch.meshgrid(*(torch.arange(n) for n in (32, 2, 32, 2, 2)), indexing="ij")
    t = v[2 * kp + bl, 4 * dq + 2 * a + bh]  # [32, 2, 32, 2, 2] = [64, 128] positions
    back = t.permute(0, 4, 2, 1, 3).reshape(64, 128)  # the kernel's _transpose_convert chain
    assert torch.equal(back, v)
    vt = back.T.reshape(2, 2, 2, 2, 2, 2, 2, 64).permute(5, 0, 1, 6, 2, 3, 4, 7).reshape(128, 64)  # _relabel_d
    dl = torch.arange(128)
    assert sorted(_physical_d(dl).tolist()) == list(range(128))
    assert torch.equal(vt, v.T[_physical_d(dl)])


def test_operands_compile_for_hopper_without_shuffles():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(HERE / "hopper_fp8_operands.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    lines = dict(line.split(" (", 1) for line in run.stdout.splitlines() if " (" in line)
    for name in ("st MECH 1", "st MECH 2", "ot TRIVIAL 1"):
        assert name in lines, run.stdout
        assert "'SHFL': 0" in lines[name] and "'STS': 1" in lines[name] and "'HGMMA': 8" in lines[name], lines[name]
    assert "'SHFL': 0" not in lines["st MECH 0"]  # the naive conversion moves data between threads


# ------------------------------------------------------------------ the GPU


def _operands():
    sys.path.insert(0, str(HERE))
    import hopper_fp8_operands

    return hopper_fp8_operands


@pytest.mark.gpu
@pytest.mark.parametrize("mech", [0, 1, 2, 3])
def test_st_random(mech):
    sp = _operands()
    g = torch.Generator().manual_seed(mech)
    k = torch.randn(64, 128, generator=g).to(torch.float16 if mech == 3 else torch.float8_e4m3fn)
    q = torch.randn(8, 128, generator=g).to(torch.float16)
    st = sp.st_product(k.cuda(), q.cuda(), mech).cpu()
    torch.testing.assert_close(st, k.float() @ q.float().T, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("mech", [1, 2])
def test_st_every_byte_exact(mech):
    sp = _operands()
    k = _all_bytes_tile(mech)
    for first in range(0, 128, 8):  # Q's row n picks K's column first + n
        q = torch.zeros(8, 128, dtype=torch.float16)
        q[torch.arange(8), first + torch.arange(8)] = 1
        st = sp.st_product(k.cuda(), q.cuda(), mech).cpu()
        assert torch.equal(st, k[:, first:first + 8].float()), first


@pytest.mark.gpu
def test_ot_random():
    sp = _operands()
    g = torch.Generator().manual_seed(7)
    v = torch.randn(64, 128, generator=g).to(torch.float8_e4m3fn)
    p = torch.rand(8, 64, generator=g).to(torch.float16)
    ot = sp.ot_product(v.cuda(), p.cuda()).cpu()
    torch.testing.assert_close(ot, v.float().T @ p.float().T, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_ot_every_byte_exact():
    sp = _operands()
    v = _all_bytes_tile(11)
    for first in range(0, 64, 8):  # P's row n picks V's key first + n
        p = torch.zeros(8, 64, dtype=torch.float16)
        p[torch.arange(8), first + torch.arange(8)] = 1
        ot = sp.ot_product(v.cuda(), p.cuda()).cpu()
        assert torch.equal(ot, v[first:first + 8].float().T), first
