#!/usr/bin/env bash
# Regenerates the figures of "## Data pipeline" in docs/benchmarks.md.
# Usage: scripts/bench_data.sh [OUT_DIR]   (default /tmp/largebatch-bench-data; JSON + logs land there)
# Run it on a quiet machine: wall-clock rates depend on what else runs; images per CPU-second less so.
set -euo pipefail
cd "$(dirname "$0")/.."
LB=${LB:-.venv/bin/largebatch}
PY=${PY:-.venv/bin/python}
OUT=${1:-/tmp/largebatch-bench-data}
mkdir -p "$OUT"
echo "machine: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), torch $($PY -c 'import torch; print(torch.__version__)')"
echo "load before: $(uptime)"

# 1-2. Loader throughput, both pipelines in the same run: 500x375 (ImageNet-typical) with 0 and 2 workers,
#      and 1600x1200 photos (where DCT-scaled decoding pays).
$LB bench data --images 512 --workers 0 --passes 3 --dir "$OUT/jpeg500" --json "$OUT/w0_500.json"
$LB bench data --images 512 --workers 2 --passes 3 --dir "$OUT/jpeg500" --json "$OUT/w2_500.json" --no-memory
$LB bench data --images 96 --workers 0 --passes 3 --width 1600 --height 1200 --batch 32 \
    --dir "$OUT/jpeg1600" --json "$OUT/w0_1600.json" --no-memory

# 3. ResNet-50 at 224 fed by the loader: data-wait per step from metrics.jsonl (fp32: this CPU has no bf16 units).
rm -rf "$OUT/run_r50"
$LB train imagenet_resnet50_goyal_8k --run-dir "$OUT/run_r50" --quiet \
    --set data.root="$OUT/jpeg500" --set data.train_size=null --set data.loader_workers=1 \
    --set batch.global_batch=16 --set train.max_steps=6 --set train.log_every=1 \
    --set train.precision=fp32 --set train.eval_every=0 --set train.plots=false
$PY - "$OUT/run_r50/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "train"]
for r in rows:
    step_s = r["global_batch"] / r["images_per_s"]
    print(f"step {r['step']}: step {step_s:.1f} s, data wait {r['data_wait_s']:.3f} s "
          f"({100 * r['data_wait_s'] / step_s:.2f}%)")
PYEOF
echo "load after: $(uptime)"
