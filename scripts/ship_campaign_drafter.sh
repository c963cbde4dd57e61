#!/usr/bin/env bash
# Ship the drafter campaign's current drafter as checkpoints/dspark-markov, with what makes it
# reproducible and comparable: the shipped drafter's own train_config/train_log/heldout_log are
# kept beside it as *_phaseN (N = one more than the highest kept phase), the campaign's
# checkpoint is exported in bf16 with its logs (scripts/export_drafter.py), the STS confidence
# calibration is refitted on held-out answers at T=0 and T=1 (the confidence head changed): every
# held-out prompt of the two first answer files (178; CALIBRATION_PROMPTS=N takes the first N),
# about 7,800 greedy and 10,500 T=1 full rounds, enough for an ECE noise floor near 1.3% at the
# first position; its report (with the cross-fitted ECE) goes to
# docs/results/dspark_calibrate_heldout.txt and its rounds to data/calibration_rounds.npz, and
# the learning curve over every phase is redrawn. Run it with the campaign stopped (or between
# two of its checkpoints); the next campaign run starts from the shipped drafter.
#   bash scripts/ship_campaign_drafter.sh            # CAMPAIGN as in scripts/drafter_campaign.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CAMPAIGN=${CAMPAIGN:-$HOME/.cache/dspark/campaign}
RUN=${RUN:-$CAMPAIGN/dspark-markov}
DEST=checkpoints/dspark-markov
[ -f "$RUN/checkpoint/trainer_state.pt" ] || [ -f "$RUN/model.safetensors" ] || {
  echo "no campaign checkpoint or drafter in $RUN" >&2; exit 1; }
last=$(ls "$DEST" | sed -n 's/^train_log_phase\([0-9]*\)\.jsonl$/\1/p' | sort -n | tail -1)
phase=$(( ${last:-0} + 1 ))
for name in train_config.json train_log.jsonl heldout_log.jsonl; do
  [ -f "$DEST/$name" ] && mv "$DEST/$name" "$DEST/${name%%.*}_phase$phase.${name#*.}"
done
if [ -f "$RUN/checkpoint/trainer_state.pt" ]; then
  .venv/bin/python scripts/export_drafter.py "$RUN" "$DEST"
else
  for name in model.safetensors config.json train_config.json train_log.jsonl heldout_log.jsonl; do
    cp "$RUN/$name" "$DEST/$name"
  done
fi
.venv/bin/dspark calibrate --checkpoint "$DEST" \
  --data data/smollm2_answers.jsonl.gz,data/smollm2_answers_t1.jsonl.gz \
  --temperature 0,1 --max-tokens 128 ${CALIBRATION_PROMPTS:+--limit "$CALIBRATION_PROMPTS"} \
  --max-running 16 --threads "${THREADS:-2}" --save-records data/calibration_rounds.npz 2>&1 \
  | grep -v "it/s" | tee docs/results/dspark_calibrate_heldout.txt
.venv/bin/python scripts/learning_curve.py $(ls "$DEST"/heldout_log_phase*.jsonl | sort -V) "$DEST" \
  --chain --csv docs/results/drafter_learning_curve.csv --png docs/results/drafter_learning_curve.png
