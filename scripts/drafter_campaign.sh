#!/usr/bin/env bash
# The DSpark drafter trained on every answer file the project has, in the background and
# resumably: run it again after any stop and it continues exactly (optimizer, schedule, data
# order) from runs/campaign/dspark-markov/checkpoint (saved every 50 steps). It starts from the
# shipped checkpoints/dspark-markov, with a bfloat16 teacher (the target's forward is most of a
# step) whose outputs are cached in memory, 4 answers x 128 anchor blocks a step, and logs the
# held-out acceptance (greedy and T=1, 64 held-out greedy answers) every 100 steps to
# heldout_log.jsonl: the learning curve (scripts/learning_curve.py draws it).
#   nohup bash scripts/drafter_campaign.sh > runs/drafter_campaign.log 2>&1 &
# STEPS (default 2400) sets the schedule's length; THREADS (default 2) torch's threads.
set -euo pipefail
cd "$(dirname "$0")/.."
renice -n 10 $$ >/dev/null
OUT=runs/campaign/dspark-markov
mkdir -p runs/campaign
# The growing answer file is copied once, so that a resumed run reads the same examples.
[ -f runs/campaign/greedy_answers.jsonl.gz ] || cp data/answers/greedy.jsonl.gz runs/campaign/greedy_answers.jsonl.gz
DATA=../shared/data/answers/smollm2_greedy_fp32.jsonl.gz,data/smollm2_answers_t1.jsonl.gz,data/smollm2_answers.jsonl.gz,runs/campaign/greedy_answers.jsonl.gz
T=$(.venv/bin/python -c "from dspark.fetch import ensure_model; print(ensure_model())")
exec .venv/bin/dspark train --data "$DATA" --target "$T" --out "$OUT" \
  --method markov --layers 2 --markov-rank 64 --gamma 7 --draft-vocab 8192 --inject-last-context \
  --output-norm-lr-scale 30 --init-from-drafter checkpoints/dspark-markov \
  --steps "${STEPS:-2400}" --warmup 30 --lr 1e-3 --batch 4 --anchors 128 \
  --target-dtype bfloat16 --teacher-cache --teacher-cache-gb 6 \
  --log-every 10 --save-every 50 --eval-every 100 --eval-examples 64 --eval-anchors 64 \
  --threads "${THREADS:-2}" --no-progress
