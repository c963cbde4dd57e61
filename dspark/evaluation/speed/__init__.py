"""`dspark bench` (and `bench/e2e.py`, the same flags): the end-to-end speed benchmark, output
tokens/s of whole generations (docs/design.md sections 9-10).

Rows (`--methods`, in this order):
- `target`: our engine with policy `none` (no drafter): the baseline every ratio is taken against;
- `mtp1`: MTP-1-like, the DSpark drafter (`checkpoints/dspark-markov`) with `fixed:1`;
- `dflash`: the DFlash drafter (`checkpoints/dflash`) verifying its full block, `fixed:gamma`;
- `dspark`: DSpark (`checkpoints/dspark-markov`, STS calibration applied) with `async_topk`;
- `dspark-paper`: the same with the paper's objective Theta = tau * SPS(B), which takes drafting
  as free (`ThetaObjective.PAPER`); `dspark` charges a round that verifies drafts for drafting
  them too (`SHARED_DEVICE`, the engine's default), as drafter and target share this CPU;
- `dspark-full`: the same drafter verifying its full block every round (`fixed:gamma`): what
  `async_topk`'s choice of how many drafts to verify is measured against;
- `dspark-fixed2`, `dspark-fixed3`: the same drafter verifying its first 2 or 3 drafts every round
  (`fixed:N`; `mtp1` is N = 1): the fixed lengths between one draft and the full block;
- `dspark-block`: `dspark` with sampled requests verified by the block rule
  (`--verification block` for this row alone, `dspark.block_verification`), so that the two
  rules take turns wave by wave in one run;
- `dspark-sync`: the same drafter with `sync_greedy` (the paper's Algorithm 1: drafts every
  round, then admits by Theta with SPS(B));
- `hf-generate`: transformers `generate` on the same weights in this process;
- `hf-prompt-lookup`: transformers prompt-lookup decoding (`prompt_lookup_num_tokens`).
A row whose drafter checkpoint is missing is reported as missing.

Workload: the first turn of the first prompts of each eval file (gsm8k, humaneval, mt-bench) under
the chat template; greedy and temperature 1.0 (each request its own seed); generation stops at EOS
/ end of turn or `--max-tokens`. Concurrency C: the prompts of a dataset run in waves of C streams
submitted together (C = 1: requests one after another). Each dataset contributes C * ceil(limit / C)
prompts at concurrency C, so every wave is full. transformers peers run a wave as one batched
`generate` with left padding; prompt lookup supports batch 1 only, so its C streams run one after
another (said in the table).

Speed = output tokens (stop token included) / wall seconds of the waves, prefill included;
the macro average is the mean over datasets of each dataset's tokens/s. The rows take turns wave by
wave, so a load change on the shared machine hits every row alike, and every ratio is against the
target-only row of the same (temperature, concurrency) run (docs/design.md 9: compare as ratios).

Time breakdown of the engine rows (sums over the timed waves of the steps' `RoundStats.seconds`):
- prefill: target forward over the prompts and the first token (a prompt chunk that rides in a
  verification forward counts its tokens' share of it);
- drafter context: the drafter absorbing committed tokens' target features (`append_context`;
  features the verifier held are handed over just before drafting and count as draft);
- draft: drafting the blocks; admission: the policy's decision;
- target forward: the flattened verification forward;
- sampling + commit: the rest of the verifier's call: rejection sampling, KV cache truncation,
  feature slicing;
- rest: wall time minus all of the above = the round loop's Python overhead.

stdout: a markdown table per (temperature, concurrency), the breakdowns, and one final JSON line.
Progress goes to stderr. Usage:
    .venv/bin/python bench/e2e.py [--limit 4] [--max-tokens 128] [--temperatures 0,1.0]
        [--concurrency 1,8] [--methods target,mtp1,dflash,dspark,hf-generate,hf-prompt-lookup]

The modules: `rows` (what each row runs), `waves` (one wave of a row, its `Tally`), `prepare`
(what is loaded once), `tables` (the figures as JSON and markdown), `bench_cli` (the command).
"""
