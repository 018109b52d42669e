#!/usr/bin/env bash
# Regenerate every figure of docs/communication.md in one go (about 4 minutes on a
# 2-core machine; the 2x2 run needs root and iproute2 for `largebatch cluster run`).
#
#   scripts/bench_comm.sh [OUTDIR]      # default OUTDIR: docs/communication_data
#
# Writes OUTDIR/communication_1x4.{json,png}, communication_2x2.{json,png},
# communication_training.json and the printed tables to OUTDIR/communication_bench.log;
# prints the load average before and after and the total time.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/communication_data}
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
step "$LB" bench allreduce --nproc 4 --training --width 16 --json "$OUT/communication_training.json"

# 4. the markdown tables of docs/communication.md from the JSON files
.venv/bin/python scripts/comm_tables.py "$OUT" | tee -a "$LOG"

echo "### load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG"
echo "### total: $((SECONDS - start)) s" | tee -a "$LOG"
