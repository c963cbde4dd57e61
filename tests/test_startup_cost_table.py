"""The start-up cost table (dspark/step_timing.py): fastest forward per size, the plausibility
check, bounded re-measuring and what gets cached, on a fake runner whose forwards take scripted
times on a fake clock (no real timing, so nothing here depends on the machine's load)."""

from __future__ import annotations

import logging

import pytest

from dspark.cost_table import CostTable
from dspark.step_timing import (STARTUP_ATTEMPTS, cached_startup_cost_table, implausibility,
                                measure_step_seconds, startup_cost_table)

SIZES = (1, 2, 4, 8)
FORWARDS_PER_ATTEMPT = 6  # 1 warm-up + 5 timed, per size


def clean_seconds(b: int) -> float:
    """A forward's undisturbed cost: a fixed part plus a part per token."""
    return 0.010 + 0.001 * b


class ScriptedRunner:
    """Stands in for a TargetRunner: a forward over B tokens advances `now` by
    `script(B, k)` seconds, k counting the forwards of that B so far (warm-ups included)."""

    vocab_size = 97

    def __init__(self, script) -> None:
        self.script = script
        self.now = 0.0
        self.forwards_by_b: dict[int, int] = {}

    def clock(self) -> float:
        return self.now

    def add_request(self, rid) -> None:
        pass

    def truncate(self, rid, length: int) -> None:
        pass

    def free(self, rid) -> None:
        pass

    def forward(self, items) -> None:
        b = sum(len(it.token_ids) for it in items)
        if b not in SIZES:  # the prefill of the profiled context: not timed
            return
        k = self.forwards_by_b.get(b, 0)
        self.forwards_by_b[b] = k + 1
        self.now += self.script(b, k)

    def measure(self, **kwargs) -> CostTable:
        return startup_cost_table(self, sizes=SIZES, context_len=8, clock=self.clock, **kwargs)


def garbage(b: int, k: int) -> float:
    """Every forward disturbed the same way, in every attempt (the load-12 reading)."""
    return {1: 0.408, 2: 1.435, 4: 0.490, 8: 0.520}[b]


def disturbed_b2(b: int, k: int) -> float:
    """The first 3 timed forwards of B = 2 of each attempt hit a slow spell: its median is
    garbage, its fastest forward is not."""
    slow = b == 2 and 1 <= k % FORWARDS_PER_ATTEMPT <= 3
    return 1.4 if slow else clean_seconds(b)


def disturbed_first_attempt(b: int, k: int) -> float:
    """All of B = 2's forwards of the first attempt disturbed; the second attempt quiet."""
    return 1.4 if b == 2 and k < FORWARDS_PER_ATTEMPT else clean_seconds(b)


def test_implausibility():
    assert "T(2)" in implausibility([1, 2, 4], [0.408, 1.435, 0.490])
    assert "below T(2)" in implausibility([1, 2, 4], [0.408, 0.6, 0.4])
    assert implausibility(SIZES, [clean_seconds(b) for b in SIZES]) is None
    # A flat staircase with noise (a GPU) is plausible; so is a single point.
    assert implausibility([1, 2, 4, 8], [0.0100, 0.0093, 0.0101, 0.0098]) is None
    assert implausibility([4], [0.5]) is None
    # Growing faster than B * T(1) is not.
    assert "exceeds" in implausibility([1, 2, 4], [0.01, 0.02, 0.2])


def test_fastest_forward_fixes_a_disturbed_size():
    runner = ScriptedRunner(disturbed_b2)
    medians = measure_step_seconds(runner, list(SIZES), context_len=8, requests=4, repeats=5,
                                   warmup=1, clock=runner.clock)
    assert implausibility(SIZES, medians) is not None
    table = ScriptedRunner(disturbed_b2).measure()
    assert table.step_seconds == pytest.approx([clean_seconds(b) for b in SIZES])
    assert table.meta["forwards_per_size"] == 5


def test_clean_measurement_is_cached(tmp_path, caplog):
    path = tmp_path / "home" / "table.json"
    runner = ScriptedRunner(lambda b, k: clean_seconds(b))
    with caplog.at_level(logging.WARNING, logger="dspark.step_timing"):
        table = cached_startup_cost_table(runner, path, sizes=SIZES, context_len=8,
                                          clock=runner.clock)
    assert not caplog.records
    assert runner.forwards_by_b == {b: FORWARDS_PER_ATTEMPT for b in SIZES}
    assert CostTable.load(path).step_seconds == pytest.approx(table.step_seconds)
    # Read back from the cache without measuring.
    again = ScriptedRunner(garbage)
    assert cached_startup_cost_table(again, path).step_seconds == table.step_seconds
    assert again.forwards_by_b == {}


def test_garbage_measurement_is_used_but_not_cached(tmp_path, caplog):
    path = tmp_path / "table.json"
    runner = ScriptedRunner(garbage)
    with caplog.at_level(logging.WARNING, logger="dspark.step_timing"):
        table = cached_startup_cost_table(runner, path, sizes=SIZES, context_len=8,
                                          clock=runner.clock)
    assert not path.exists()
    assert runner.forwards_by_b == {b: STARTUP_ATTEMPTS * FORWARDS_PER_ATTEMPT for b in SIZES}
    assert table.step_seconds == pytest.approx([garbage(b, 0) for b in SIZES])
    assert "not caching" in caplog.records[-1].getMessage()
    assert len(caplog.records) == STARTUP_ATTEMPTS + 1


def test_implausible_measurement_is_measured_again(tmp_path):
    path = tmp_path / "table.json"
    runner = ScriptedRunner(disturbed_first_attempt)
    table = cached_startup_cost_table(runner, path, sizes=SIZES, context_len=8,
                                      clock=runner.clock)
    assert runner.forwards_by_b == {b: 2 * FORWARDS_PER_ATTEMPT for b in SIZES}
    assert table.meta["forwards_per_size"] == 10
    assert CostTable.load(path).step_seconds == pytest.approx([clean_seconds(b) for b in SIZES])


def test_implausible_cached_table_is_measured_again(tmp_path, caplog):
    path = tmp_path / "table.json"
    CostTable.from_step_seconds({1: 0.408, 2: 1.435, 4: 0.490}).save(path)
    runner = ScriptedRunner(lambda b, k: clean_seconds(b))
    with caplog.at_level(logging.WARNING, logger="dspark.step_timing"):
        table = cached_startup_cost_table(runner, path, sizes=SIZES, context_len=8,
                                          clock=runner.clock)
    assert "ignoring the cost table" in caplog.records[0].getMessage()
    assert table.batch_tokens == list(SIZES)
    assert CostTable.load(path).step_seconds == pytest.approx([clean_seconds(b) for b in SIZES])
    assert runner.forwards_by_b == {b: FORWARDS_PER_ATTEMPT for b in SIZES}


def test_scheduler_ignores_an_implausible_stored_table():
    from services.scheduler.main import plausible_stored_table

    logger = logging.getLogger("test.scheduler")
    clean = CostTable.from_step_seconds({b: clean_seconds(b) for b in SIZES})
    assert plausible_stored_table(clean.to_dict(), "m", logger).step_seconds == clean.step_seconds
    bad = CostTable.from_step_seconds({1: 0.408, 2: 1.435, 4: 0.490})
    assert plausible_stored_table(bad.to_dict(), "m", logger) is None
    assert plausible_stored_table(None, "m", logger) is None
