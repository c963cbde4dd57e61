#!/usr/bin/env bash
# The target answers training prompts for the drafter, in the background and resumably: about
# 12,500 prompts greedy, then about 17,700 at T=1 (top-k and top-p off: every training prompt no
# other file answered, nl2bash and nq_open capped by the source weights), then at T=1 every chat
# prompt (roleplay, awesome-chatgpt, self-instruct: 2,636) that no T=1 file answered, since chat
# is the text the drafter accepts least and the T=1 step's weights gave it few, then greedily the
# prompts that have only T=1 answers (the T=1 step's selection less every greedy file's prompts),
# so that every prompt has a greedy answer and half the answers are greedy, then every chat prompt
# again at T=0.7 (a common served temperature; chat is still the text the drafter accepts least, and
# every chat prompt already has a greedy and a T=1 answer), then at T=1 the prompts that have only
# greedy answers (T=1 is the temperature the drafter falls shortest at); 128 answers in flight,
# one thread at a low CPU priority (nice 10, as the drafter campaign) so the machine stays usable. DTYPE (default bfloat16)
# sets the target's dtype: bf16 doubles the rate on a CPU with AMX-BF16 (bench/data_generate.py);
# every record says which dtype wrote it (the greedy file's first 7,124 answers are float32). Every answer is
# appended as it finishes, so a stopped run loses at most the answers in flight; run this again to
# go on. Each step excludes the prompts that already have an answer at its temperature, so no
# prompt is answered twice at the same temperature.
#   nohup bash scripts/answers_campaign.sh > runs/answers_campaign.log 2>&1 &
#   .venv/bin/dspark data stats --out data/answers/greedy.jsonl.gz
set -euo pipefail
cd "$(dirname "$0")/.."
renice -n 10 $$ >/dev/null
export OMP_NUM_THREADS=1
SHARED=${DSPARK_SHARED_DIR:-../shared}  # as dspark.paths.SHARED_DIR
EXCLUDE=(--exclude data/smollm2_answers.jsonl.gz --exclude data/smollm2_answers_t1.jsonl.gz
         --exclude "$SHARED/data/answers/smollm2_greedy_fp32.jsonl.gz")
COMMON=(--max-new-tokens 256 --batch-size 128 --dtype "${DTYPE:-bfloat16}" --threads 1)
.venv/bin/dspark data generate --out data/answers/greedy.jsonl.gz --num-prompts 12500 "${COMMON[@]}" --temperature 0 \
  --seed 11 "${EXCLUDE[@]}" --exclude data/answers/t1.jsonl.gz
.venv/bin/dspark data generate --out data/answers/t1.jsonl.gz --num-prompts 40000 "${COMMON[@]}" --temperature 1 \
  --top-p 1 --top-k 0 --seed 12 "${EXCLUDE[@]}" --exclude data/answers/greedy.jsonl.gz
.venv/bin/dspark data generate --out data/answers/chat_t1.jsonl.gz --num-prompts 10000 "${COMMON[@]}" \
  --temperature 1 --top-p 1 --top-k 0 --seed 13 \
  --sources gpteacher_roleplay,awesome_chatgpt_prompts,self_instruct_seed \
  --exclude data/smollm2_answers_t1.jsonl.gz --exclude data/answers/t1.jsonl.gz
.venv/bin/dspark data generate --out data/answers/greedy_t1_prompts.jsonl.gz --num-prompts 40000 "${COMMON[@]}" \
  --temperature 0 --seed 12 --exclude data/smollm2_answers.jsonl.gz \
  --exclude "$SHARED/data/answers/smollm2_greedy_fp32.jsonl.gz" --exclude data/answers/greedy.jsonl.gz
.venv/bin/dspark data generate --out data/answers/chat_t07.jsonl.gz --num-prompts 10000 "${COMMON[@]}" \
  --temperature 0.7 --top-p 1 --top-k 0 --seed 15 \
  --sources gpteacher_roleplay,awesome_chatgpt_prompts,self_instruct_seed
.venv/bin/dspark data generate --out data/answers/t1_greedy_prompts.jsonl.gz --num-prompts 40000 "${COMMON[@]}" \
  --temperature 1 --top-p 1 --top-k 0 --seed 14 --exclude data/smollm2_answers_t1.jsonl.gz \
  --exclude data/answers/t1.jsonl.gz --exclude data/answers/chat_t1.jsonl.gz
