"""Tests of dspark/cost_table.py: lookup, extrapolation, JSON round trip, online update."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark.cost_table import CostTable, CostTableConfig, Interpolation, ThetaObjective

# A staircase like a bucketed engine's: flat inside buckets, a jump after 4 and after 8.
STAIR = {1: 0.010, 2: 0.010, 4: 0.011, 5: 0.020, 8: 0.021, 9: 0.035, 16: 0.036}


def linear_reference(xs: list[int], ys: list[float], b: int) -> float:
    """Independent linear interpolation, written out by hand."""
    if b <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= b <= x1:
            return y0 + (y1 - y0) * (b - x0) / (x1 - x0)
    raise AssertionError("past the table")


def test_measured_points_are_kept_exactly():
    table = CostTable.from_step_seconds(STAIR)
    for b, s in STAIR.items():
        assert table.step_time(b) == s
        assert table.sps(b) == pytest.approx(1.0 / s, rel=1e-15)


def test_linear_interpolation_between_points():
    table = CostTable.from_step_seconds(STAIR)
    xs, ys = sorted(STAIR), [STAIR[b] for b in sorted(STAIR)]
    for b in range(1, 17):
        assert table.step_time(b) == pytest.approx(linear_reference(xs, ys, b), rel=1e-12)
    # e.g. halfway between 9 (0.035) and 16 (0.036)
    assert table.step_time(12) == pytest.approx(0.035 + 0.001 * 3 / 7, rel=1e-12)


def test_next_interpolation_charges_the_next_bucket():
    table = CostTable.from_step_seconds(STAIR, config=CostTableConfig(interpolation=Interpolation.NEXT))
    assert table.step_time(3) == STAIR[4]
    assert table.step_time(6) == STAIR[8]
    assert table.step_time(7) == STAIR[8]
    assert table.step_time(10) == STAIR[16]
    assert table.step_time(16) == STAIR[16]


def test_below_the_first_point_clamps():
    table = CostTable.from_step_seconds({4: 0.02, 8: 0.03})
    assert table.step_time(1) == 0.02
    assert table.step_time(3) == 0.02


@pytest.mark.parametrize(
    "points, slope",
    [
        (STAIR, (0.036 - 0.010) / 15),  # whole-range marginal cost; the last bucket is nearly flat
        ({1: 0.05, 2: 0.04, 4: 0.03}, 0.03 / 4),  # decreasing table: fall back to T_last / B_last
        ({1: 0.05, 8: 0.05}, 0.05 / 8),  # flat table: same fall back
        ({3: 0.06}, 0.06 / 3),  # a single point: a line through the origin
    ],
)
def test_extrapolation_grows_linearly_with_positive_slope(points, slope):
    for interpolation in Interpolation:
        table = CostTable.from_step_seconds(points, config=CostTableConfig(interpolation=interpolation))
        last_b = max(points)
        assert table.extrapolation_slope == pytest.approx(slope, rel=1e-12)
        bs = np.arange(last_b, last_b + 200)
        steps = table.step_time(bs)
        assert steps == pytest.approx(points[last_b] + slope * (bs - last_b), rel=1e-12)
        sps = table.sps(bs)
        assert (np.diff(sps) < 0).all(), "SPS must keep falling past the last measured point"


def test_array_lookup_equals_scalar_lookup():
    table = CostTable.from_step_seconds(STAIR)
    bs = np.array([1, 3, 7, 16, 40, 1000])
    assert table.step_time(bs).tolist() == [table.step_time(int(b)) for b in bs]
    # round_rate_range is the same numbers as a contiguous slice
    for objective in ThetaObjective:
        table.draft_seconds = 0.004
        expected = table.round_rate(np.arange(5, 5 + 300), objective)
        assert np.array_equal(table.round_rate_range(5, 300, objective), expected)


def test_invalid_tables_and_lookups_raise():
    with pytest.raises(ValueError):
        CostTable([2, 1], [0.1, 0.1])
    with pytest.raises(ValueError):
        CostTable([0, 1], [0.1, 0.1])
    with pytest.raises(ValueError):
        CostTable([1, 2], [0.1, 0.0])
    with pytest.raises(ValueError):
        CostTable([1, 2], [0.1])
    with pytest.raises(ValueError):
        CostTable([], [])
    table = CostTable.from_step_seconds(STAIR)
    with pytest.raises(ValueError):
        table.step_time(0)
    with pytest.raises(ValueError):
        table.step_time(np.array([1.5]))


def test_theta_objectives():
    table = CostTable.from_step_seconds({1: 0.02, 4: 0.03}, draft_seconds=0.01)
    assert table.round_rate(4, ThetaObjective.PAPER) == pytest.approx(1 / 0.03, rel=1e-15)
    assert table.round_rate(4, ThetaObjective.DISAGGREGATED) == pytest.approx(1 / 0.04, rel=1e-15)
    # assigning draft_seconds directly must not leave a stale cache
    table.round_rate_range(1, 8, ThetaObjective.DISAGGREGATED)
    table.draft_seconds = 0.02
    assert table.round_rate_range(4, 1, ThetaObjective.DISAGGREGATED)[0] == pytest.approx(1 / 0.05)


def test_json_round_trip(tmp_path):
    table = CostTable.from_step_seconds(STAIR, meta={"model": "tiny", "dtype": "bf16"}, draft_seconds=0.003)
    path = tmp_path / "cost.json"
    table.save(path)
    data = json.loads(path.read_text())
    assert set(data) >= {"batch_tokens", "step_seconds", "meta"}
    loaded = CostTable.load(path)
    assert loaded.to_dict() == table.to_dict()
    bs = np.arange(1, 100)
    assert np.array_equal(loaded.step_time(bs), table.step_time(bs))
    assert CostTable.from_dict(table.to_dict()).to_dict() == table.to_dict()


def test_profile_format_without_optional_fields(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"batch_tokens": [1, 2, 4], "step_seconds": [0.04, 0.05, 0.06], "meta": {}}))
    table = CostTable.load(path, CostTableConfig(ema_weight=0.5))
    assert table.draft_seconds == 0.0
    assert table.config.ema_weight == 0.5
    assert table.step_time(3) == pytest.approx(0.055)


def test_observe_moves_a_measured_point_by_the_ema_weight():
    table = CostTable.from_step_seconds({1: 0.04, 4: 0.06, 8: 0.10}, config=CostTableConfig(ema_weight=0.25))
    before_neighbour = table.step_time(8)
    table.observe(4, 0.10)
    assert table.step_time(4) == pytest.approx(0.75 * 0.06 + 0.25 * 0.10, rel=1e-15)
    assert table.step_time(8) == before_neighbour
    assert table.batch_tokens == [1, 4, 8]
    # the cached lookup between points follows the update
    assert table.step_time(6) == pytest.approx((table.step_time(4) + 0.10) / 2, rel=1e-12)


def test_observe_inserts_a_new_point_at_the_current_estimate_moved_toward_the_measurement():
    table = CostTable.from_step_seconds({1: 0.04, 8: 0.10}, config=CostTableConfig(ema_weight=0.5))
    estimate = table.step_time(5)
    table.observe(5, 0.2)
    assert table.batch_tokens == [1, 5, 8]
    assert table.step_time(5) == pytest.approx(0.5 * estimate + 0.5 * 0.2, rel=1e-15)
    table.observe(20, 0.3)  # past the end: inserted after the last point
    assert table.batch_tokens == [1, 5, 8, 20]


def test_stale_profile_corrects_itself():
    # The profile says 10 ms everywhere, the engine really takes 30 ms at B = 16 and 12 ms at B = 2.
    table = CostTable.from_step_seconds({1: 0.01, 2: 0.01, 16: 0.01}, config=CostTableConfig(ema_weight=0.2))
    errors = []
    for _ in range(40):
        table.observe(16, 0.03)
        table.observe(2, 0.012)
        errors.append(abs(table.step_time(16) - 0.03))
    assert errors[-1] == pytest.approx(0.02 * 0.8**40, rel=1e-9)
    assert all(e1 < e0 for e0, e1 in zip(errors, errors[1:]))
    assert table.step_time(2) == pytest.approx(0.012, abs=1e-6)
    frozen = CostTable.from_step_seconds({1: 0.01}, config=CostTableConfig(ema_weight=0.0))
    frozen.observe(1, 1.0)
    assert frozen.step_time(1) == 0.01


def test_observe_draft():
    table = CostTable.from_step_seconds({1: 0.01}, config=CostTableConfig(draft_ema_weight=0.5))
    table.observe_draft(0.004)
    assert table.draft_seconds == 0.004  # the first measurement replaces "never measured"
    table.observe_draft(0.008)
    assert table.draft_seconds == pytest.approx(0.006)
    with pytest.raises(ValueError):
        table.observe(3, -1.0)


@pytest.mark.parametrize("interpolation", list(Interpolation))
def test_cached_lookup_stays_exact_under_many_updates(interpolation):
    rng = np.random.default_rng(0)
    config = CostTableConfig(interpolation=interpolation, ema_weight=0.3)
    table = CostTable.from_step_seconds(STAIR, config=config, draft_seconds=0.002)
    bs = np.arange(1, 120)
    for _ in range(60):
        table.step_time(bs)  # fill the caches, then update
        table.round_rate_range(1, 119, ThetaObjective.PAPER)
        table.round_rate_range(1, 119, ThetaObjective.DISAGGREGATED)
        table.observe(int(rng.integers(1, 60)), float(rng.uniform(0.005, 0.05)))
        fresh = CostTable(list(table.batch_tokens), list(table.step_seconds), config=config, draft_seconds=0.002)
        assert np.array_equal(table.step_time(bs), fresh.step_time(bs))
        for objective in ThetaObjective:
            assert np.array_equal(table.round_rate_range(1, 119, objective), fresh.round_rate_range(1, 119, objective))
