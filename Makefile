# attnchat: `make run` starts the app, `make test` runs the suite headless.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv run test model clean lint package package-smoke gpu-check

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

model: venv
	$(VENV)/bin/attnchat models fetch

run: model
	$(VENV)/bin/attnchat

lint: venv
	$(VENV)/bin/lint-imports

test: venv
	$(VENV)/bin/lint-imports
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q

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

clean:
	rm -rf $(VENV) build *.egg-info

# On a machine with an NVIDIA GPU: the GPU checks and the GPU benchmark in one command
# (under 5 minutes, nothing from the network). It runs with the Python that has torch
# there (PYTHON=...), and with random weights of the default model's shape when the
# model file is absent. See attnchat/gpu_check.py.
gpu-check:
	@$(PYTHON) -c "import torch, transformers, safetensors, platformdirs, numpy" || \
	  { echo "gpu-check needs torch, transformers, safetensors, platformdirs and numpy importable by $(PYTHON)"; exit 2; }
	PYTHONPATH=$(CURDIR) $(PYTHON) -m attnchat.gpu_check
