#!/usr/bin/env bash
# The CUDA check in one command, for a GPU machine without network (make gpu-check):
#
#   scripts/gpu_check.sh          on the GPU machine, with the .whl folder (make gpu-wheels) beside the checkout
#   scripts/gpu_check.sh --cpu    the same sequence on CPU with tiny sizes (the suite runs it)
#
# Installs the wheels and this package with pip --no-index --no-deps against the machine's own torch (never a
# torch download), then runs scripts/gpu_check.py: the machine, pytest -m cuda, ResNet-50 throughput beside
# timm and torchvision, the JPEG loader, a short end-to-end run. Results: $OUT/gpu_check.json and
# $OUT/gpu_check.log (OUT defaults to ./gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then MODE=cpu; elif [ -n "${1:-}" ]; then
  echo "gpu_check.sh: unknown argument '$1'; use --cpu or nothing." >&2; exit 2
fi
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
# The package is imported from this checkout; where it is not installed (the GPU machine), pip installs it
# and the carried wheels into a private folder, with the machine's own torch and no index.
# (sys.path[0] is dropped first: it is the current directory under -c, where the checkout's own folder would
# import without the wheels being installed; and the wheels' simplejpeg must import too)
if ! "$PY" -c "import sys; sys.path.pop(0); import largebatch, pathlib, simplejpeg; sys.exit(pathlib.Path(largebatch.__file__).resolve().parents[1] != pathlib.Path('$PWD').resolve())" 2>/dev/null; then
  SITE=${LARGEBATCH_SITE:-/tmp/largebatch-site}
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || echo "gpu_check: wheel install failed" >&2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . \
    || echo "gpu_check: installing the package failed; using the checkout on PYTHONPATH" >&2
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
exec "$PY" scripts/gpu_check.py --mode "$MODE" --out "$OUT"
