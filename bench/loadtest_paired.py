"""Two policies' service stacks under the same Locust load at the same time: a paired A/B.

`loadtest.sweep` runs one policy's stack after the other. On a shared machine whose speed drifts
by 10-20% from one minute to the next (the same 16-request decode round took 170 ms in one run
and 213 ms in the next on a 2-core CPU), a few percent between policies is then below the noise. Here both
stacks run side by side, each driven by its own headless Locust with the same users, duration
and prompts, so both see the same machine at the same moments; the ratio of their aggregate
throughputs is what is compared, repeat by repeat. On 2 cores each stack gets about a core
(every service is single-threaded and a stack's services take turns); at 16 users each stack
still served about 51 tok/s, as much as one alone, but the ratio is the
measurement, not the absolute numbers.

The stacks are started once and warmed up; each repeat is one concurrent pair of Locust runs.
Prints a table (per repeat: each policy's aggregate tokens/s, the ratio of the first policy's to
the second's, and the first one's mean verification length and share of engine time spent
drafting), the median and geometric-mean ratio, and one JSON line; writes `paired.csv` to
--out. Usage:

    .venv/bin/python bench/loadtest_paired.py [--policies async_topk,none] [--users 16]
        [--duration-s 60] [--repeats 3] [--max-tokens 64] [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

# Run by path: this checkout's packages come first on sys.path, before dspark (and so
# dspark.paths.REPO_ROOT) can be imported, hence its own path here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.paths import REPO_ROOT  # noqa: E402
from loadtest.prometheus import (SpeculationDelta, counter_values, round_count,  # noqa: E402
                                 stage_seconds)
from loadtest.results import LevelResult, write_csv  # noqa: E402
from loadtest.sweep import choose_models, configure, run_locust  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/loadtest_paired.py",
                                     description=__doc__.split("\n")[0])
    configure(parser)  # the sweep's options: models, prompts, max tokens, SLA, ...
    parser.add_argument("--repeats", type=int, default=3, help="concurrent pairs of runs")
    # Two stacks share the machine here, so each model takes one thread unless asked otherwise
    # (a stack alone splits all the cores: dspark.serving.core_split).
    parser.set_defaults(policies="async_topk,none", users=[16], max_tokens=64,
                        verifier_threads=1, drafter_threads=1)
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if len(policies) != 2 or policies[0] == policies[1]:
        parser.error(f"--policies needs two different policies, got {args.policies!r}")
    if len(args.users) != 1:
        parser.error("--users takes one level here")
    if args.repeats < 1 or args.duration_s <= 0:
        parser.error("need --repeats >= 1 and --duration-s > 0")
    args.policy_pair = policies
    return args


def run_level(stack, args: argparse.Namespace, model_name: str, prefix: Path,
              into: dict, key: str) -> None:
    """One Locust run against `stack`, its LevelResult stored in into[key] (or the exception)."""
    try:
        text = stack.metrics_text()
        before, stages_before = counter_values(text), stage_seconds(text)
        rounds_before = round_count(text)
        summary = run_locust(stack, args, model_name, args.users[0], prefix)
        text = stack.metrics_text()
        delta = SpeculationDelta.between(before, counter_values(text), stages_before,
                                         stage_seconds(text))
        rounds = round_count(text) - rounds_before
        into[key] = LevelResult.from_run(stack.policy, args.users[0], summary, delta, args.sla)
        into[key + "/round_ms"] = ({stage: 1e3 * seconds / rounds
                                    for stage, seconds in delta.stage_seconds.items()}
                                   if rounds else {})
    except Exception as e:  # reported by the caller, after both threads are joined
        into[key] = e


def pair_columns(result: LevelResult, round_ms: dict[str, float], side: str) -> dict:
    """One side's columns: throughput, speculation, and engine ms per verifying round by stage
    (where a stack spends its rounds; the stages of the scheduler's `round_seconds_total`)."""
    stages = {f"{side}_{stage}_ms_per_round": round(ms, 2)
              for stage, ms in sorted(round_ms.items())}
    return {f"{side}_policy": result.policy,
            f"{side}_aggregate_tokens_per_s": round(result.aggregate_tokens_per_s, 3),
            f"{side}_responses": result.responses,
            f"{side}_verification_length": round(result.mean_verification_length, 4),
            f"{side}_draft_share": round(result.stage_share.get("draft", 0.0), 4), **stages}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from loadtest.stack import start_stack

    out = Path(args.out or REPO_ROOT / "runs" / time.strftime("paired-%Y%m%d-%H%M%S"))
    (out / "locust").mkdir(parents=True, exist_ok=True)
    models = choose_models(args, out)
    first, second = args.policy_pair
    stacks = {}
    try:
        for policy in (first, second):
            print(f"paired: starting the stack for {policy}", file=sys.stderr, flush=True)
            stacks[policy] = start_stack(models, policy, out / "logs" / policy.replace(":", "-"),
                                         tuple(args.extra_scheduler_args.split()))
        for stack in stacks.values():
            stack.warm_up(models.model_name)
        rows = []
        for repeat in range(1, args.repeats + 1):
            results: dict = {}
            threads = [threading.Thread(target=run_level, args=(
                stacks[p], args, models.model_name,
                out / "locust" / f"{p.replace(':', '-')}_r{repeat}", results, p))
                for p in (first, second)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for p in (first, second):
                if isinstance(results[p], Exception):
                    raise RuntimeError(f"{p}, repeat {repeat}: {results[p]}")
                if results[p].responses == 0:
                    raise RuntimeError(f"{p}, repeat {repeat}: no response completed; raise "
                                       "--duration-s or lower --max-tokens")
            a, b = results[first], results[second]
            rows.append({"repeat": repeat, "users": args.users[0],
                         **pair_columns(a, results[first + "/round_ms"], "a"),
                         **pair_columns(b, results[second + "/round_ms"], "b"),
                         "ratio_a_over_b": a.aggregate_tokens_per_s / b.aggregate_tokens_per_s})
            print(f"paired: repeat {repeat}: {first} {a.aggregate_tokens_per_s:.1f} tok/s, "
                  f"{second} {b.aggregate_tokens_per_s:.1f} tok/s, ratio "
                  f"{rows[-1]['ratio_a_over_b']:.3f}", file=sys.stderr, flush=True)
    except (RuntimeError, TimeoutError) as e:
        print(f"paired: {e}", file=sys.stderr)
        return 1
    finally:
        for stack in stacks.values():
            stack.stop()
    write_csv(out / "paired.csv", rows)
    print(format_table(rows, first, second))
    print(stage_table(rows, first, second))
    ratios = [r["ratio_a_over_b"] for r in rows]
    print(json.dumps({"policies": [first, second], "users": args.users[0],
                      "duration_s": args.duration_s, "ratios": [round(x, 4) for x in ratios],
                      "median_ratio": round(statistics.median(ratios), 4)}))
    return 0


def format_table(rows: list[dict], first: str, second: str) -> str:
    ratios = [r["ratio_a_over_b"] for r in rows]
    lines = [f"| repeat | {first} tok/s | {second} tok/s | {first} / {second} | "
             f"{first} verification length | {first} draft share |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['repeat']} | {r['a_aggregate_tokens_per_s']:.1f} | "
              f"{r['b_aggregate_tokens_per_s']:.1f} | {r['ratio_a_over_b']:.3f} | "
              f"{r['a_verification_length']:.2f} | {r['a_draft_share']:.3f} |" for r in rows]
    geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
    lines.append(f"\nratio {first} / {second}: median {statistics.median(ratios):.3f}, "
                 f"geometric mean {geo:.3f}, range {min(ratios):.3f}-{max(ratios):.3f} "
                 f"({len(ratios)} concurrent pairs, {rows[0]['users']} users each)")
    return "\n".join(lines)


def stage_table(rows: list[dict], first: str, second: str) -> str:
    """Engine ms per verifying round by stage, each side's mean over the repeats."""
    stages = sorted({k.split("_", 1)[1].removesuffix("_ms_per_round")
                     for r in rows for k in r if k.endswith("_ms_per_round")})
    lines = [f"\n| ms per round | {first} | {second} |", "|---|---:|---:|"]
    for stage in stages + ["total"]:
        cells = []
        for side in ("a", "b"):
            if stage == "total":
                values = [sum(v for k, v in r.items() if k.startswith(f"{side}_")
                              and k.endswith("_ms_per_round")) for r in rows]
            else:
                values = [r.get(f"{side}_{stage}_ms_per_round", 0.0) for r in rows]
            cells.append(f"{statistics.fmean(values):.2f}")
        lines.append(f"| {stage} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
