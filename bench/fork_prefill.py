"""n = 4 samples of one 500-token prompt, each sample its own request that reads the prompt
(`independent`, what the gateway did before forks) against samples 1..3 forking sample 0
(`forked`, dspark/forks.py): prompt tokens the target read, time to first token (TTFT: until
every sample has its first token, and sample 0's), and in how many runs sample i (seed i) gave
the tokens the request with seed i gives sent alone. The embedded engine on the real target and the shipped drafter, float32,
the two modes alternated in one process. Prints a table and one JSON line.
Usage:
    .venv/bin/python bench/fork_prefill.py [--prompt-tokens 500] [--n 4] [--repeats 3]
        [--max-tokens 16] [--chunk 256] [--threads 1] [--device auto|cpu|cuda[:N]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dspark.cost_table import CostTable
from dspark.cpu_info import cpu_line
from dspark.devices import add_device_argument, resolve_device
from dspark.engine import Engine, EngineConfig
from dspark.evaluation.eval_cli import read_eval_prompts
from dspark.fetch import ensure_model
from dspark.loading import load_method_drafter, load_target
from dspark.models.drafter_config import DrafterConfig
from dspark.paths import DEFAULT_DRAFTER, EVAL_PROMPTS_DIR
from dspark.sampling import SamplingParams
from dspark.training.data import encode_chat
from dspark.verifier import TargetVerifier

MODES = ("independent", "forked")


def run_once(engine: Engine, prompt: list[int], n: int, max_tokens: int, forked: bool) -> dict:
    """The n samples to the end: prompt tokens read and forked, TTFT (all, first), outputs."""
    start = time.perf_counter()
    parent = engine.add_request(prompt, SamplingParams(temperature=1.0, seed=0), max_tokens)
    ids = [parent] + [engine.add_request(prompt, SamplingParams(temperature=1.0, seed=i),
                                         max_tokens, fork_of=parent if forked else None)
                      for i in range(1, n)]
    requests = [engine.request(rid) for rid in ids]
    first_token: dict = {}
    read = forked_tokens = 0
    for result in engine.steps():
        read += result.stats.prompt_tokens
        forked_tokens += result.stats.forked_tokens
        now = time.perf_counter() - start
        for out in result.outputs:
            if out.new_token_ids:
                first_token.setdefault(out.request_id, now)
    return {"prompt_tokens_read": read, "prompt_tokens_forked": forked_tokens,
            "ttft_all_s": max(first_token.values()), "ttft_first_s": first_token[parent],
            "outputs": [r.output_ids for r in requests]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256, help="prefill_chunk_tokens")
    parser.add_argument("--policy", default="async_topk")
    parser.add_argument("--threads", type=int, default=1)
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = DrafterConfig.load(DEFAULT_DRAFTER)
    runner = load_target(model_dir, tuple(config.target_layer_ids), kv_cache_tokens=16 * 1024,
                         dtype="float32", device=resolve_device(args.device))
    drafter = load_method_drafter(DEFAULT_DRAFTER, runner, apply_calibration=True)
    prompt: list[int] = []
    for text in read_eval_prompts(EVAL_PROMPTS_DIR / "mt-bench.jsonl", 80):
        prompt += encode_chat(tokenizer, text)
        if len(prompt) >= args.prompt_tokens:
            break
    prompt = prompt[:args.prompt_tokens]
    table = CostTable.from_step_seconds({b: 0.03 + 0.002 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    print(f"# {cpu_line()}; {args.threads} threads, float32, {args.policy}, "
          f"prefill_chunk_tokens {args.chunk}, n {args.n}, prompt {len(prompt)} tokens",
          flush=True)
    for mode in MODES:  # warm-up, not counted: the first forwards of a process are slower
        run_once(Engine(TargetVerifier(runner), drafter, table, EngineConfig().with_values(
            policy=args.policy, update_cost_table=False, prefill_chunk_tokens=args.chunk)),
            prompt[:64], args.n, 2, mode == "forked")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            engine = Engine(TargetVerifier(runner), drafter, table, EngineConfig().with_values(
                policy=args.policy, update_cost_table=False, prefill_chunk_tokens=args.chunk))
            runs[mode].append(run_once(engine, prompt, args.n, args.max_tokens,
                                       mode == "forked"))
            r = runs[mode][-1]
            print(f"repeat {repeat} {mode:>11}: read {r['prompt_tokens_read']:5d}  forked "
                  f"{r['prompt_tokens_forked']:5d}  TTFT all {r['ttft_all_s']:.3f} s  "
                  f"first {r['ttft_first_s']:.3f} s", flush=True)
    # What "the same request sent alone" gives: each seed in an engine of its own.
    alone = [run_once(Engine(TargetVerifier(runner), drafter, table, EngineConfig().with_values(
        policy=args.policy, update_cost_table=False, prefill_chunk_tokens=args.chunk)),
        prompt, 1, args.max_tokens, False)["outputs"][0] if i == 0 else None
        for i in range(args.n)]
    for i in range(1, args.n):
        engine = Engine(TargetVerifier(runner), drafter, table, EngineConfig().with_values(
            policy=args.policy, update_cost_table=False, prefill_chunk_tokens=args.chunk))
        alone[i] = engine.request(engine.add_request(
            prompt, SamplingParams(temperature=1.0, seed=i), args.max_tokens)).output_ids
        while engine.has_unfinished():
            engine.step()
    same_as_alone = {m: [sum(r["outputs"][i] == alone[i] for r in runs[m]) for i in range(args.n)]
                     for m in MODES}
    summary = {m: {"prompt_tokens_read": runs[m][0]["prompt_tokens_read"],
                   "prompt_tokens_forked": runs[m][0]["prompt_tokens_forked"],
                   "ttft_all_median_s": statistics.median(r["ttft_all_s"] for r in runs[m]),
                   "ttft_first_median_s": statistics.median(r["ttft_first_s"] for r in runs[m])}
               for m in MODES}
    print(f"\n{'mode':>11} | prompt tokens read | forked | TTFT all (median) | TTFT sample 0")
    for m in MODES:
        s = summary[m]
        print(f"{m:>11} | {s['prompt_tokens_read']:18d} | {s['prompt_tokens_forked']:6d} | "
              f"{s['ttft_all_median_s']:15.3f} s | {s['ttft_first_median_s']:11.3f} s")
    ratio = summary["independent"]["ttft_all_median_s"] / summary["forked"]["ttft_all_median_s"]
    print(f"TTFT (all samples) independent / forked: {ratio:.2f}x")
    print(f"runs (of {args.repeats}) in which sample i (seed i) gave the tokens it gives sent "
          f"alone: {same_as_alone}")
    print(json.dumps({"bench": "fork_prefill", "n": args.n, "prompt_tokens": len(prompt),
                      "chunk": args.chunk, "policy": args.policy, "threads": args.threads,
                      "repeats": args.repeats, **summary, "ttft_all_speedup": round(ratio, 3),
                      "same_as_alone": same_as_alone}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
