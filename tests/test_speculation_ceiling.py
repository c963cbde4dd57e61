"""bench/speculation_ceiling.py's schedules against brute force over every schedule."""

from __future__ import annotations

import importlib.util
import random
import sys

import pytest

from dspark.paths import REPO_ROOT

BENCH = REPO_ROOT / "bench"


@pytest.fixture(scope="module")
def ceiling():
    sys.path.insert(0, str(BENCH))  # as when run as a script: siblings import each other
    try:
        spec = importlib.util.spec_from_file_location("speculation_ceiling", BENCH / "speculation_ceiling.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def every_schedule_cost(accepted: list[int], round_ms: dict[int, float], step_ms: float, t: int = 0) -> list[float]:
    """The cost of every schedule from anchor t past the last anchor (each round a target step or
    one of round_ms's sizes), enumerated."""
    if t >= len(accepted):
        return [0.0]
    costs = [step_ms + c for c in every_schedule_cost(accepted, round_ms, step_ms, t + 1)]
    for b, ms in round_ms.items():
        costs += [ms + c for c in every_schedule_cost(accepted, round_ms, step_ms, t + 1 + min(accepted[t], b - 1))]
    return costs


@pytest.mark.parametrize("seed", range(8))
def test_hindsight_cost_is_the_cheapest_schedule(ceiling, seed):
    rng = random.Random(seed)
    gamma = rng.randint(1, 4)
    accepted = [rng.randint(0, gamma) for _ in range(rng.randint(1, 9))]
    step_ms = rng.uniform(5, 15)
    round_ms = {b: rng.uniform(step_ms, 4 * step_ms) for b in range(2, gamma + 2) if rng.random() < 0.8}
    best = min(every_schedule_cost(accepted, round_ms, step_ms))
    assert ceiling.hindsight_cost(accepted, round_ms, step_ms) == pytest.approx(best, rel=1e-12)


def test_hindsight_never_costs_more_than_target_only_or_fixed(ceiling):
    accepted = [0, 3, 1, 0, 0, 2, 7, 7, 0, 1]
    round_ms = {b: 12.0 + 2.5 * (b - 1) + 6.0 for b in range(2, 9)}
    best = ceiling.hindsight_cost(accepted, round_ms, 12.0)
    assert best <= 12.0 * len(accepted)
    for k in range(1, 8):
        assert best <= ceiling.fixed_cost(accepted, k, round_ms[k + 1])[0]


def test_fixed_cost_counts_rounds(ceiling):
    # anchors 0 (a=2, k=2: 3 tokens) -> 3 (a=0: 1 token) -> 4 (a=5, capped at 2: 3 tokens) -> 7: done
    assert ceiling.fixed_cost([2, 0, 0, 0, 5, 1, 1], 2, 10.0) == (30.0, 3)
    # a drafter that is never right: every round commits the bonus token alone
    assert ceiling.fixed_cost([0] * 5, 3, 4.0) == (20.0, 5)


def test_outcome_gated_cost_pauses_after_a_failed_first_draft(ceiling):
    # k=2, pause 2: anchor 0 (a=0: 1 token, then 2 steps over anchors 1, 2) -> 3 (a=2: 3 tokens)
    # -> 6 (a=0: 1 token; the pause runs out at the last anchor) -> done
    accepted = [0, 5, 5, 2, 1, 1, 0]
    assert ceiling.outcome_gated_cost(accepted, 2, 2, 10.0, 4.0) == pytest.approx(3 * 10.0 + 2 * 4.0)
    # pause 0 is fixed:k
    for k in (1, 2, 3):
        assert ceiling.outcome_gated_cost(accepted, k, 0, 10.0, 4.0) == ceiling.fixed_cost(accepted, k, 10.0)[0]


@pytest.mark.parametrize("seed", range(4))
def test_outcome_gated_never_beats_hindsight(ceiling, seed):
    rng = random.Random(seed)
    accepted = [rng.choice([0, 0, 1, 3, 7]) for _ in range(40)]
    step_ms = 10.0
    round_ms = {b: step_ms * (1.2 + 0.25 * b) for b in range(2, 9)}
    best = ceiling.hindsight_cost(accepted, round_ms, step_ms)
    for k in range(1, 8):
        for pause in ceiling.PAUSES:
            assert ceiling.outcome_gated_cost(accepted, k, pause, round_ms[k + 1], step_ms) >= best - 1e-9
