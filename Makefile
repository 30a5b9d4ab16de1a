# Two entry points: `make train` (the main job on its embedded default) and `make test` (the test suite); `make
# test-fast` runs the unit and configuration tests only (no process group), `make docs` builds the docs site.
# Each creates the virtual environment it needs on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# compat: the editable install that keeps conf/ -> lightning_par.conf and the hydra_plugins namespace working (the
	# default mode does not map conf/); setuptools' notice that the mode is transitional is silenced, nothing else
	PYTHONWARNINGS="ignore::Warning:setuptools.command.editable_wheel" \
	$(PY) -m pip install -q -c .ci/constraints.txt -e '.[dev]' --config-settings editable_mode=compat
	# LitGPT, the Fabric tests' second client: without its dependencies (it pins huggingface-hub<1.4, transformers 5
	# needs >=1.31; its model code runs with either), so it is not in the dev extra
	$(PY) -m pip install -q --no-deps 'litgpt==0.5.13' 'jsonargparse>=4.30'
	# litdata (data=litdata) without torchvision, which it requires but its streaming dataset does not use: the
	# registry's torchvision does not load with this CPU build of torch ("operator torchvision::nms does not exist")
	$(PY) -m pip install -q --no-deps 'litdata>=0.2.50' boto3 botocore s3transfer jmespath obstore tifffile
	touch $@

.PHONY: install train test test-fast test-slow benchmark docs
install: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) recipes/train.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)

# The unit and configuration tests (tests/unit, tests/config) without the few end-to-end runs among them: no
# multi-process world; 160 s on a fresh clone of the idle 2-core machine (README, "Set up and run").
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow and not e2e and not distributed" tests/unit tests/config $(ARGS)

# The matrix cells CI leaves out (marked `slow`).
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow $(ARGS)

benchmark: $(VENV)/.installed
	$(PY) recipes/benchmark.py $(ARGS)

# The documentation site (docs/ -> site/), strict: a broken link or anchor fails it (tests/unit/test_docs.py too).
docs: $(VENV)/.installed
	$(PY) -m mkdocs build --strict
