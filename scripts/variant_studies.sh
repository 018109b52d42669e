#!/bin/bash
# The batch-size control and Collapsed Ensemble studies of docs/large_batch.md, resumable (kill and re-run):
# each first tunes the lr of both its variants on a validation split (8 epochs, 1 seed, the same grid for both),
# then runs each variant at its chosen lr for 24 epochs with 3 seeds on the test set.
#
#   scripts/variant_studies.sh [OUT] [batch-control|ensemble|both]     # default: runs/variant_studies both
#   scripts/variant_studies.sh [OUT] ensemble-restarts    # the ensemble's follow-up, from OUT/ensemble/tune
#
# The regime is the batch-scaling study's (scripts/large_batch_study.sh): SpeedrunNet width 8, micro-batches
# of at most 128 images per worker, 2 workers, SGD with the linear rule and Goyal's warm-up from the unscaled lr.
# Tuning cells use the final epoch settings x 1/3.
# - batch-control (Mikami et al.): fixed 3,072 (~ImageNet 64K) against 1,536 (~32K) for the first epoch, then
#   3,072 (Sony: the small batch for the 5 warm-up epochs of 90; batch phases begin at whole epochs, so the
#   switch is after epoch 1 in both the tuning and the final cells); warm-up 5/90 of the budget, step decay at
#   30/60/80 of 90.
# - ensemble (Codreanu et al.): batch 384 (~ImageNet 8K); a single model for 24 epochs against a base schedule
#   of 16 epochs and 2 cycles of 4, each ending in a 1-epoch collapse and a snapshot; poly-2 decay in both.
# - ensemble-restarts: the follow-up the literature suggests where that plain form fell short (its later snapshots
#   did not re-converge in 4 epochs): 3 equal segments of 8 epochs, each cycle re-warming to the full peak lr
#   (ensemble.cycle_lr_factor 1, as in snapshot ensembles), so that members are longer-trained and more diverse;
#   at the lr the ensemble tuning chose (tuned with the plain form's cycles, not re-tuned).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/variant_studies}
WHICH=${2:-both}
LB=${LB:-.venv/bin/largebatch}
SGD=(--micro-batch 128 --set model.width=8 --set optim.name=sgd --set optim.scaling_rule=linear
     --set schedule.warmup_start_lr=null)
echo "machine: $("$(dirname "$LB")/python" -c "import torch; from largebatch.commands.bench import machine; print(machine(torch.device('cpu')))")"

if [ "$WHICH" = both ] || [ "$WHICH" = batch-control ]; then
  BC=("${SGD[@]}" --batch 3072 --start-batch 1536 --set schedule.decay=step)
  "$LB" study batch-control "${BC[@]}" --epochs 8 --switch-epochs 1 --seeds 1 --val-split 10000 \
    --lr-grid 0.03125,0.0625,0.125,0.25 --set schedule.warmup_epochs=0.444 \
    --set 'schedule.milestones=[2.667,5.333,7.111]' --out "$OUT/batch_control/tune"
  "$LB" study batch-control "${BC[@]}" --epochs 24 --switch-epochs 1 --seeds 3 \
    --from-tuning "$OUT/batch_control/tune" --set schedule.warmup_epochs=1.333 \
    --set 'schedule.milestones=[8,16,21.333]' --out "$OUT/batch_control/final"
fi

if [ "$WHICH" = both ] || [ "$WHICH" = ensemble ]; then
  EN=("${SGD[@]}" --batch 384 --cycles 2 --set schedule.decay=poly --set ensemble.swa=true)
  "$LB" study ensemble "${EN[@]}" --epochs 8 --cycle-epochs 1.333 --collapse-epochs 0.333 --seeds 1 \
    --val-split 10000 --lr-grid 0.25,0.5,1,2 --set schedule.warmup_epochs=0.444 \
    --set ensemble.rewarm_epochs=0.167 --out "$OUT/ensemble/tune"
  "$LB" study ensemble "${EN[@]}" --epochs 24 --cycle-epochs 4 --collapse-epochs 1 --seeds 3 \
    --from-tuning "$OUT/ensemble/tune" --set schedule.warmup_epochs=1.333 --set ensemble.rewarm_epochs=0.5 \
    --out "$OUT/ensemble/final"
fi

if [ "$WHICH" = ensemble-restarts ]; then
  EN=("${SGD[@]}" --batch 384 --cycles 2 --set schedule.decay=poly --set ensemble.swa=true)
  "$LB" study ensemble "${EN[@]}" --epochs 24 --cycle-epochs 8 --collapse-epochs 1 --seeds 3 \
    --from-tuning "$OUT/ensemble/tune" --set schedule.warmup_epochs=1.333 --set ensemble.rewarm_epochs=0.5 \
    --set ensemble.cycle_lr_factor=1 --out "$OUT/ensemble/restarts"
fi
