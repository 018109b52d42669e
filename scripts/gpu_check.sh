#!/usr/bin/env bash
# The CUDA check in one command, for a GPU machine without network (make gpu-check):
#
#   scripts/gpu_check.sh          on the GPU machine, with the .whl folder (make gpu-wheels) beside the checkout
#   scripts/gpu_check.sh --cpu    the same sequence on CPU with tiny sizes (the suite runs it)
#
# Installs the carried wheels and this package with pip --no-index --no-deps against the machine's own torch
# (never a torch download) into a private folder, puts the nvJPEG wheel's library folder on LD_LIBRARY_PATH,
# then runs scripts/gpu_check.py: machine (versions, libnvjpeg, nvImageCodec's back-ends), throughput,
# cuda_tests, train, data, launch, more_tests (calibrate when asked), all within one deadline:
# GPU_CHECK_DEADLINE_S (default 450) from this script's start. Results, at most 8 files: $OUT/gpu_check.json,
# $OUT/gpu_check.log (this output) and one log per step (OUT defaults to ./gpu-check-out). Exits non-zero
# when a step failed or was killed at the deadline.
set -uo pipefail
GPU_CHECK_T0=$(date +%s.%N)   # the deadline counts from here
export GPU_CHECK_T0
cd "$(dirname "$0")/.."
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then MODE=cpu; elif [ -n "${1:-}" ]; then
  echo "gpu_check.sh: unknown argument '$1'; use --cpu or nothing." >&2; exit 2
fi
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
DEADLINE=${GPU_CHECK_DEADLINE_S:-450}
left() { local l=$(( ${DEADLINE%.*} - SECONDS )); echo $(( l > 1 ? l : 1 )); }
SITE=${LARGEBATCH_SITE:-/tmp/largebatch-site}
install() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    echo "gpu_check: installing $(cd .whl && echo *.whl)"
    timeout -k 5 "$(left)" "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
      .whl/*.whl || echo "gpu_check: wheel install failed" >&2
  else
    echo "gpu_check: no .whl/ folder (make gpu-wheels): simplejpeg and nvImageCodec only where the machine has them"
  fi
  timeout -k 5 "$(left)" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target "$SITE" . || echo "gpu_check: installing the package failed; using the checkout on PYTHONPATH" >&2
}
# The package is imported from this checkout; where it is not installed (the GPU machine), pip installs it
# and the carried wheels into a private folder, with the machine's own torch and no index.
# (sys.path[0] is dropped first: it is the current directory under -c, where the checkout's own folder would
# import without the wheels being installed; and the wheels' simplejpeg must import too)
if ! "$PY" -c "import sys; sys.path.pop(0); import largebatch, pathlib, simplejpeg; sys.exit(pathlib.Path(largebatch.__file__).resolve().parents[1] != pathlib.Path('$PWD').resolve())" 2>/dev/null; then
  install 2>&1 | tee -a "$LOG"
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  # nvImageCodec's nvJPEG extension dlopens libnvjpeg.so.13: the nvidia-nvjpeg wheel's folder (nvidia/cu13/lib)
  for lib in "$SITE"/nvidia/cu13/lib "$SITE"/nvidia/nvjpeg/lib; do
    if [ -d "$lib" ]; then export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
  done
  echo "gpu_check: PYTHONPATH=$PYTHONPATH LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" | tee -a "$LOG"
fi
"$PY" scripts/gpu_check.py --mode "$MODE" --out "$OUT" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
