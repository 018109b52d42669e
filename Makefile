# Two commands set up and run everything on a fresh machine: `make train` and `make test`.
# Each step is idempotent: a second run skips what is done.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
FMNIST  := /usr/share/datasets/fashion-mnist
NPROC   ?= 2
RECIPE  ?=
PYTEST_ARGS ?=

.PHONY: setup train test bench clean-runs system-deps

setup: $(STAMP) system-deps

# torch first, pinned to the local CPU wheel: any looser range downloads GBs of CUDA packages.
# --no-compile, then scripts/warm_bytecode.py caches bytecode for just the modules a run imports
# (pip compiling all of torch took most of the set-up time).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -e '.[test]'
	$(PY) scripts/warm_bytecode.py
	touch $(STAMP)

# Debian packages: the embedded Fashion-MNIST data set, and iproute2 for the namespaced cluster.
system-deps:
	@if [ ! -f $(FMNIST)/train-images-idx3-ubyte.gz ] || ! command -v ip >/dev/null; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "Fashion-MNIST or iproute2 is missing: run 'sudo apt-get install -y dataset-fashion-mnist iproute2' once."; exit 2; \
	  fi; \
	  apt-get update -q && apt-get install -y -q dataset-fashion-mnist iproute2; \
	fi

train: setup
	$(VENV)/bin/largebatch train $(RECIPE) --nproc-per-node $(NPROC)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean-runs:
	rm -rf runs
