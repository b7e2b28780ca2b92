#!/usr/bin/env bash
# The one command for the GPU machine:  bash benchmarks/run_gpu.sh [--quick] [--no-tests]
#
# 1. the GPU tests (pytest -m gpu -x -q tests), output in $OUT/gpu_tests.log;
# 2. benchmarks/prefill.py, decode.py, window.py, all output appended to $OUT/bench.log,
#    each writing <name>.csv and <name>.png into $OUT (8 files at most in all), and
#    decode.py --quick --l2 read (the L2 cleared by a read, not by writing zeros) into
#    $OUT/l2read;
# 3. benchmarks/summary.py: the short combined table, printed last.
#
# A failing or timed-out step never stops the next one. Every step runs under `timeout`,
# cut so that the whole run ends within BUDGET_S seconds (default 570: a device call may
# last 600 s); CSVs are rewritten after every case, so a step cut short keeps its results.
# Environment: OUT (default bench_out), PYTHON (default python), BUDGET_S, TEST_TIMEOUT_S,
# PREFILL_TIMEOUT_S, DECODE_TIMEOUT_S, WINDOW_TIMEOUT_S, BENCH_ARGS (extra arguments for
# every benchmark, e.g. BENCH_ARGS=--smoke to try this script on a machine without a GPU).
set -uo pipefail  # no -e: one failing benchmark must not stop the others

cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TRITON_PRINT_AUTOTUNING="${TRITON_PRINT_AUTOTUNING:-1}"  # which tile each shape class got, in bench.log
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench_out}"
PY="${PYTHON:-python}"
BUDGET_S="${BUDGET_S:-570}"
BENCH_ARGS="${BENCH_ARGS:-}"
QUICK=""
TESTS=1
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK="--quick" ;;
    --no-tests) TESTS=0 ;;
    *) echo "usage: bash benchmarks/run_gpu.sh [--quick] [--no-tests]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
: > "$OUT/bench.log"
STATUS=()

# seconds a step may take: what it asks for, but never past the budget (less a reserve
# for the steps after it and the summary)
allowed() {
  local want=$1 reserve=$2
  local left=$((BUDGET_S - SECONDS - reserve))
  ((left < want)) && want=$left
  echo "$want"
}

run_step() {  # name, timeout, log, command...
  local name=$1 limit=$2 log=$3
  shift 3
  if ((limit < 20)); then
    echo "=== $name: skipped, the time budget is spent ===" | tee -a "$log"
    STATUS+=("$name=skipped")
    return
  fi
  echo "=== $name (timeout ${limit}s, at ${SECONDS}s) ===" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=$?
  ((rc == 124)) && echo "=== $name: timed out after ${limit}s ===" | tee -a "$log"
  STATUS+=("$name=rc$rc")
}

if [[ -n "$QUICK" ]]; then
  T_TEST=${TEST_TIMEOUT_S:-150} T_PRE=${PREFILL_TIMEOUT_S:-120} T_DEC=${DECODE_TIMEOUT_S:-60} T_WIN=${WINDOW_TIMEOUT_S:-60}
else
  T_TEST=${TEST_TIMEOUT_S:-180} T_PRE=${PREFILL_TIMEOUT_S:-300} T_DEC=${DECODE_TIMEOUT_S:-100} T_WIN=${WINDOW_TIMEOUT_S:-100}
fi

"$PY" - <<'EOF' | tee -a "$OUT/bench.log"
import torch, triton
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE"
print(f"device {name} · torch {torch.__version__} (CUDA {torch.version.cuda}) · triton {triton.__version__}")
EOF

if ((TESTS)); then
  : > "$OUT/gpu_tests.log"
  run_step "gpu-tests" "$(allowed "$T_TEST" 120)" "$OUT/gpu_tests.log" "$PY" -m pytest -m gpu -x -q tests
fi
run_step "prefill" "$(allowed "$T_PRE" 90)" "$OUT/bench.log" "$PY" benchmarks/prefill.py $QUICK $BENCH_ARGS --out "$OUT"
run_step "decode" "$(allowed "$T_DEC" 50)" "$OUT/bench.log" "$PY" benchmarks/decode.py $QUICK $BENCH_ARGS --out "$OUT"
mkdir -p "$OUT/l2read"
run_step "decode-l2read" "$(allowed 60 40)" "$OUT/bench.log" "$PY" benchmarks/decode.py --quick --l2 read $BENCH_ARGS \
  --out "$OUT/l2read"
run_step "window" "$(allowed "$T_WIN" 10)" "$OUT/bench.log" "$PY" benchmarks/window.py $QUICK $BENCH_ARGS --out "$OUT"

"$PY" benchmarks/summary.py "$OUT" "${STATUS[@]}" "total=${SECONDS}s" 2>&1 | tee -a "$OUT/bench.log"
