#!/bin/bash
# The batch-scaling study of docs/large_batch.md, resumable (kill and re-run): tuning on a validation split
# (8 epochs, 1 seed, 5 lr values per optimizer and batch, extended by 2 values past the grid's edge where the
# best lr sat on it), then each chosen lr at 24 epochs with 3 seeds on the test set.
#
#   scripts/large_batch_study.sh [OUT]      # default OUT: runs/large_batch; kill and re-run to resume
#   TUNE=docs/large_batch/tune scripts/large_batch_study.sh    # the 64-3,072 tuning from the committed choices
#
# Tuning studies of one protocol extend each other (`--from-tuning` is repeatable: the best validation top-1
# over all their cells chooses):
# - OUT/tune: 64, 384, 1,536, 3,072 (~ImageNet 1.4K, 8K, 32K, 64K), the same 5 lr values at every batch;
# - OUT/tune_6144: 6,144 (~128K), 5 values with SGD's shifted 2 octaves down (its optimum at 3,072 was the
#   grid's lowest value);
# - OUT/tune_edge_*: 2 more values past the edge where a tuning's best sat on it (SGD at 3,072 and 6,144
#   below, LARS at 6,144 below, LARS at 64 and LAMB at 64 and 384 above);
# - OUT/tune_sgd64: SGD at 64 re-run with the warm-up fix of c0ae4c1 (below the reference batch the default
#   warm-up fell from 4x the peak lr), with 2 values past its edge; listed last, its cells replace OUT/tune's
#   at the same lr.
# Epoch-based settings of the tuning cells are the final ones x 1/3: SGD warm-up 5/90 of the budget and step
# decay at 30/60/80 of 90 epochs (Goyal et al.), LARS and LAMB warm-up 2 of 24 epochs and poly-2 decay.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/large_batch}
TUNE=${TUNE:-$OUT/tune}
LB=${LB:-.venv/bin/largebatch}
COMMON=(--micro-batch 128 --set model.width=8 --set train.noise_scale=true)
TUNING=(--epochs 8 --val-split 10000
  --opt-set sgd:schedule.warmup_epochs=0.444 --opt-set sgd:schedule.decay=step
  --opt-set 'sgd:schedule.milestones=[2.667,5.333,7.111]'
  --opt-set lars:schedule.warmup_epochs=0.667 --opt-set lars:schedule.decay=poly
  --opt-set lamb:schedule.warmup_epochs=0.667 --opt-set lamb:schedule.decay=poly)
echo "machine: $("$(dirname "$LB")/python" -c "import torch; from largebatch.commands.bench import machine; print(machine(torch.device('cpu')))")"
tune() {   # tune OUT_NAME BATCHES OPTIMIZERS GRID...
  local out=$1 batches=$2 optimizers=$3; shift 3
  "$LB" study batch-scaling --batches "$batches" --optimizers "$optimizers" "${COMMON[@]}" "${TUNING[@]}" \
    "$@" --out "$OUT/$out"
}
[ "$TUNE" != "$OUT/tune" ] || tune tune 64,384,1536,3072 sgd,lars,lamb \
  --lr-grid sgd:0.125,0.25,0.5,1,2 --lr-grid lars:1,2,4,8,16 --lr-grid lamb:0.002,0.004,0.008,0.016,0.032
tune tune_sgd64 64 sgd --lr-grid sgd:0.125,0.25,0.5,1,2,4,8   # 4 and 8: its best of 5 (2) sat on the edge
tune tune_6144 6144 sgd,lars,lamb \
  --lr-grid sgd:0.03125,0.0625,0.125,0.25,0.5 --lr-grid lars:1,2,4,8,16 --lr-grid lamb:0.002,0.004,0.008,0.016,0.032
tune tune_edge_sgd 3072 sgd --lr-grid sgd:0.03125,0.0625
tune tune_edge_lars 64 lars --lr-grid lars:32,64
tune tune_edge_lamb 64,384 lamb --lr-grid lamb:0.064,0.128
tune tune_edge_6144 6144 sgd,lars --lr-grid sgd:0.0078125,0.015625 --lr-grid lars:0.25,0.5
"$LB" study batch-scaling --batches 64,384,1536,3072,6144 --optimizers sgd,lars,lamb "${COMMON[@]}" \
  --epochs 24 --seeds 3 --from-tuning "$TUNE" --from-tuning "$OUT/tune_6144" --from-tuning "$OUT/tune_edge_sgd" \
  --from-tuning "$OUT/tune_edge_lars" --from-tuning "$OUT/tune_edge_lamb" --from-tuning "$OUT/tune_edge_6144" --from-tuning "$OUT/tune_sgd64" \
  --opt-set sgd:schedule.warmup_epochs=1.333 --opt-set sgd:schedule.decay=step \
  --opt-set 'sgd:schedule.milestones=[8,16,21.333]' \
  --opt-set lars:schedule.warmup_epochs=2 --opt-set lars:schedule.decay=poly \
  --opt-set lamb:schedule.warmup_epochs=2 --opt-set lamb:schedule.decay=poly \
  --out "$OUT/final"
