#!/usr/bin/env bash
# Regenerate every figure of docs/communication.md in one go (about 4 minutes on a
# 2-core machine; the 2x2 run needs root and iproute2 for `largebatch cluster run`).
#
#   scripts/bench_comm.sh [OUTDIR]      # default OUTDIR: results/communication
#
# Writes OUTDIR/communication_1x4.{json,png}, communication_2x2.{json,png},
# communication_training.json, ddp_step_native.json, cluster_training.json and the printed tables to OUTDIR/communication_bench.log;
# prints the load average before and after and the total time.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/communication}
LB=${LB:-.venv/bin/largebatch}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)          # absolute: the cluster's agents run in other namespaces
LOG="$OUT/communication_bench.log"
: > "$LOG"
start=$SECONDS
step() { echo "### $*" | tee -a "$LOG"; "$@" 2>&1 | grep -v -i "warning" | tee -a "$LOG"; }

echo "### machine: $(lscpu | sed -n "s/^Model name: *//p"), flags: $(lscpu | grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" | sort -u | tr "\n" " ")"| tee -a "$LOG"
echo "### cores: $(nproc), $(uname -r); torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')" | tee -a "$LOG"
echo "### load before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG"

# 1. 1 host x 4 processes, loopback: every algorithm itself (fast path off) beside native,
#    with the link measurement and the perf-model prediction per size.
step "$LB" bench allreduce --nproc 4 --small-bytes 0 \
    --json "$OUT/communication_1x4.json" --plot "$OUT/communication_allreduce_1x4.png"

# 2. 2 namespaced hosts x 2 processes, hosts linked at 1 Gbit/s (no netem on this kernel).
step "$LB" cluster run --nodes 2 --procs-per-node 2 --inter-node-gbit 1 -- \
    bench allreduce --small-bytes 0 --json "$OUT/communication_2x2.json" \
    --plot "$OUT/communication_allreduce_2x2.png"

# 3. exposed communication per DDP training step (default fast path), 1 host x 4.
step "$LB" bench allreduce --nproc 4 --training --width 16 --rounds 5 --steps 20 --json "$OUT/communication_training.json"
# 3b. the native-composed hooks against DDP's own all-reduce only, more rounds (the 1x4 DDP-step goal).
step "$LB" bench allreduce --nproc 4 --training --width 16 --rounds 20 --steps 20 \
    --algorithms torus2d:native hierarchical:native --json "$OUT/ddp_step_native.json"

# 4. a real training across the 2 namespaced hosts x 2 at 1 Gbit/s (default recipe, 150 steps), back to back:
#    flat native against hierarchical in both forms; images/s from each run's summary.json.
RUNS=$(mktemp -d)
TRAIN=(train fashion_mnist --set train.max_steps=150 --set train.log_every=25 --set train.eval_every=0)
for variant in native hierarchical-p2p hierarchical-native; do
  case $variant in
    native) extra=() ;;
    hierarchical-p2p) extra=(--set comm.algorithm=hierarchical --set comm.impl=p2p) ;;
    hierarchical-native) extra=(--set comm.algorithm=hierarchical --set comm.impl=native --set comm.inter=native) ;;
  esac
  step "$LB" cluster run --nodes 2 --procs-per-node 2 --inter-node-gbit 1 -- \
      "${TRAIN[@]}" "${extra[@]}" --run-dir "$RUNS/$variant"
done
.venv/bin/python - "$RUNS" "$OUT/cluster_training.json" "${TRAIN[*]}" <<'PY'
import json, sys
from pathlib import Path
runs, out, train = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
keys = ("train_images_per_s", "world_size", "steps", "final_top1", "wall_s")
rows = {d.name: {k: json.loads((d / "summary.json").read_text())[k] for k in keys} for d in sorted(runs.iterdir())}
out.write_text(json.dumps({"command": f"largebatch cluster run --nodes 2 --procs-per-node 2 --inter-node-gbit 1 -- "
                           f"{train} [--set comm.algorithm=hierarchical --set comm.impl=p2p|native "
                           f"(--set comm.inter=native)]", "runs": rows}, indent=2) + "\n")
base = rows["native"]["train_images_per_s"]
for name, r in rows.items():
    print(f"{name}: {r['train_images_per_s']:.0f} images/s ({r['train_images_per_s'] / base:.2f}x native)")
PY
rm -rf "$RUNS"

# 5. the markdown tables of docs/communication.md from the JSON files
.venv/bin/python scripts/comm_tables.py "$OUT" | tee -a "$LOG"

echo "### load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG"
echo "### total: $((SECONDS - start)) s" | tee -a "$LOG"
