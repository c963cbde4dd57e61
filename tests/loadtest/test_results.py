"""Per-user speed at matched aggregate throughput (loadtest/results.py), on a float32
sweep's measured numbers (1, 4 and 16 users), worked out by hand."""

from __future__ import annotations

import pytest

from loadtest.results import LevelResult, matched_speeds, per_user_at


def level(policy: str, users: int, per_user: float, aggregate: float) -> LevelResult:
    return LevelResult(policy, users, 40.0, 10, 0, per_user, per_user, 100.0, 100.0, aggregate,
                       0.0, 1.0, 0.0)


ASYNC = [level("async_topk", 1, 49.585, 42.8024), level("async_topk", 16, 11.2484, 159.2622),
         level("async_topk", 4, 27.8186, 99.0367)]  # (order of users does not matter)
FIXED1 = [level("fixed:1", 1, 43.8688, 39.2144), level("fixed:1", 4, 26.6799, 93.1819),
          level("fixed:1", 16, 9.6844, 136.6568)]


def test_per_user_speed_along_a_frontier():
    # 93.1819 lies between async's 1-user and 4-user levels: a fraction t of the way
    t = (93.1819 - 42.8024) / (99.0367 - 42.8024)
    assert per_user_at(ASYNC, 93.1819) == pytest.approx(49.585 + t * (27.8186 - 49.585))
    assert per_user_at(ASYNC, 93.1819) == pytest.approx(30.085, abs=1e-3)
    assert per_user_at(ASYNC, 99.0367) == pytest.approx(27.8186)
    assert per_user_at(ASYNC, 39.2144) is None  # below its 1-user level: not extrapolated
    assert per_user_at(ASYNC, 200.0) is None
    assert per_user_at(ASYNC[:1], 42.8024) == 49.585  # one level: only its own throughput


def test_matched_speeds_for_every_ordered_pair():
    rows = {(m.policy, m.baseline, m.baseline_users): m for m in matched_speeds(FIXED1 + ASYNC)}
    assert len(rows) == 6
    assert rows[("async_topk", "fixed:1", 1)].ratio is None
    assert rows[("async_topk", "fixed:1", 4)].ratio == pytest.approx(30.085 / 26.6799, abs=1e-4)
    t = (136.6568 - 99.0367) / (159.2622 - 99.0367)
    at_16 = 27.8186 + t * (11.2484 - 27.8186)
    assert rows[("async_topk", "fixed:1", 16)].ratio == pytest.approx(at_16 / 9.6844)
    assert rows[("async_topk", "fixed:1", 16)].ratio == pytest.approx(1.804, abs=1e-3)
    back = rows[("fixed:1", "async_topk", 16)]  # fixed:1 never reaches 159 tok/s
    assert back.policy_per_user is None and back.row()["ratio"] == ""
    t = (99.0367 - 93.1819) / (136.6568 - 93.1819)
    assert rows[("fixed:1", "async_topk", 4)].policy_per_user == pytest.approx(
        26.6799 + t * (9.6844 - 26.6799))
    assert rows[("fixed:1", "async_topk", 1)].ratio == pytest.approx(
        (43.8688 + (42.8024 - 39.2144) / (93.1819 - 39.2144) * (26.6799 - 43.8688)) / 49.585)
