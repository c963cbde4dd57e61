#!/usr/bin/env bash
# The DSpark drafter trained on every answer file the project has, in the background and
# resumably: run it again after any stop and it continues exactly (optimizer, schedule, data
# order) from $CAMPAIGN/dspark-markov/checkpoint (saved every 50 steps). $CAMPAIGN (default
# ~/.cache/dspark/campaign) lies outside the work tree, so a machine that is kept keeps it when the
# checkout is laid anew. It starts from the shipped checkpoints/dspark-markov, with a bfloat16
# teacher whose outputs are cached in memory and the drafter's forward/backward under bf16
# autocast (1.5x the anchor blocks per second on an AMX-BF16 CPU, bench/train_step.py),
# 4 answers x 128 anchor blocks a step, and logs the held-out acceptance (greedy and T=1, 64
# held-out greedy answers) every EVAL_EVERY steps to heldout_log.jsonl: the learning curve
# (scripts/learning_curve.py draws it).
#   nohup bash scripts/drafter_campaign.sh > runs/drafter_campaign.log 2>&1 &
#   .venv/bin/python scripts/export_drafter.py ~/.cache/dspark/campaign/dspark-markov checkpoints/dspark-markov
# STEPS (default 800) sets the schedule's length (raise it to go on after a finished run: the cosine
# stretches to the new length from the step reached), THREADS (default 1) torch's threads. SEED
# (default: the number of the phase this run trains, one more than the shipped drafter's
# train_log_phaseN files + 1) orders the answers and anchors, so that each phase starts on answers
# the phase before it did not reach first. LR (default 1e-3) is the peak learning rate after the
# WARMUP (default 30) warm-up steps: a phase that continues a trained drafter pays for a full warm
# restart (held-out tau fell by 0.13 in the first 50 steps of a 400-step phase at 1e-3), so a short
# phase wants less, and a longer warm-up lets Adam's fresh moment estimates settle first.
set -euo pipefail
cd "$(dirname "$0")/.."
renice -n 10 $$ >/dev/null
CAMPAIGN=${CAMPAIGN:-$HOME/.cache/dspark/campaign}
OUT=$CAMPAIGN/dspark-markov
mkdir -p "$CAMPAIGN"
# The growing answer files are copied once, so that a resumed run reads the same examples.
for name in greedy t1 chat_t1 greedy_t1_prompts chat_t07 t1_greedy_prompts; do
  [ -f "$CAMPAIGN/${name}_answers.jsonl.gz" ] || cp "data/answers/$name.jsonl.gz" "$CAMPAIGN/${name}_answers.jsonl.gz"
done
SHARED=${DSPARK_SHARED_DIR:-../shared}  # as dspark.paths.SHARED_DIR
DATA=$SHARED/data/answers/smollm2_greedy_fp32.jsonl.gz,data/smollm2_answers_t1.jsonl.gz,data/smollm2_answers.jsonl.gz
DATA=$DATA,$CAMPAIGN/greedy_answers.jsonl.gz,$CAMPAIGN/t1_answers.jsonl.gz,$CAMPAIGN/chat_t1_answers.jsonl.gz
DATA=$DATA,$CAMPAIGN/greedy_t1_prompts_answers.jsonl.gz,$CAMPAIGN/chat_t07_answers.jsonl.gz
DATA=$DATA,$CAMPAIGN/t1_greedy_prompts_answers.jsonl.gz
last=$(ls checkpoints/dspark-markov | sed -n 's/^train_log_phase\([0-9]*\)\.jsonl$/\1/p' | sort -n | tail -1)
SEED=${SEED:-$(( ${last:-0} + 2 ))}
T=$(.venv/bin/python -c "from dspark.fetch import ensure_model; print(ensure_model())")
exec .venv/bin/dspark train --data "$DATA" --target "$T" --out "$OUT" \
  --method markov --layers 2 --markov-rank 64 --gamma 7 --draft-vocab 8192 --inject-last-context \
  --output-norm-lr-scale 30 --init-from-drafter checkpoints/dspark-markov \
  --steps "${STEPS:-800}" --warmup "${WARMUP:-30}" --lr "${LR:-1e-3}" --batch 4 --anchors 128 \
  --target-dtype bfloat16 --student-dtype bfloat16 --teacher-cache --teacher-cache-gb 6 \
  --log-every 10 --save-every 50 --eval-every "${EVAL_EVERY:-200}" --eval-examples 64 --eval-anchors 64 \
  --threads "${THREADS:-1}" --seed "$SEED" --no-progress
