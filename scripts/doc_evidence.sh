#!/usr/bin/env bash
# The outputs behind docs figures that no other script writes, in one go, on an otherwise idle machine
# (about 20 minutes on 2 cores; the pipeline sweep needs root and iproute2 for `largebatch cluster run`):
#
#   scripts/doc_evidence.sh [STEP...]     # all steps, or only those named (e.g. 1 4)
#
# 1. results/reliability/test_durations.log: `make test` in one pytest process with pytest's slowest 60 durations
#    (docs/reliability.md, "How it is tested": each case alone).
# 2. results/communication/gloo_collectives_{2,4}.log: gloo's own collectives at 16 MB on 2 and 4 processes
#    (docs/communication.md, why the native-composed in-node step is an all_to_all on gloo).
# 3. results/communication/pipeline_{8,16,32}.log: torus2d:native's piece count on 2 namespaced hosts x 2 at
#    1 Gbit/s (docs/communication.md, "Smaller pieces").
# 4. results/reliability/shard_walk.log: the shards' start-up check on 50,000 samples (docs/reliability.md,
#    "Damaged data"; scripts/shard_walk_cost.py).
# 5. results/reliability/test_durations_2_workers.log: `make test` as it runs (2 pytest workers), the README's time.
# Each log starts with the machine, the commit and the load average; the script waits (up to 5 minutes) for
# the 1-minute load to fall below 1 first.
set -uo pipefail
cd "$(dirname "$0")/.."
LB=.venv/bin/largebatch
for _ in $(seq 60); do awk '{exit !($1 < 1.0)}' /proc/loadavg && break; sleep 5; done
header() {
  echo "### $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg); $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, flags: $(grep -o -w -E 'avx2|fma|avx512f|avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '); torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'); commit $(git rev-parse --short HEAD)"
  echo "\$ $*"
}
run() {   # run LOG COMMAND...: the header, then the command's output, then its exit code and time
  local log=$1; shift
  mkdir -p "$(dirname "$log")"
  local t0=$SECONDS
  { header "$@"; "$@" 2>&1; echo "### rc=$? in $((SECONDS - t0)) s"; } > "$log.tmp" && mv "$log.tmp" "$log"
  tail -1 "$log"
}
STEPS=" ${*:-1 2 3 4 5} "
step() { [[ $STEPS == *" $1 "* ]]; }
step 1 && run results/reliability/test_durations.log make test TEST_WORKERS=0 PYTEST_ARGS="--durations=60"
step 2 && for P in 2 4; do
  run results/communication/gloo_collectives_$P.log .venv/bin/torchrun --nproc-per-node $P scripts/gloo_collectives.py 16
done
step 3 && for N in 8 16 32; do
  run results/communication/pipeline_$N.log "$LB" cluster run --nodes 2 --procs-per-node 2 --inter-node-gbit 1 -- \
    bench allreduce --small-bytes 0 --algorithms torus2d:native --sizes 16MB,64MB --rounds 3 --pipeline $N
done
step 4 && run results/reliability/shard_walk.log .venv/bin/python scripts/shard_walk_cost.py
step 5 && run results/reliability/test_durations_2_workers.log make test PYTEST_ARGS="--durations=30"
exit 0
