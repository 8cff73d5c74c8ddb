#!/usr/bin/env bash
# `make gpu-check`: kernels-check, the GPU tests and the kernel benchmark, each under a time cap so that the
# whole run stays within 8 minutes on an H200. Results and a log go to $RESULTS_DIR (default bench/results):
# gpu_check.log, kernels_check.json, gpu_tests.xml (JUnit), kernel.json. Exit status 1 if any step fails
# (without a CUDA device the tests skip and the benchmark fails, so the check fails).
# PYTHON picks the interpreter (default python3: on the GPU machines that is the one holding CUDA torch).
set -u -o pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export RESULTS_DIR="${RESULTS_DIR:-bench/results}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RESULTS_DIR"
LOG="$RESULTS_DIR/gpu_check.log"
: > "$LOG"
status=0

step() {  # step SECONDS NAME COMMAND...
  local limit=$1 name=$2
  shift 2
  echo "=== $name (cap ${limit}s, started $(date -u +%H:%M:%S)): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc" | tee -a "$LOG"
  if [ "$rc" -ne 0 ]; then status=1; fi
}

"$PYTHON" - <<'PY' 2>&1 | tee -a "$LOG"
import torch
try:
    import cupy
    cupy_version = cupy.__version__
except Exception as exc:
    cupy_version = f"not importable ({exc})"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cupy {cupy_version}, {gpu}")
PY

step 60 kernels-check "$PYTHON" tools/kernels_check.py --json "$RESULTS_DIR/kernels_check.json"
step 270 gpu-tests "$PYTHON" -m pytest tests/gpu -q -m gpu -p no:cacheprovider --junitxml="$RESULTS_DIR/gpu_tests.xml"
# The benchmark keeps its own 100 s budget (headline point and the executor end to end first, then the sweep).
step 120 kernel-bench "$PYTHON" bench/kernel.py

if [ "$status" -eq 0 ]; then verdict=passed; else verdict=FAILED; fi
echo "gpu-check $verdict; log in $LOG" | tee -a "$LOG"
exit "$status"
