# Two entry points: `make train` (the main job on its embedded default) and `make test` (the test suite).
# Each creates the virtual environment it needs on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c .ci/constraints.txt -e '.[dev]' --config-settings editable_mode=compat
	touch $@

.PHONY: install train test test-slow benchmark
install: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) recipes/train.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

# The matrix cells CI leaves out (marked `slow`).
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow $(ARGS)

benchmark: $(VENV)/.installed
	$(PY) recipes/benchmark.py $(ARGS)
