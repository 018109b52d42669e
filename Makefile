# Two commands set up and run everything on a fresh machine: `make train` and `make test`.
# Each step is idempotent: a second run skips what is done.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
FMNIST  := /usr/share/datasets/fashion-mnist
NPROC   ?= 2
RECIPE  ?=
PYTEST_ARGS ?=

.PHONY: setup setup-eco train test test-eco test-fast bench clean-runs system-deps gpu-wheels gpu-check

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
# processes they started, so one pytest process leaves a core idle much of the time (2 workers: the main suite in
# 6 min 42 s, AMD EPYC AVX2, results/reliability/suite_time.log). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/ruff check largebatch tests scripts
	$(VENV)/bin/mypy
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-eco

# The second environment, the stack most users run: a CUDA build of torch (it runs on the CPU) with torchvision
# and timm. torch and torchvision pinned: this machine's disk holds exactly these (5.6 GB in all); any looser range
# downloads GBs. timm, webdataset, then the package and its test extra, with no change to torch; then the bytecode
# of what the tests import, as for .venv (PYTHONDONTWRITEBYTECODE is set here: without it each test process
# compiled torch again, 20 s). From scratch 1 min 26 s without that step at a load of about 1.5; 2 min 35 s with it,
# beside another job using both cores (AMD EPYC, 2 cores).
ECO_VENV   ?= .venv-eco
ECO_PY     := $(ECO_VENV)/bin/python
ECO_STAMP  := $(ECO_VENV)/.installed
ECO_TORCH  ?= torch==2.14.1 torchvision==0.29.1
ECO_LIBS   ?= timm==1.0.31 webdataset
ECO_PIP    := $(ECO_PY) -m pip install -q --disable-pip-version-check --no-compile
setup-eco: $(ECO_STAMP)

$(ECO_STAMP): pyproject.toml
	test -x $(ECO_PY) || python3 -m venv $(ECO_VENV)
	$(ECO_PIP) $(ECO_TORCH)
	$(ECO_PIP) $(ECO_LIBS)
	$(ECO_PIP) -e '.[test]' $(ECO_TORCH)
	PYTHONDONTWRITEBYTECODE= $(ECO_PY) -c "import timm.optim, torchvision.io, torchvision.transforms.v2, \
	  torch.utils.serialization, rich.emoji, runpy; runpy.run_path('scripts/warm_bytecode.py')"
	touch $(ECO_STAMP)

# In that environment: the tests of timm:/torchvision: models (marked library) and the oracles (tests/unit/test_oracles.py:
# largebatch's ResNets against torchvision's, LARS/LAMB against timm's, the JPEG crop against torchvision's).
# LARGEBATCH_REQUIRE_LIBRARIES=1 turns their skip where timm or torchvision does not import into a failure.
# 18 tests, 2 min 40-50 s on 2 workers beside another job using both cores (2 min of CPU; most of it the 11
# `largebatch` processes of the library tests, each importing torch, torchvision and timm).
ECO_TESTS ?= tests/integration/test_any_model.py tests/unit/test_oracles.py
ECO_WORKERS ?= 2
test-eco: setup-eco
	LARGEBATCH_REQUIRE_LIBRARIES=1 $(ECO_PY) -m pytest -p no:cacheprovider -n $(ECO_WORKERS) -m "library or oracle" $(ECO_TESTS)

# The tiers are folders (tests/unit/conftest.py refuses a process or a process group there): the unit tier while
# changing code, then make test for everything (tests/integration/: real processes, process groups, studies).
test-fast: setup
	$(VENV)/bin/ruff check largebatch tests scripts
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests/unit

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
