"""The embedded engine under a closed loop of users, without the services: output tokens/s and
where the target's time goes, for each attention implementation, in one run.

What the load test's users do to the engine, minus the network, the gateway and Locust: `--users`
requests run at once (policy `none`, greedy, `--max-tokens` each, stopping at the chat's stop
tokens); whenever one finishes the next prompt joins (the eval sets' first turns, chat-templated,
round-robin over the files). After `--warmup-s`, `--seconds` are counted. Every target forward is
timed and classed as a decode pass (one new token per request) or a pass that reads prompt
tokens (chunked prefill, with or without decode rows). The implementations alternate, `--repeats`
times, so a load change on a shared machine hits each alike. Prints a markdown table and one JSON
line. Usage:
    .venv/bin/python bench/closed_loop.py [--users 16] [--attention paged,per_request]
        [--dtype float32] [--seconds 40] [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from target_decode import chat_prompts  # noqa: E402

from dspark.cpu_info import cpu_description  # noqa: E402
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig  # noqa: E402
from dspark.loading import build_engine  # noqa: E402
from dspark.fetch import ensure_model  # noqa: E402
from dspark.models.runner import RunnerConfig, TargetRunner  # noqa: E402
from dspark.models.transformer import AttentionImpl  # noqa: E402
from dspark.paths import EVAL_PROMPTS_DIR  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402
from dspark.step_result import StepResult  # noqa: E402
from dspark.step_timing import startup_cost_table  # noqa: E402
from dspark.stop_tokens import stop_token_ids  # noqa: E402
from dspark.verifier import TargetVerifier  # noqa: E402


@dataclass
class PassTimes:
    """Target forwards of one class while counting: how many, their seconds, their request rows."""

    count: int = 0
    seconds: float = 0.0
    rows: int = 0

    def summary(self) -> dict:
        n = max(self.count, 1)
        return {"passes": self.count, "seconds": round(self.seconds, 2),
                "ms_per_pass": round(1000 * self.seconds / n, 1), "rows_per_pass": round(self.rows / n, 1)}


@dataclass
class LoopResult:
    tokens: int = 0
    seconds: float = 0.0
    finished: int = 0
    passes: dict[str, PassTimes] = field(default_factory=lambda: {"decode": PassTimes(),
                                                                 "reads prompt": PassTimes()})


@dataclass
class LoopWindow:
    """What the counted window of a closed loop produced."""

    tokens: int = 0
    seconds: float = 0.0
    finished: int = 0


def drive(engine: Engine, prompts: list[list[int]], stops: list[int], users: int, max_tokens: int,
          warmup_s: float, seconds: float,
          on_step: Callable[[float, bool, StepResult], None] | None = None) -> LoopWindow:
    """Keep `users` greedy requests of `max_tokens` running on `engine` (a finished one is
    replaced at once by the next prompt, round-robin), count `seconds` after `warmup_s`.
    `on_step(step seconds, counted, what the step did)` is called after every engine step."""
    window, joined = LoopWindow(), 0
    sampling = SamplingParams(temperature=0)

    def join() -> None:
        nonlocal joined
        engine.add_request(prompts[joined % len(prompts)], sampling, max_tokens, stops)
        joined += 1

    for _ in range(users):
        join()
    begin = time.perf_counter()
    counted_from = None
    while True:
        start = time.perf_counter()
        result = engine.step()
        now = time.perf_counter()
        counting = counted_from is not None
        if on_step is not None:
            on_step(now - start, counting, result)
        for out in result.outputs:
            if counting:
                window.tokens += len(out.new_token_ids)
            if out.finished:  # replaced at once, in the warm-up too: the loop stays at `users`
                window.finished += counting
                join()
        if counted_from is None and now - begin >= warmup_s:
            counted_from = now  # counted from the next step on
        elif counting and now - counted_from >= seconds:
            window.seconds = now - counted_from
            return window


def run_loop(runner: TargetRunner, prompts: list[list[int]], stops: list[int], args) -> LoopResult:
    """One closed-loop run on `runner`; the forwards are timed through a wrapper on the runner."""
    result = LoopResult()
    step_passes: list[tuple[str, int, float]] = []  # this step's forwards: kind, rows, seconds
    forward = runner.forward

    def timed_forward(items, *rest, **kwargs):
        start = time.perf_counter()
        out = forward(items, *rest, **kwargs)
        kind = "decode" if all(len(it.token_ids) == 1 for it in items) else "reads prompt"
        step_passes.append((kind, len(items), time.perf_counter() - start))
        return out

    def count_passes(step_seconds: float, counted: bool, step: StepResult) -> None:
        for kind, rows, seconds in step_passes if counted else ():
            times = result.passes[kind]
            times.count, times.rows, times.seconds = times.count + 1, times.rows + rows, times.seconds + seconds
        step_passes.clear()

    runner.forward = timed_forward
    config = EngineConfig(AdmissionConfig(policy="none"), batching=BatchingConfig(
        max_running=args.users, prefill_chunk_tokens=args.prefill_chunk_tokens))
    engine = build_engine(TargetVerifier(runner), None, startup_cost_table(runner), config)
    window = drive(engine, prompts, stops, args.users, args.max_tokens, args.warmup_s,
                   args.seconds, count_passes)
    result.tokens, result.seconds, result.finished = window.tokens, window.seconds, window.finished
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=256, help="distinct prompts in the loop")
    parser.add_argument("--attention", default="paged,per_request",
                        help="comma-separated AttentionImpl values, alternated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefill-chunk-tokens", type=int, default=BatchingConfig.prefill_chunk_tokens)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    impls = [AttentionImpl(a.strip()) for a in args.attention.split(",") if a.strip()]
    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tokenizer, args.prompts, args.eval_dir)
    stops = list(stop_token_ids(tokenizer))
    runs: dict[str, list[LoopResult]] = {impl.value: [] for impl in impls}
    for _ in range(args.repeats):
        for impl in impls:
            runner = TargetRunner(model_dir, RunnerConfig(attention=impl, dtype=args.dtype,
                                                          kv_cache_tokens=args.users * 4096))
            runs[impl.value].append(run_loop(runner, prompts, stops, args))
            del runner

    rows = {}
    for name, results in runs.items():
        rate = [r.tokens / r.seconds for r in results]
        decode_ms = [1000 * r.passes["decode"].seconds / max(r.passes["decode"].count, 1) for r in results]
        share = [r.passes["reads prompt"].seconds / r.seconds for r in results]
        rows[name] = {"tok_s": [round(x, 1) for x in rate], "tok_s_median": round(statistics.median(rate), 1),
                      "decode_pass_ms_median": round(statistics.median(decode_ms), 1),
                      "prompt_pass_share_median": round(statistics.median(share), 2),
                      "finished": [r.finished for r in results],
                      "passes": [{k: v.summary() for k, v in r.passes.items()} for r in results]}
    base = rows[impls[-1].value]["tok_s_median"] or float("nan")  # nan: no tokens in the window
    print(f"{args.users} users, {args.max_tokens} tokens, {args.dtype}, {args.threads} thread(s), "
          f"prefill chunk {args.prefill_chunk_tokens}, {cpu_description()}")
    print(f"\n| attention | tok/s (each run) | median | / {impls[-1].value} | decode pass ms | "
          "share of time in passes that read prompts |\n|---|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {', '.join(map(str, row['tok_s']))} | {row['tok_s_median']} | "
              f"{row['tok_s_median'] / base:.2f} | {row['decode_pass_ms_median']} | "
              f"{row['prompt_pass_share_median']} |")
    print(json.dumps({"bench": "closed_loop", "users": args.users, "max_tokens": args.max_tokens,
                      "dtype": args.dtype, "threads": args.threads,
                      "prefill_chunk_tokens": args.prefill_chunk_tokens, **cpu_description(),
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
