# attnchat: `make run` starts the app, `make test` runs the suite headless.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv run test model clean lint

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

clean:
	rm -rf $(VENV) build *.egg-info
