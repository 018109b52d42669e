#!/bin/bash
# Re-check every claim of docs/large_batch.md's "claims at a glance" in 2.94 hours on 2 cores, resumable (kill
# and re-run): the final cells the claims read, at the lrs the committed tuning studies chose (docs/large_batch/
# tune*, batch_control/tune, ensemble/tune), 24 epochs, 3 seeds, test set. Nothing is re-tuned: the tuning
# (3.45 h of the 14.3 h the full studies took) and the cells no claim reads (LARS and LAMB at 64, 384, 3,072 and
# 6,144, SGD at 1,536 and 6,144) are what scripts/large_batch_study.sh and scripts/variant_studies.sh add.
#
#   scripts/reproduce_claims.sh [OUT]      # default OUT: runs/claims; kill and re-run to resume
#   DRY_RUN=1 scripts/reproduce_claims.sh  # list the 27 cells and their lrs, train nothing
#
# - OUT/batch_scaling: SGD at 64 (the baseline), 384 and 3,072, LARS and LAMB at 1,536 (15 cells; Goyal et al.
#   and You et al.); the same commands as docs/large_batch/final's cells.
# - OUT/batch_control: fixed 3,072 against 1,536 for the first epoch, then 3,072 (6 cells; Mikami et al.).
# - OUT/ensemble: the Collapsed Ensemble against one model, batch 384 (6 cells; Codreanu et al.).
# Each prints its claims' verdicts; compare them with docs/large_batch.md ("Re-checking the claims"). Measured on
# the 2-core AVX2 EPYC: batch scaling 1.72 h, batch control 0.56 h, the ensemble 0.65 h.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/claims}
LB=${LB:-.venv/bin/largebatch}
DOCS=docs/large_batch
DRY=()
[ -z "${DRY_RUN:-}" ] || DRY=(--dry-run)
echo "machine: $("$(dirname "$LB")/python" -c "import torch; from largebatch.commands.bench import machine; print(machine(torch.device('cpu')))")"
TUNED=()
for t in tune tune_6144 tune_edge_sgd tune_edge_lars tune_edge_lamb tune_edge_6144 tune_sgd64; do
  TUNED+=(--from-tuning "$DOCS/$t")   # the final's order: tune_sgd64 last, its SGD cells at 64 replace tune's
done
"$LB" study batch-scaling --batches 64,384,1536,3072 --optimizers sgd,lars,lamb --claims-only \
  --micro-batch 128 --set model.width=8 --set train.noise_scale=true --epochs 24 --seeds 3 "${TUNED[@]}" \
  --opt-set sgd:schedule.warmup_epochs=1.333 --opt-set sgd:schedule.decay=step \
  --opt-set 'sgd:schedule.milestones=[8,16,21.333]' \
  --opt-set lars:schedule.warmup_epochs=2 --opt-set lars:schedule.decay=poly \
  --opt-set lamb:schedule.warmup_epochs=2 --opt-set lamb:schedule.decay=poly \
  --out "$OUT/batch_scaling" "${DRY[@]}"
SGD=(--micro-batch 128 --set model.width=8 --set optim.name=sgd --set optim.scaling_rule=linear
     --set schedule.warmup_start_lr=null)
"$LB" study batch-control "${SGD[@]}" --batch 3072 --start-batch 1536 --set schedule.decay=step \
  --epochs 24 --switch-epochs 1 --seeds 3 --from-tuning "$DOCS/batch_control/tune" \
  --set schedule.warmup_epochs=1.333 --set 'schedule.milestones=[8,16,21.333]' \
  --out "$OUT/batch_control" "${DRY[@]}"
"$LB" study ensemble "${SGD[@]}" --batch 384 --cycles 2 --set schedule.decay=poly --set ensemble.swa=true \
  --epochs 24 --cycle-epochs 4 --collapse-epochs 1 --seeds 3 --from-tuning "$DOCS/ensemble/tune" \
  --set schedule.warmup_epochs=1.333 --set ensemble.rewarm_epochs=0.5 \
  --out "$OUT/ensemble" "${DRY[@]}"
