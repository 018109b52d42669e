#!/usr/bin/env bash
# The timing figures of the README's results table, in one go, on an otherwise idle machine.
#   scripts/quiet_bench.sh [OUTDIR]     (default bench-out/<date>; JSON, logs and timings land there)
# Runs: `make train` on a fresh clone (set-up included), the speed-run recipe, `bench train`,
# `bench scaling`, `bench data` (loader throughput only), and scripts/bench_comm.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-bench-out/$(date +%Y%m%d-%H%M)}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
LB="$ROOT/.venv/bin/largebatch"
log() { echo "### $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg): $*" | tee -a "$OUT/timings.log"; }
timed() { local name=$1; shift; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?;
          log "$name: rc=$rc in $((SECONDS - t0)) s"; }

log "machine: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
# 1. make train on a fresh clone: venv, torch from the local wheel, the package, then 2 workers.
rm -rf /tmp/largebatch-fresh && git clone -q "$ROOT" /tmp/largebatch-fresh
timed make_train_fresh make -C /tmp/largebatch-fresh train
cp /tmp/largebatch-fresh/runs/*/summary.json "$OUT/make_train_summary.json" 2>/dev/null
# 2. The speed-run recipe, 2 workers x 1 thread, seeds 0-2.
for S in 0 1 2; do
  timed speedrun_s$S "$LB" train fashion_mnist_speedrun --nproc-per-node 2 --set train.seed=$S --run-dir "$OUT/speedrun_s$S"
done
# 3. Training throughput: ResNet-50 at 128 px, plain loop vs largebatch, 1 and 2 threads.
timed bench_train_1t "$LB" bench train --batch 8 --steps 2 --rounds 3 --threads 1 --configs fp32,fp32-cl --json "$OUT/bench_train_1t.json"
timed bench_train_2t "$LB" bench train --batch 8 --steps 2 --rounds 3 --configs fp32,fp32-cl,bf16-cl --json "$OUT/bench_train_2t.json"
# 4. Weak scaling 1 -> 2 workers per algorithm (noop = no communication, the ceiling).
timed bench_scaling "$LB" bench scaling --algorithms native,ring,halving_doubling,noop --repeats 2 --json "$OUT/bench_scaling.json"
# 5. Data pipeline, both pipelines in the same run.
timed bench_data_w0 "$LB" bench data --images 512 --workers 0 --passes 3 --dir "$OUT/jpeg500" --json "$OUT/bench_data_w0.json"
timed bench_data_w2 "$LB" bench data --images 512 --workers 2 --passes 3 --dir "$OUT/jpeg500" --json "$OUT/bench_data_w2.json" --no-memory
rm -rf "$OUT/jpeg500"
# 6. Communication (1 host x 4, 2 namespaced hosts x 2 at 1 Gbit/s, training overhead).
timed bench_comm scripts/bench_comm.sh "$OUT/comm"
log "done"
