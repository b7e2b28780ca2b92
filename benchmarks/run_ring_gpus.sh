#!/usr/bin/env bash
# Context parallelism across the GPUs of one host:  bash benchmarks/run_ring_gpus.sh
#
# 1. benchmarks/ring.py under torchrun on every GPU, zigzag (dense): a correctness check of the
#    public ring (forward and gradients) against one GPU, then per-GPU TFLOP/s of the ring
#    against one GPU at the same per-GPU length, and the share of the transfer hidden (fwd,
#    fwd+bwd), then the same figures MODELLED for 4 and 8 GPUs from this run's columns
#    (--model-world, formula in benchmarks/ring.py model_world); log in $OUT/ring_bench.log;
# 2. the same with --varlen llama3 (documents of 1k-16k packed into 32k tokens per GPU, causal),
#    log in $OUT/ring_llama3.log;
# 3. the NCCL cases of tests/test_ring.py on min(4, GPUs) spawned ranks (forward, LSE and
#    gradients against the single-process result under the tolerance rule), log in
#    $OUT/ring_nccl.log. Last, so that its fresh processes find the kernels steps 1-2 compiled
#    in Triton's disk cache (on a fresh machine, compiling alone outlasted a 170 s limit).
# Environment: OUT (default bench_out), PYTHON (default python), TOKENS (default "8192 16384"),
# VARLEN_TOKENS (default 32768), STRIDE (llama3 heads_k_stride, default 4).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench_out}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
echo "=== benchmarks/ring.py (zigzag) on $GPUS GPUs ==="
# shellcheck disable=SC2086
timeout 170 torchrun --nproc_per_node "$GPUS" benchmarks/ring.py --tokens ${TOKENS:-8192 16384} --reps 5 \
  --model-world 4 8 2>&1 | tee "$OUT/ring_bench.log" | grep -v "^W\|^\*\*\*\|Warning\|warn" | tail -n 18
echo "=== benchmarks/ring.py --varlen llama3 on $GPUS GPUs ==="
timeout 170 torchrun --nproc_per_node "$GPUS" benchmarks/ring.py --varlen llama3 --tokens "${VARLEN_TOKENS:-32768}" \
  --heads-k-stride "${STRIDE:-4}" --reps 5 2>&1 | tee "$OUT/ring_llama3.log" | grep -v "^W\|^\*\*\*\|Warning\|warn" \
  | tail -n 5
echo "=== ring NCCL tests on $GPUS GPUs ==="
TILEATTN_AUTOTUNE=0 timeout 240 "$PY" -m pytest -q -p no:cacheprovider -k nccl tests/test_ring.py > "$OUT/ring_nccl.log" 2>&1
echo "ring NCCL tests rc=$?"
tail -n 3 "$OUT/ring_nccl.log"
