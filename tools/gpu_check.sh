#!/usr/bin/env bash
# `make gpu-check`: the CUDA path on one GPU, in steps that each run as their own process under a time cap,
# so that a CUDA fault or a hang in one cannot take the others down, and every step leaves a result file
# with a status in $RESULTS_DIR (default bench/results):
#   wheels          import pytest, the gRPC stubs (protobuf) and grpc_health; install what fails from
#                   $GPU_WHEELS (`make gpu-wheels`, offline: pip --no-index --find-links)   wheels.log
#   smoke           compile the kernels with CuPy, one decode launch against the reference     smoke.json
#   kernels-check   nvcc or, without it, NVRTC: registers, spills, stack frames                kernels_check.json
#   tests-kernels   pytest tests/gpu/test_kernels.py                                           tests_kernels.xml
#   tests-model     pytest tests/gpu/test_model_gpu.py tests/gpu/test_cuda_graphs_gpu.py       tests_model.xml
#                   tests/gpu/test_sampler_gpu.py
#   kernel-bench    bench/kernel.py (rewrites kernel.json after every point)                   kernel.json
# plus gpu_check.log (everything printed) and gpu_check.json (each step's exit status, seconds and cap).
# The caps add up to under 8 minutes, kill grace included. Exit status 1 if any step fails.
# --dry-run (no CUDA needed): the smoke test and the benchmark only plan, the rest runs as it would
# (the GPU tests skip); tests/unit/test_gpu_check.py runs it.
# PYTHON picks the interpreter (default python3: on the GPU machines that is the one with CUDA torch).
set -u -o pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
GPU_WHEELS="${GPU_WHEELS:-.gpu-wheels}"
DRY_RUN=()
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=(--dry-run); fi
export RESULTS_DIR="${RESULTS_DIR:-bench/results}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$RESULTS_DIR"
LOG="$RESULTS_DIR/gpu_check.log"
SUMMARY="$RESULTS_DIR/gpu_check.json"
: > "$LOG"

# Seconds per step; KILL_GRACE after a cap before SIGKILL. 6 x 5 s of grace + 410 s of caps = 440 s < 480 s.
KILL_GRACE=5
CAP_WHEELS=30
CAP_SMOKE=30
CAP_KERNELS_CHECK=40
CAP_TESTS_KERNELS=105
CAP_TESTS_MODEL=105
CAP_BENCH=100
TOTAL_CAPS=$((CAP_WHEELS + CAP_SMOKE + CAP_KERNELS_CHECK + CAP_TESTS_KERNELS + CAP_TESTS_MODEL + CAP_BENCH + 6 * KILL_GRACE))
status=0
steps=()

echo "gpu-check ${DRY_RUN[*]:-}: 6 steps, caps $TOTAL_CAPS s in all (kill grace included)" | tee -a "$LOG"

step() {  # step NAME CAP COMMAND...
  local name=$1 cap=$2
  shift 2
  local started=$SECONDS
  echo "=== $name (cap ${cap}s, started $(date -u +%H:%M:%S)): $*" | tee -a "$LOG"
  timeout --kill-after="$KILL_GRACE" "$cap" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - started))
  echo "=== $name: exit $rc after ${took}s" | tee -a "$LOG"
  steps+=("{\"name\": \"$name\", \"exit\": $rc, \"seconds\": $took, \"cap_s\": $cap}")
  if [ "$rc" -ne 0 ]; then status=1; fi
}

# Installs, from the wheels folder, the distributions whose import fails; one line each in wheels.log.
install_missing() {
  local report="$RESULTS_DIR/wheels.log"
  : > "$report"
  local failed=0
  while read -r module distribution options; do
    if "$PYTHON" -c "import $module" 2>/dev/null; then
      echo "$module: importable" | tee -a "$report"
    elif PIP_BREAK_SYSTEM_PACKAGES=1 "$PYTHON" -m pip install -q --no-index --find-links "$GPU_WHEELS" $options "$distribution" \
        && "$PYTHON" -c "import $module"; then
      echo "$module: installed $distribution from $GPU_WHEELS" | tee -a "$report"
    else
      echo "$module: MISSING, and $distribution did not install from $GPU_WHEELS" | tee -a "$report"
      failed=1
    fi
  done <<'MODULES'
pytest pytest
pagedserve.v1.common_pb2 protobuf>=5.27.2,<7
grpc_health.v1.health_pb2 grpcio-health-checking --no-deps
MODULES
  return "$failed"
}
export -f install_missing
export PYTHON GPU_WHEELS

step wheels "$CAP_WHEELS" bash -c install_missing
step smoke "$CAP_SMOKE" "$PYTHON" tools/gpu_smoke.py "${DRY_RUN[@]}"
step kernels-check "$CAP_KERNELS_CHECK" "$PYTHON" tools/kernels_check.py --json "$RESULTS_DIR/kernels_check.json"

pytest_step() {  # pytest_step NAME CAP XML FILES...: the session stops starting tests 15 s before the cap
  local name=$1 cap=$2 xml=$3
  shift 3
  PAGEDSERVE_TEST_DEADLINE=$(($(date +%s) + cap - 15)) step "$name" "$cap" "$PYTHON" -m pytest "$@" -q -m gpu \
    -p no:cacheprovider -rfE --durations=15 -o faulthandler_timeout=60 --junitxml="$RESULTS_DIR/$xml"
}
pytest_step tests-kernels "$CAP_TESTS_KERNELS" tests_kernels.xml tests/gpu/test_kernels.py
pytest_step tests-model "$CAP_TESTS_MODEL" tests_model.xml tests/gpu/test_model_gpu.py tests/gpu/test_cuda_graphs_gpu.py \
    tests/gpu/test_sampler_gpu.py
step kernel-bench "$CAP_BENCH" "$PYTHON" bench/kernel.py --budget $((CAP_BENCH - 20)) "${DRY_RUN[@]}"

if [ "$status" -eq 0 ]; then verdict=passed; else verdict=failed; fi
joined=$(IFS=,; echo "${steps[*]}")
echo "{\"status\": \"$verdict\", \"dry_run\": $([ ${#DRY_RUN[@]} -gt 0 ] && echo true || echo false), \"total_caps_s\": $TOTAL_CAPS, \"seconds\": $SECONDS, \"steps\": [$joined]}" > "$SUMMARY"
echo "gpu-check $verdict in ${SECONDS}s; log $LOG, summary $SUMMARY" | tee -a "$LOG"
exit "$status"
