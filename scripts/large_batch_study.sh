#!/bin/bash
# The batch-scaling study of docs/large_batch.md, resumable: tuning on a validation split (8 epochs, 5 lr values
# per optimizer, 1 seed), then each chosen lr at 24 epochs with 3 seeds on the test set.
#
#   scripts/large_batch_study.sh [OUT]      # default OUT: runs/large_batch; kill and re-run to resume
#   TUNE=docs/large_batch/tune scripts/large_batch_study.sh    # only the final study, from the committed choices
#
# Epoch-based settings of the tuning cells are the final ones x 1/3: SGD warm-up 5/90 of the budget and step
# decay at 30/60/80 of 90 epochs (Goyal et al.), LARS and LAMB warm-up 2 of 24 epochs and poly-2 decay.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/large_batch}
TUNE=${TUNE:-$OUT/tune}
LB=${LB:-.venv/bin/largebatch}
COMMON=(--batches 64,384,1536,3072 --optimizers sgd,lars,lamb --micro-batch 128 --set model.width=8
        --set train.noise_scale=true)
echo "machine: $("$(dirname "$LB")/python" -c "import torch; from largebatch.commands.bench import machine; print(machine(torch.device('cpu')))")"
[ "$TUNE" != "$OUT/tune" ] || "$LB" study batch-scaling "${COMMON[@]}" --epochs 8 --val-split 10000 \
  --opt-set sgd:schedule.warmup_epochs=0.444 --opt-set sgd:schedule.decay=step \
  --opt-set 'sgd:schedule.milestones=[2.667,5.333,7.111]' \
  --opt-set lars:schedule.warmup_epochs=0.667 --opt-set lars:schedule.decay=poly \
  --opt-set lamb:schedule.warmup_epochs=0.667 --opt-set lamb:schedule.decay=poly \
  --lr-grid sgd:0.125,0.25,0.5,1,2 --lr-grid lars:1,2,4,8,16 --lr-grid lamb:0.002,0.004,0.008,0.016,0.032 \
  --out "$OUT/tune"
"$LB" study batch-scaling "${COMMON[@]}" --epochs 24 --seeds 3 --from-tuning "$TUNE" \
  --opt-set sgd:schedule.warmup_epochs=1.333 --opt-set sgd:schedule.decay=step \
  --opt-set 'sgd:schedule.milestones=[8,16,21.333]' \
  --opt-set lars:schedule.warmup_epochs=2 --opt-set lars:schedule.decay=poly \
  --opt-set lamb:schedule.warmup_epochs=2 --opt-set lamb:schedule.decay=poly \
  --out "$OUT/final"
