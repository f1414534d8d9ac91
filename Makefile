# attnchat: `make run` starts the app, `make test` runs the suite headless.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv run test model clean lint package package-smoke gpu-check bench-llamacpp

venv: $(STAMP)

$(STAMP): requirements.lock requirements-ggml.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet -r requirements-ggml.txt || \
	  echo "attnchat: ggml-python could not be built (it needs cmake and a C compiler); quantized GGUF files will run on torch's kernels (slower, more memory)"
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

model: venv
	$(VENV)/bin/attnchat models fetch

run: model
	$(VENV)/bin/attnchat

lint: venv
	$(VENV)/bin/lint-imports

# Two workers (pytest-xdist), a test file on one worker: the suite is mostly one-core work
# (imports, subprocesses, Qt, small models), so on 2 cores it takes about half the time
# (measured: 11.7 against 24 min at load 3-5). The default model is fetched first, once: the
# workers would otherwise download it side by side into the same part file. Files go out in the
# order tests/conftest.py sorts them (those with slow tests first), not xdist's most-tests-first.
TEST_WORKERS ?= 2

test: venv
	$(VENV)/bin/lint-imports
	$(PY) -c "from models import fetch; fetch.ensure_default()"
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40

# The packaged app: PyInstaller's one folder (dist/attnchat/, the default model inside),
# then dist/attnchat_<version>_<arch>.deb and dist/attnchat-<version>-linux-<arch>.tar.gz.
# Takes minutes, so it is not part of `make test` (which checks the spec and the control data).
PKG_STAMP := $(VENV)/.packaging-installed

$(PKG_STAMP): packaging/requirements-package.txt $(STAMP)
	$(PY) -m pip install --quiet -r packaging/requirements-package.txt
	touch $(PKG_STAMP)

package: model $(PKG_STAMP)
	$(PY) -m PyInstaller --noconfirm --clean --log-level WARN --distpath dist --workpath build/pyinstaller packaging/attnchat.spec
	$(PY) packaging/build_deb.py

# Unpack the .deb and run its --self-test offline with an empty HOME.
package-smoke:
	packaging/smoke_test.sh

# llama.cpp for `attnchat bench` only, in its own environment (.venv-llamacpp; the bench
# runs its llamacpp engine with that Python). Built from source for this CPU (about 8
# minutes on 2 quiet cores). Its AMX matrix path is compiled out: on an Intel Xeon with AMX
# the native build crashed in ggml_backend_amx_mul_mat. GCC's explicit -mno-*
# flags win over what -march=native turns on, whatever their order on the command line.
BENCH_VENV := .venv-llamacpp
BENCH_STAMP := $(BENCH_VENV)/.installed
LLAMACPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

bench-llamacpp: $(BENCH_STAMP)

$(BENCH_STAMP): bench/requirements-llamacpp.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	CFLAGS="$(LLAMACPP_NO_AMX)" CXXFLAGS="$(LLAMACPP_NO_AMX)" \
	$(BENCH_VENV)/bin/python -m pip install --quiet --no-cache-dir --no-binary llama-cpp-python -r bench/requirements-llamacpp.txt
	touch $(BENCH_STAMP)

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info

# On a machine with an NVIDIA GPU: the GPU checks and the GPU benchmark in one command
# (under 5 minutes, nothing from the network). It runs with the Python that has torch
# there (PYTHON=...), and with random weights of the default model's shape when the
# model file is absent. See attnchat/gpu_check.py.
gpu-check:
	@$(PYTHON) -c "import torch, transformers, safetensors, platformdirs, numpy" || \
	  { echo "gpu-check needs torch, transformers, safetensors, platformdirs and numpy importable by $(PYTHON)"; exit 2; }
	PYTHONPATH=$(CURDIR) $(PYTHON) -m attnchat.bench.gpu_check
