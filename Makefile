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
	# --no-compile, then the bytecode of every installed module on all cores (pip compiles one file after the other:
	# 55 s of this install on the 2-core machine; this way 20 + 22 s); a file that does not compile (torch ships one
	# in Python 3.12 syntax) is skipped, as pip skips it
	PYTHONWARNINGS="ignore::Warning:setuptools.command.editable_wheel" \
	$(PY) -m pip install -q --no-compile -c .ci/constraints.txt -e '.[dev]' --config-settings editable_mode=compat
	$(PY) -c "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_path('purelib'), quiet=2, workers=0)"
	# LitGPT, the Fabric tests' second client: without its dependencies (it pins huggingface-hub<1.4, transformers 5
	# needs >=1.31; its model code runs with either), so it is not in the dev extra
	$(PY) -m pip install -q -c .ci/constraints.txt --no-deps 'litgpt==0.5.13' 'jsonargparse>=4.30'
	# litdata (data=litdata) without torchvision, which it requires but its streaming dataset does not use: the
	# registry's torchvision does not load with this CPU build of torch ("operator torchvision::nms does not exist")
	$(PY) -m pip install -q -c .ci/constraints.txt --no-deps 'litdata>=0.2.50' boto3 botocore s3transfer jmespath \
	    obstore tifffile
	touch $@

.PHONY: install train test test-fast test-slow test-latest lock benchmark docs
install: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) recipes/train.py $(ARGS)

# Staged by marker (tests/ mirrors lightning_par/, the process kind is a marker: tests/README.md), in one pytest run
# (`--staged`, tests/conftest.py: one collection of the tree, not one per stage) that runs the stages in order and stops
# at the end of the first one with a failure: (1) every package module imports (seconds), (2) the tests without
# processes, (3) the distributed tests (gloo worlds; `gpu` ones skip without CUDA), (4) the end-to-end runs of the
# recipes; the 25 slowest tests and each stage's count and time are printed at the end. Together the stages run every
# test that is not `slow`, each once (tests/support/check_stages.py checks it).
# The tests run on WORKERS pytest-xdist workers (the 2-core machine's cores; `WORKERS=0` runs them in this process);
# under `--staged` the stages stay a barrier across the workers (tests/conftest.py).
WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
FAST := not slow and not e2e and not distributed and not gpu
# The tests start a few hundred interpreters (recipes, torchrun and Lightning's launcher, the README's examples):
# bytecode is written, so that this tree's modules (lightning_par/, recipes/, tests/) are compiled once, not in each of
# them, where the environment says not to (PYTHONDONTWRITEBYTECODE=1 on the 2-core machine).
test: export PYTHONDONTWRITEBYTECODE =
test: $(VENV)/.installed
	$(PYTEST) --staged -n $(WORKERS) --durations=25 -m "not slow" tests $(ARGS)

# The tests without processes (no multi-process world, no recipe run, no fresh interpreter): stages 1 and 2 of
# `make test`, on WORKERS xdist workers (README, "Set up and run", for its time).
test-fast: export PYTHONDONTWRITEBYTECODE =
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -n $(WORKERS) -m "$(FAST)" tests $(ARGS)

# The matrix cells CI leaves out (marked `slow`).
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow $(ARGS)

# The newest versions pyproject.toml's ranges allow (the dev extra, Lightning, transformers, torchao, torchft,
# datasets, litdata, LitGPT's client), on purpose and apart from CI: a fresh .venv-latest without the lock (torch stays
# the CPU build on this machine's disk; any other torch is a several-GB CUDA download), then the fast tier and the
# Hugging Face and Lightning matrices' CI cells. A failure here is a finding for an issue, not a red main; the README
# says when it last ran and with what result. `scripts/check_versions.sh` checks given torch/Lightning versions.
LATEST ?= .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	PYTHONWARNINGS="ignore::Warning:setuptools.command.editable_wheel" \
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager "$$(grep '^torch==' .ci/constraints.txt)" \
	    -e '.[dev]' --config-settings editable_mode=compat
	$(LATEST)/bin/python -m pip install -q --upgrade --no-deps litgpt 'jsonargparse>=4.30' 'litdata>=0.2.50' boto3 \
	    botocore s3transfer jmespath obstore tifffile
	$(LATEST)/bin/python -m pip freeze --all | grep -viE '^(-e |pip==|lightning[-_]par|# )' \
	    | sed -E 's/^(torch==[0-9.]+)\+cpu$$/\1/' | sort > $(LATEST)/freeze.txt
	grep -v '^#' .ci/constraints.txt | sort | comm -23 $(LATEST)/freeze.txt - | sed 's/^/not in the lock: /'
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider -m "$(FAST)" tests $(ARGS)
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" tests/hf/test_hf_matrix_distributed.py \
	    tests/strategies/test_lightning_matrix.py $(ARGS)

# Rewrite .ci/constraints.txt from .venv (after `make test` passed on it): the versions CI installs next time.
lock: $(VENV)/.installed
	{ sed -n '/^#/p' .ci/constraints.txt; $(PY) -m pip freeze --all | grep -viE '^(-e |pip==|lightning[-_]par|# Editable)' \
	    | sed -E 's/^(torch==[0-9.]+)\+cpu$$/\1/'; } > .ci/constraints.txt.new
	mv .ci/constraints.txt.new .ci/constraints.txt

benchmark: $(VENV)/.installed
	$(PY) recipes/benchmark.py $(ARGS)

# The documentation site (docs/ -> site/), strict: a broken link or anchor fails it (tests/core/test_docs.py too).
docs: $(VENV)/.installed
	$(PY) -m mkdocs build --strict
