"""The most any admission could make of a drafter at one stream: a hindsight schedule over the
round costs measured on this machine and the drafter's acceptance at every position.

Greedy decoding has one output whatever the policy, so the drafter's acceptance is a property
of each position of that output: a(t), the leading drafts of a block anchored at output token t
that equal the target's argmax, teacher-forced on prompt + output (the replay of
`served_vs_teacher_forced.py`, which checks it against served rounds), by the drafter as served
(its `--drafter-weights`) on transformers' features. A round anchored at t
that verifies k drafts commits 1 + min(a(t), k) tokens. The round costs are measured in the
embedded engine on one runner (`--weights`), one request at a time: R(1) a target-only step
(policy `none`), and R(1 + k) a round of policy `fixed:k`, which drafts and verifies k drafts
every round (its drafting D(1 + k) measured too); repeats in turns.

From those, over every output's anchors (those with a whole block of the output after them):
- **fixed k**: every round verifies k drafts (no admission);
- **first draft known**: a round of k drafts exactly where a(t) >= 1, a target-only step
  elsewhere (the best k): a perfect predictor of the first draft's fate, made before drafting;
- **hindsight**: the cheapest schedule knowing a(t) before each round: at each anchor a
  target-only step or a round of the k that makes the rest cheapest (dynamic programming over
  the anchors). No admission can beat it with this drafter on this machine: an admission
  decides before it knows a(t);
- **hindsight, drafting free**: the same with every round's drafting time taken out;
- **outcome-gated**: a gate that knows only the outcomes of past rounds (no confidences): rounds
  of k drafts, and after a round whose first draft fails, `pause` target-only steps; the best
  (k, pause) of a grid, chosen on the same outputs, and the drafter's catching up on the context
  of a pause not charged, so an upper bound for gates of that kind;
and, for `--goal`, the tokens a round of k drafts would have to commit for that speed-up at
the measured costs. Prints markdown tables and one JSON line. Usage:

    .venv/bin/python bench/speculation_ceiling.py [--limit 2 | --heldout 12] [--max-tokens 96]
        [--repeats 1] [--goal 1.6] [--weights q4] [--drafter-weights q8|dense] [--threads 1] [--model-dir DIR]
        [--drafter-dir DIR] [--eval-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics

import torch

from dspark.cpu_info import cpu_description, cpu_line


def hindsight_cost(accepted: list[int], round_ms: dict[int, float], step_ms: float) -> float:
    """The least milliseconds to move from anchor 0 to anchor len(accepted) (or past it) when
    each round may be a target-only step (step_ms, one token) or verify k drafts (round_ms[1 + k],
    1 + min(a, k) tokens), chosen knowing a = accepted[t] at each anchor t."""
    n = len(accepted)
    cost = [0.0] * (n + 1 + max(round_ms, default=1))  # cost[t] for t >= n: the span is done
    for t in range(n - 1, -1, -1):
        best = step_ms + cost[t + 1]
        for b, ms in round_ms.items():
            best = min(best, ms + cost[t + 1 + min(accepted[t], b - 1)])
        cost[t] = best
    return cost[0]


def first_draft_oracle_cost(accepted: list[int], k: int, round_ms: float, step_ms: float) -> float:
    """Milliseconds past the last anchor when a round verifies k drafts exactly where its first
    draft survives (a(t) >= 1), known beforehand, and is a target-only step elsewhere: what a
    perfect predictor of the first draft, and nothing more, would make of `fixed:k`."""
    t, ms = 0, 0.0
    while t < len(accepted):
        if accepted[t] >= 1:
            ms, t = ms + round_ms, t + 1 + min(accepted[t], k)
        else:
            ms, t = ms + step_ms, t + 1
    return ms


PAUSES = (0, 1, 2, 4, 8, 16, 32, 64)
"""The pauses `outcome_gated_cost` is priced at."""


def outcome_gated_cost(accepted: list[int], k: int, pause: int, round_ms: float, step_ms: float) -> float:
    """Milliseconds past the last anchor when every round verifies k drafts (round_ms), except
    that after a round whose first draft fails (a(t) = 0) the next `pause` rounds are target-only
    steps (step_ms): a gate deciding from past outcomes only (pause 0 is `fixed:k`)."""
    t, ms = 0, 0.0
    while t < len(accepted):
        a = accepted[t]
        ms, t = ms + round_ms, t + 1 + min(a, k)
        if a == 0:
            steps = min(pause, max(0, len(accepted) - t))
            ms, t = ms + steps * step_ms, t + steps
    return ms


def fixed_cost(accepted: list[int], k: int, round_ms: float) -> tuple[float, int]:
    """Milliseconds and rounds to move past the last anchor verifying k drafts every round."""
    t, rounds = 0, 0
    while t < len(accepted):
        t += 1 + min(accepted[t], k)
        rounds += 1
    return rounds * round_ms, rounds


def measure_rounds(engines: dict[str, object], prompts, max_tokens: int, stops, repeats: int) -> dict:
    """Per policy, every verified round's whole-step and drafting seconds by tokens verified."""
    from round_modes import run_prompts

    tallies = {policy: collections.defaultdict(collections.Counter) for policy in engines}
    for _ in range(repeats):  # policies in turns: the same contention for each
        for policy, engine in engines.items():
            run_prompts(engine, prompts, max_tokens, stops, tallies[policy])
    return tallies


def main() -> int:
    from round_modes import add_one_stream_arguments, one_stream
    from served_vs_teacher_forced import teacher_forced_accepted

    from dspark.sampling import SamplingParams
    from dspark.training.trainer import TargetTeacher

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--goal", type=float, default=1.6, help="speed-up over target-only to price")
    add_one_stream_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    setup = one_stream(args, table_sizes=(1, 2, 4))
    drafter, prompts, stops = setup.drafter, setup.prompts, setup.stops
    gamma = drafter.gamma
    engines = setup.engines(["none", *(f"fixed:{k}" for k in range(1, gamma + 1))])
    greedy = SamplingParams(temperature=0.0)
    outputs = [r.output_ids for r in engines["none"].generate(prompts, greedy, args.max_tokens, stops)]
    tallies = measure_rounds(engines, prompts, args.max_tokens, stops, args.repeats)

    def mean_ms(policy: str, tokens: int, key: str) -> float | None:
        rows = [row for (mode, b), row in tallies[policy].items() if b == tokens]
        n = sum(r["rounds"] for r in rows)
        return sum(r[key] for r in rows) / n * 1e3 if n else None

    step_ms = mean_ms("none", 1, "step_s")
    round_ms, draft_ms = {}, {}
    for k in range(1, gamma + 1):
        ms = mean_ms(f"fixed:{k}", k + 1, "step_s")
        if ms is not None:  # a run too short for a whole round of k drafts measures none
            round_ms[k + 1], draft_ms[k + 1] = ms, mean_ms(f"fixed:{k}", k + 1, "draft_s")

    teacher = TargetTeacher(TargetTeacher.load(str(setup.model_dir), torch.device("cpu"), torch.float32),
                            list(drafter.config.target_layer_ids))
    accepted: list[list[int]] = []  # per output: a(t) at every anchor with a whole block after it
    for prompt, output in zip(prompts, outputs):
        anchors = list(range(max(0, len(output) - gamma - 1)))
        accepted.append(teacher_forced_accepted(drafter, teacher, list(prompt), list(output), anchors, gamma)
                        if anchors else [])
    flat = [a for per in accepted for a in per]
    anchors_n = len(flat)

    print(f"\nCPU: {cpu_line()}; torch {torch.__version__}, {args.threads} threads; load average "
          f"{os.getloadavg()[0]:.1f}; {len(prompts)} {'held-out' if args.heldout else 'e2e'} prompts x {args.max_tokens} tokens, greedy, one stream, "
          f"{args.repeats} repeats; {anchors_n} anchors\n")
    print("| tokens verified | round ms | of which drafting | / target-only step |")
    print("|---:|---:|---:|---:|")
    print(f"| 1 (target only) | {step_ms:.2f} | - | 1.00 |" if step_ms else "| 1 | - | - | - |")
    for b, ms in sorted(round_ms.items()):
        print(f"| {b} | {ms:.2f} | {draft_ms[b]:.2f} | {ms / step_ms:.2f} |")
    survival = [round(sum(a >= k for a in flat) / anchors_n, 3) if anchors_n else None
                for k in range(1, gamma + 1)]
    print(f"\nteacher-forced a(t): mean {statistics.fmean(flat) if flat else float('nan'):.2f}; "
          f"P(a >= k), k = 1..{gamma}: {survival}\n")

    schedules = []
    if anchors_n and step_ms:
        base = anchors_n * step_ms
        for k in range(1, gamma + 1):
            if k + 1 in round_ms:
                ms = sum(fixed_cost(per, k, round_ms[k + 1])[0] for per in accepted)
                schedules.append((f"fixed:{k}", ms))
        oracle = {k: sum(first_draft_oracle_cost(per, k, round_ms[k + 1], step_ms) for per in accepted)
                  for k in range(1, gamma + 1) if k + 1 in round_ms}
        if oracle:
            k = min(oracle, key=oracle.get)
            schedules.append((f"first draft known, fixed:{k}", oracle[k]))
        gated = {(k, pause): sum(outcome_gated_cost(per, k, pause, round_ms[k + 1], step_ms) for per in accepted)
                 for k in range(1, gamma + 1) if k + 1 in round_ms for pause in PAUSES}
        if gated:
            k, pause = min(gated, key=gated.get)
            schedules.append((f"outcome-gated, fixed:{k}, pause {pause}", gated[k, pause]))
        schedules.append(("hindsight", sum(hindsight_cost(per, round_ms, step_ms) for per in accepted)))
        free = {b: ms - draft_ms[b] for b, ms in round_ms.items()}
        schedules.append(("hindsight, drafting free", sum(hindsight_cost(per, free, step_ms) for per in accepted)))
        print("| schedule | ms per token | speed-up over target-only |")
        print("|---|---:|---:|")
        print(f"| target only | {step_ms:.2f} | 1.00 |")
        for name, ms in schedules:
            print(f"| {name} | {ms / anchors_n:.2f} | {base / ms:.2f} |")
        print(f"\nfor {args.goal:g}x a round verifying k drafts would have to commit "
              f"{args.goal:g} x R(1 + k) / R(1) tokens (at most 1 + k):")
        print("| k | tokens needed | drafting free | most it can commit | fixed k commits (teacher-forced) |")
        print("|---:|---:|---:|---:|---:|")
        for b, ms in sorted(round_ms.items()):
            k = b - 1
            got = (anchors_n / sum(fixed_cost(per, k, 1.0)[1] for per in accepted))
            print(f"| {k} | {args.goal * ms / step_ms:.2f} | {args.goal * free[b] / step_ms:.2f} | {b} | {got:.2f} |")
    print(json.dumps({"bench": "speculation_ceiling", "threads": args.threads, **cpu_description(),
                      "weights": setup.runner.weights, "drafter_weights": args.drafter_weights or "dense",
                      "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0],
                      "prompts": f"heldout:{args.heldout}" if args.heldout else f"e2e:{args.limit}",
                      "anchors": anchors_n, "target_step_ms": step_ms,
                      "round_ms": {str(b): round(ms, 3) for b, ms in round_ms.items()},
                      "draft_ms": {str(b): round(ms, 3) for b, ms in draft_ms.items()},
                      "survival": survival,
                      "speedup": {name: round(anchors_n * step_ms / ms, 3) for name, ms in schedules}
                      if schedules else {}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
