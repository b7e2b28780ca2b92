#!/usr/bin/env bash
# Ring attention across the GPUs of one host:  bash benchmarks/run_ring_gpus.sh
#
# 1. benchmarks/ring.py under torchrun on every GPU: a correctness check of the public ring
#    (forward and gradients) against one GPU, then per-GPU TFLOP/s of the ring against one
#    GPU at the same per-GPU length, and how much of the communication is hidden;
# 2. the NCCL cases of tests/test_ring.py on min(4, GPUs) spawned ranks (forward, LSE and
#    gradients against the single-process result under the tolerance rule), log in
#    $OUT/ring_nccl.log. Second, so that its fresh processes find the kernels step 1 compiled
#    in Triton's disk cache (on a fresh machine, compiling alone outlasted a 170 s limit).
# Environment: OUT (default bench_out), PYTHON (default python), TOKENS (default "8192 16384").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench_out}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
echo "=== benchmarks/ring.py on $GPUS GPUs ==="
# shellcheck disable=SC2086
timeout 150 torchrun --nproc_per_node "$GPUS" benchmarks/ring.py --tokens ${TOKENS:-8192 16384} --reps 5 2>&1 \
  | tee "$OUT/ring_bench.log" | grep -v "^W\|^\*\*\*" | tail -n 10
echo "=== ring NCCL tests on $GPUS GPUs ==="
TILEATTN_AUTOTUNE=0 timeout 240 "$PY" -m pytest -q -p no:cacheprovider -k nccl tests/test_ring.py > "$OUT/ring_nccl.log" 2>&1
echo "ring NCCL tests rc=$?"
tail -n 3 "$OUT/ring_nccl.log"
