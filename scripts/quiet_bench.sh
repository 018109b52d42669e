#!/usr/bin/env bash
# The CPU timing figures of docs/benchmarks.md, the README's CPU rows, docs/models_optim.md's optimizer costs and
# docs/performance_model.md's check against a real run, in one go, on an otherwise idle machine.
#   scripts/quiet_bench.sh [OUTDIR]     (default results/bench: the evidence the docs link to)
# Runs: `make train` on a fresh clone (set-up included), the speed-run recipe on 3 seeds, `bench train`,
# `bench scaling`, `bench data`, `bench optim`, and `plan --calibrate` against a 2-process run. OUTDIR keeps
# every command's output (NAME.log), its JSON, and of each training run its config.yaml, summary.json and
# metrics.jsonl.gz; timings.log has each command's exit code, time and load average. About 15-30 minutes on 2 cores. The communication figures have
# their own script (scripts/bench_comm.sh, results/communication).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
FINAL=$(realpath -m "${1:-results/bench}")
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
OUT="$WORK/out"   # filled here, and put in FINAL's place only when every step has run: never old and new mixed
mkdir -p "$OUT"
LB="$ROOT/.venv/bin/largebatch"
log() { echo "### $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): $*" | tee -a "$OUT/timings.log"; }
timed() { local name=$1; shift; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?;
          log "$name: rc=$rc in $((SECONDS - t0)) s"; }
keep_run() {   # keep_run RUN_DIR NAME: the run's evidence, not its weights or plots
  [ -f "$1/summary.json" ] || { log "$2: no finished run in '$1'"; return; }
  mkdir -p "$OUT/$2"
  cp "$1/config.yaml" "$1/summary.json" "$OUT/$2/"
  gzip -c "$1/metrics.jsonl" > "$OUT/$2/metrics.jsonl.gz"
}

: > "$OUT/timings.log"
for _ in $(seq 60); do   # an idle machine: wait (up to 5 min) for the 1-minute load to fall below 1
  awk '{exit !($1 < 1.0)}' /proc/loadavg && break; sleep 5
done
log "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, flags: $(grep -o -w -E 'avx2|fma|avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')$(free -g | awk '/Mem:/ {print $2}') GiB; torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'); commit $(git rev-parse --short HEAD)"
# 1. make train on a fresh clone: venv, torch from the local wheel, the package, then 2 workers.
git clone -q "$ROOT" "$WORK/fresh"
timed make_train_fresh make -C "$WORK/fresh" train
RUNS=("$WORK"/fresh/runs/*/)
keep_run "${RUNS[0]%/}" make_train
# 2. The speed-run recipe, 2 workers x 1 thread, seeds 0-2.
for S in 0 1 2; do
  timed speedrun_s$S "$LB" train fashion_mnist_speedrun --nproc-per-node 2 --set train.seed=$S --run-dir "$WORK/speedrun_s$S"
  keep_run "$WORK/speedrun_s$S" speedrun_s$S
done
# 3. Training throughput: ResNet-50 at 128 px, plain loop vs largebatch, 1 and 2 threads.
timed bench_train_1t "$LB" bench train --batch 8 --steps 2 --rounds 3 --threads 1 --configs fp32,fp32-cl,bf16-cl --json "$OUT/bench_train_1t.json"
timed bench_train_2t "$LB" bench train --batch 8 --steps 2 --rounds 3 --configs fp32,fp32-cl,bf16-cl --json "$OUT/bench_train_2t.json"
# 4. Weak scaling 1 -> 2 workers per algorithm (noop = no communication, the ceiling).
timed bench_scaling "$LB" bench scaling --algorithms native,ring,halving_doubling,noop --repeats 2 --json "$OUT/bench_scaling.json"
# 5. Data pipeline, both pipelines in the same run.
timed bench_data_w0 "$LB" bench data --images 512 --workers 0 --passes 3 --dir "$WORK/jpeg500" --json "$OUT/bench_data_w0.json"
timed bench_data_w2 "$LB" bench data --images 512 --workers 2 --passes 3 --dir "$WORK/jpeg500" --json "$OUT/bench_data_w2.json" --no-memory
# 6. Optimizer step cost (docs/models_optim.md): ResNet-50's 161 tensors, three runs.
for R in 1 2 3; do
  timed bench_optim_r$R "$LB" bench optim --model resnet50 --steps 30 --threads 1
done
# 7. The performance model against a real 2-process run (docs/performance_model.md, "Check against a real run").
M="--model resnet18 --stem small --width 16 --in-channels 1 --image-size 28 --num-classes 10 --precision fp32"
export LARGEBATCH_CATALOG="$WORK/catalog.yaml"
timed plan_calibrate "$LB" plan --calibrate --nproc 2 $M
timed plan_check_train "$LB" train fashion_mnist --nproc-per-node 2 --set train.precision=fp32 --set train.max_steps=40 \
  --set model.name=resnet18 --set model.stem=small --set model.width=16 --set train.channels_last=off \
  --set batch.global_batch=256 --set train.log_every=10 --run-dir "$WORK/plan_check" --quiet
keep_run "$WORK/plan_check" plan_check_train
cp "$LARGEBATCH_CATALOG" "$OUT/plan_catalog.yaml" 2>/dev/null
"$LB" plan $M --device this-machine --devices 2 --devices-per-node 2 --global-batch 256 --dataset-size 60000 \
  --epochs 1 --json > "$OUT/plan_check_prediction.json" 2> "$OUT/plan_check_prediction.log"
log "plan_check_prediction: rc=$?"
log "done"
if [ -e "$FINAL" ] && [ ! -f "$FINAL/timings.log" ]; then   # replace only an earlier output of this script
  echo "$FINAL holds something else; the results go beside it"; FINAL="$FINAL.$(date +%Y%m%d-%H%M)"
fi
rm -rf "$FINAL" && mkdir -p "$(dirname "$FINAL")" && cp -r "$OUT" "$FINAL" && echo "results in $FINAL"
