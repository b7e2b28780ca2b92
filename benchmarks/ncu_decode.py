"""One decoding step for Nsight Compute: batch 1, GQA 32/8, hdim 128, bf16, a contiguous cache.

    ncu --clock-control none --kernel-name regex:'_attn_fwd|_combine' --launch-skip 4 \\
        --launch-count 2 --set detailed python benchmarks/ncu_decode.py [KV_LEN]

Three calls of two kernels each (split, combine): the profile skips the first two calls
(compilation) and reads the third.
"""

import sys

import torch

import tileattn

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(1, n, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lengths = torch.full((1,), n, dtype=torch.int32, device="cuda")
for _ in range(3):
    tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
torch.cuda.synchronize()
