# Two commands set up and run everything on a fresh machine: `make train` and `make test`.
# Each step is idempotent: a second run skips what is done.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
FMNIST  := /usr/share/datasets/fashion-mnist
NPROC   ?= 2
RECIPE  ?=
PYTEST_ARGS ?=

.PHONY: setup train test test-fast bench clean-runs system-deps gpu-wheels gpu-check

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

# The suite runs in TEST_WORKERS pytest processes (pytest-xdist), each taking whole test files: most tests wait on
# processes they started, so one pytest process leaves a core idle much of the time (22 min 22 s; 2 workers:
# 16 min 7 s, AMD EPYC AVX2, results/reliability/). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/ruff check largebatch tests scripts
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The fast tier while changing code: unit tests of the step, optimizers, schedule, config, models, data and the
# golden losses, without subprocesses or process groups (those tests are marked slow); make test runs everything.
FAST_TESTS := tests/test_optim.py tests/test_step_sync.py tests/test_golden_losses.py tests/test_schedule.py \
              tests/test_config.py tests/test_layers.py tests/test_models.py tests/test_comm_units.py \
              tests/test_gpu_jpeg.py tests/test_noise_scale.py tests/test_scoring.py tests/test_data.py \
              tests/test_data_imagefolder.py tests/test_experiment.py tests/test_chaos.py \
              tests/test_graph_harness.py tests/test_device_contracts.py tests/test_launches.py tests/test_memory.py \
              tests/test_imagenet_layouts.py
test-fast: setup
	$(VENV)/bin/ruff check largebatch tests scripts
	$(PY) -m pytest -q -m "not slow" $(FAST_TESTS)

clean-runs:
	rm -rf runs

# The CUDA check (docs/gpu.md). gpu-wheels, here with network: the wheels the GPU machine's image lacks, for its
# Python 3.12 (manylinux x86-64), into .whl/: simplejpeg; nvImageCodec (25 MB; GPU JPEG decoding of crop windows);
# and nvJPEG (4 MB; libnvjpeg.so.13, which nvImageCodec's GPU JPEG back-end dlopens: its `nvjpeg` extra names
# nvidia-nvjpeg; nvidia-nvjpeg-cu13 on PyPI is an empty 0.0.0a0 placeholder), 13.0 like torch's cu130 build.
# gpu-check, on the GPU machine (one device command: OUT=$OUT GPU_CHECK_DEADLINE_S=450 bash scripts/gpu_check.sh,
# carry [".whl"], timeout 480): scripts/gpu_check.sh, every step within GPU_CHECK_DEADLINE_S, at most 8 files in $OUT.
WHL     ?= .whl
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(WHL) 'simplejpeg>=1.7' 'nvidia-nvimgcodec-cu13>=0.9' 'nvidia-nvjpeg>=13.0,<13.1'
	@echo "gpu-wheels: in $(WHL)/ (the GPU machine's scripts/gpu_check.sh installs every one):"
	@ls -sh1 $(WHL)/*.whl

gpu-check:
	bash scripts/gpu_check.sh
