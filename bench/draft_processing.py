"""What processing the drafts gains in acceptance: tau with the drafts processed by the request's
logit_bias, min_tokens, penalties, min_p and grammar (dspark.models.draft_processing,
dspark.models.draft_sampling) against drafts from the drafter's raw distribution, on the cases
where it matters.

Cases (the shipped drafter and target, chat template, greedy or `--temperature`):
- min_tokens: short-answer prompts that end after a few tokens, with min_tokens = `--min-tokens`
  (the raw drafter keeps proposing EOS, which the target holds back);
- logit_bias: eval prompts (gsm8k) with -100 on the tokens most frequent in their plain outputs
  (`--banned`), so the raw drafter proposes banned tokens;
- json_schema: prompts asking for a person as JSON, under a small schema (the raw drafter
  proposes tokens the grammar refuses);
- penalties: eval prompts (gsm8k) with `--repetition-penalty`, `--frequency-penalty` and
  `--presence-penalty` (the target moves mass off the tokens seen, the raw drafter does not);
- min_p (sampled runs only: greedy ignores it): eval prompts (gsm8k) with `--min-p`.
`--cases` picks some of them (default: all).
Every round verifies the whole block (policy fixed:gamma), so tau measures acceptance only.
The baseline strips the processing from each draft request (`RawDrafts`) in the same process;
the outputs of the two runs are the same (greedy: asserted; the target decides). Also prints
the drafting time per round of each (the grammar's per-position matcher costs host time).
Usage:
    .venv/bin/python bench/draft_processing.py [--limit 8] [--max-tokens 96] [--threads 1]
        [--cases penalties,min_p]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from dspark.cost_table import CostTable
from dspark.cpu_info import cpu_line
from dspark.engine import Engine, EngineConfig
from dspark.evaluation.eval_cli import read_eval_prompts
from dspark.fetch import ensure_model
from dspark.loading import load_method_drafter, load_target
from dspark.models.drafter_config import DrafterConfig
from dspark.paths import DEFAULT_DRAFTER, EVAL_PROMPTS_DIR
from dspark.sampling import SamplingParams
from dspark.stop_tokens import stop_token_ids
from dspark.structured_output import GrammarCompiler, GrammarSpec
from dspark.training.data import encode_chat
from dspark.verifier import TargetVerifier

# A flat cost table: admission plays no part under fixed:gamma.
FLAT = CostTable.from_step_seconds({b: 0.05 for b in (1, 2, 4, 8, 16, 32, 64)})
SHORT_QUESTIONS = [
    "What is the capital of France? Answer with one word.",
    "Is water wet? Answer yes or no.",
    "What is 2 + 2? Reply with the number only.",
    "Name a primary color. One word.",
    "What is the opposite of hot? One word.",
    "How many legs does a spider have? Number only.",
    "What planet do we live on? One word.",
    "Which animal says meow? One word.",
]
PERSON_PROMPTS = [
    "Describe a fictional person as JSON with their name, age and city.",
    "Give me a JSON object for a customer: name, age, city.",
    "Invent a character and return it as JSON (name, age, city).",
    "Return a JSON record of a famous scientist: name, age at death, city of birth.",
    "Make up a user profile in JSON with name, age and city.",
    "JSON please: a person with a name, an age and a city.",
    "Output a JSON object describing your best friend (name, age, city).",
    "Create a JSON entry for an employee with name, age, city.",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"]}


class RawDrafts:
    """A drafter whose draft requests lose their processing (logit_bias, min_tokens, penalties,
    min_p, grammar): the drafts come from the raw distribution, as before draft processing.
    Times every call."""

    def __init__(self, drafter, raw: bool) -> None:
        self.inner, self.raw = drafter, raw
        self.seconds, self.calls = 0.0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, requests, **kwargs):
        if self.raw:
            requests = [dataclasses.replace(r, grammar=None, token_ids=None,
                                            sampling=dataclasses.replace(
                r.sampling, logit_bias=(), min_tokens=0, repetition_penalty=1.0,
                frequency_penalty=0.0, presence_penalty=0.0, min_p=0.0)) for r in requests]
        start = time.perf_counter()
        blocks = self.inner.draft(requests, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return blocks


def run(runner, drafter, grammars, raw: bool, prompts, sampling, max_tokens, stops,
        grammar=None) -> dict:
    wrapped = RawDrafts(drafter, raw)
    engine = Engine(TargetVerifier(runner, grammars=grammars), wrapped, FLAT,
                    EngineConfig().with_values(policy=f"fixed:{drafter.gamma}", max_running=8,
                                               update_cost_table=False))
    ids = [engine.add_request(p, sampling, max_tokens, stops, grammar=grammar) for p in prompts]
    by_id = {r.request_id: r for r in engine.waiting}
    while engine.has_unfinished():
        engine.step()
    done = [by_id[i] for i in ids]
    rounds = sum(r.metrics.rounds for r in done)
    accepted = sum(r.metrics.drafts_accepted for r in done)
    return {"tau": (rounds + accepted) / rounds, "rounds": rounds,
            "tokens": sum(len(r.output_ids) for r in done),
            "draft_ms_per_round": 1000 * wrapped.seconds / max(1, wrapped.calls),
            "outputs": [r.output_ids for r in done]}


def grammar_cursor_ms(grammars: GrammarCompiler, tokenizer, stops, repeats: int = 20) -> float:
    """The drafter's host cost of the grammar per request and block position: the matcher's
    mask over the target vocabulary (allowed_tokens) and following the draft (try_accept),
    along a JSON text valid under SCHEMA, rolled back after each pass."""
    tokens = tokenizer(json.dumps({"name": "Ada Lovelace", "age": 36, "city": "London"},
                                  separators=(", ", ": ")))["input_ids"]
    state = grammars.start(GrammarSpec.json_schema(SCHEMA), stops)
    start = time.perf_counter()
    for _ in range(repeats):
        for token in tokens:
            state.allowed_tokens()
            assert state.try_accept(token)
        state.rollback(len(tokens))
    return 1000 * (time.perf_counter() - start) / (repeats * len(tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--banned", type=int, default=2, help="tokens banned by logit_bias")
    parser.add_argument("--repetition-penalty", type=float, default=1.2)
    parser.add_argument("--frequency-penalty", type=float, default=0.5)
    parser.add_argument("--presence-penalty", type=float, default=0.5)
    parser.add_argument("--min-p", type=float, default=0.1)
    parser.add_argument("--cases", default="min_tokens,logit_bias,json_schema,penalties,min_p",
                        help="comma-separated: min_tokens, logit_bias, json_schema, penalties, "
                             "min_p (min_p only with --temperature > 0)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = args.model_dir or ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = DrafterConfig.load(args.checkpoint)
    runner = load_target(model_dir, tuple(config.target_layer_ids), kv_cache_tokens=8 * 4096)
    drafter = load_method_drafter(args.checkpoint, runner, apply_calibration=True)
    grammars = GrammarCompiler(tokenizer=tokenizer, vocab_size=runner.vocab_size)
    stops = stop_token_ids(tokenizer)
    T = args.temperature

    def seeded(**fields) -> SamplingParams:
        return SamplingParams(temperature=T, seed=0 if T else None, **fields)

    short = [encode_chat(tokenizer, q) for q in SHORT_QUESTIONS[:args.limit]]
    gsm8k = [encode_chat(tokenizer, t)
             for t in read_eval_prompts(args.eval_dir / "gsm8k.jsonl", args.limit)]
    people = [encode_chat(tokenizer, q) for q in PERSON_PROMPTS[:args.limit]]
    chosen = set(args.cases.split(","))
    unknown = chosen - {"min_tokens", "logit_bias", "json_schema", "penalties", "min_p"}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}")
    cases = {}
    if "min_tokens" in chosen:
        cases[f"min_tokens={args.min_tokens}"] = (short, seeded(min_tokens=args.min_tokens), None)
    if "logit_bias" in chosen:
        plain = run(runner, drafter, grammars, False, gsm8k, seeded(), args.max_tokens, stops)
        counts = collections.Counter(t for out in plain["outputs"] for t in out if t not in stops)
        banned = [t for t, _ in counts.most_common(args.banned)]
        cases[f"logit_bias -100 on {[tokenizer.decode([t]) for t in banned]}"] = (
            gsm8k, seeded(logit_bias={t: -100.0 for t in banned}), None)
    if "json_schema" in chosen:
        cases["json_schema"] = (people, seeded(), GrammarSpec.json_schema(SCHEMA))
    if "penalties" in chosen:
        cases[f"repetition_penalty={args.repetition_penalty:g}, frequency_penalty="
              f"{args.frequency_penalty:g}, presence_penalty={args.presence_penalty:g}"] = (
            gsm8k, seeded(repetition_penalty=args.repetition_penalty,
                          frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty), None)
    if "min_p" in chosen and T > 0:
        cases[f"min_p={args.min_p:g}"] = (gsm8k, seeded(min_p=args.min_p), None)
    print(f"# {cpu_line()}; torch {torch.__version__}, {args.threads} threads; "
          f"{args.checkpoint}, temperature {T:g}, fixed:{drafter.gamma}, {args.limit} prompts "
          f"a case, {args.max_tokens} tokens", flush=True)
    print("| case | tokens | tau raw drafts | tau processed drafts | ratio | "
          "draft ms/round raw | processed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for name, (prompts, sampling, grammar) in cases.items():
        raw = run(runner, drafter, grammars, True, prompts, sampling, args.max_tokens, stops,
                  grammar)
        processed = run(runner, drafter, grammars, False, prompts, sampling, args.max_tokens,
                        stops, grammar)
        if T == 0:  # the target decides every token: the same outputs either way
            assert raw["outputs"] == processed["outputs"], name
        rows[name] = {k: {f: round(v, 4) if isinstance(v, float) else v
                          for f, v in r.items() if f != "outputs"}
                      for k, r in (("raw", raw), ("processed", processed))}
        print(f"| {name} | {processed['tokens']} | {raw['tau']:.3f} | {processed['tau']:.3f} | "
              f"{processed['tau'] / raw['tau']:.3f} | {raw['draft_ms_per_round']:.1f} | "
              f"{processed['draft_ms_per_round']:.1f} |", flush=True)
    cursor_ms = grammar_cursor_ms(grammars, tokenizer, stops)
    print(f"\ngrammar cursor (allowed_tokens + try_accept, one request, one position): "
          f"{cursor_ms:.3f} ms")
    print(json.dumps({"bench": "draft_processing", "cpu": cpu_line(), "threads": args.threads,
                      "temperature": T, "limit": args.limit, "max_tokens": args.max_tokens,
                      "cases": rows, "grammar_cursor_ms": round(cursor_ms, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
