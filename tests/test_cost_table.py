"""Tests of dspark/cost_table.py: lookup, extrapolation, JSON round trip, online update."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark.cost_table import (
    MIN_STEP_FRACTION,
    SLOPE_RIDGE,
    CostTable,
    CostTableConfig,
    Interpolation,
    ThetaObjective,
)

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


def test_round_step_range_is_the_learned_step_time_of_each_round():
    table = CostTable.from_step_seconds(STAIR)
    for requests, tokens, seconds in [(3, 3, 0.03), (3, 6, 0.05), (3, 5, 0.045), (1, 1, 0.011)]:
        table.observe(requests, tokens, seconds)
    for requests in (1, 2, 3, 8):  # served, unserved (the nearest fit), and with no drafts seen
        steps = table.round_step_range(requests, 12)
        assert steps.tolist() == [table.step_time(requests + n, requests) for n in range(12)]
        for objective in ThetaObjective:
            assert np.array_equal(table.round_rate_range(requests, 12, objective),
                                  table.rate(steps, objective, requests))


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


def test_observe_learns_the_level_of_a_request_count_and_keeps_the_profile():
    table = CostTable.from_step_seconds({1: 0.04, 4: 0.06, 8: 0.10}, config=CostTableConfig(ema_weight=0.25))
    assert table.offset(4) == 0.0  # nothing measured yet: the profile as it is
    table.observe(4, 4, 0.10)  # 4 requests, one token each, 40 ms slower than the profile
    assert table.offset(4) == pytest.approx(0.04, rel=1e-15)  # the first measurement is taken whole
    assert table.step_time(8, num_requests=4) == pytest.approx(0.14, rel=1e-15)
    assert table.step_time(6, num_requests=4) == pytest.approx(0.08 + 0.04, rel=1e-12)
    # the profiled points never move: the shape in B stays as measured
    assert table.batch_tokens == [1, 4, 8] and table.step_seconds == [0.04, 0.06, 0.10]
    assert table.step_time(8) == 0.10
    table.observe(4, 8, 0.10)  # a round that verified 4 drafts, as fast as the profile says
    # R = 4's rounds: 40 ms above the profile without drafts, 0 with 4 drafts, and a straight
    # line between the two: 10 ms less per draft
    assert table.offset(4) == pytest.approx(0.04, rel=1e-12)
    assert table.step_time(4, num_requests=4) == pytest.approx(0.10, rel=1e-12)
    assert table.step_time(6, num_requests=4) == pytest.approx(0.08 + 0.02, rel=1e-12)
    assert table.step_time(8, num_requests=4) == pytest.approx(0.10, rel=1e-12)
    # past the served drafts (4) the line is held flat: 12 drafts cost the profile plus n = 4's
    assert table.step_time(16, num_requests=4) == pytest.approx(
        float(table.step_time(16)) + float(table.step_time(8, num_requests=4)) - 0.10, rel=1e-12)


def test_the_line_of_one_request_corrects_the_profiles_shape():
    """The profile spreads B = 4 over 4 requests; one request with 3 drafts costs less (fp32:
    profile 89 / 138 ms at B = 1 / 4, one request at context 300 107 / 141 ms). The served rounds
    converge to what they cost, so a single stream is not charged for requests it does not have."""
    table = CostTable.from_step_seconds({1: 0.089, 4: 0.1375, 8: 0.1432})
    for _ in range(100):
        table.observe(1, 1, 0.107)
        table.observe(1, 4, 0.141)
    assert table.step_time(1, num_requests=1) == pytest.approx(0.107, rel=1e-3)
    assert table.step_time(4, num_requests=1) == pytest.approx(0.141, rel=1e-3)
    assert table.offset(1) == pytest.approx(0.107 - 0.089, rel=1e-2)  # the line at n = 0
    # 7 drafts lie past the 3 served: the line is held at n = 3, 3.5 ms above the profile
    assert table.step_time(8, num_requests=1) == pytest.approx(0.1432 + 0.141 - 0.1375, rel=1e-3)


def test_drafts_of_many_sizes_teach_one_line():
    """At 16 requests (bf16), rounds that verify drafts seldom verify the same number
    twice (B = 40-52 in one minute). Every one of them informs R's line, so a draft count never
    served on its own (here 30) is priced at what drafts were measured to cost, not at the
    level of the rounds without drafts that make up most of R's rounds."""
    table = CostTable.from_step_seconds({16: 0.100, 48: 0.110})

    def truth(n: int) -> float:  # 15 ms above the profile, 1.2 ms more a draft
        return float(table.step_time(16 + n)) + 0.015 + 0.0012 * n

    drafted = [24, 27, 33, 36, 25, 29, 31, 35, 26, 34]
    for i in range(200):
        n = drafted[i // 4 % len(drafted)] if i % 4 == 3 else 0  # one round in 4 drafts
        table.observe(16, 16 + n, truth(n))
    assert table.step_time(16, num_requests=16) == pytest.approx(truth(0), rel=1e-3)
    assert table.step_time(46, num_requests=16) == pytest.approx(truth(30), rel=1e-3)


def test_an_unmeasured_request_count_takes_the_nearest_measured_level():
    table = CostTable.from_step_seconds({1: 0.01, 64: 0.05})
    table.observe(2, 2, 0.03)
    table.observe(8, 8, 0.02)
    off2, off8 = table.offset(2), table.offset(8)
    assert off2 == pytest.approx(0.03 - float(table.step_time(2)), rel=1e-12)
    assert off8 == pytest.approx(0.02 - float(table.step_time(8)), rel=1e-12)
    assert [table.offset(r) for r in (1, 3, 5, 6, 7, 100)] == [off2, off2, off2, off8, off8, off8]


def test_serving_many_requests_keeps_the_marginal_cost_of_drafts():
    """Measured once: the start-up profile (up to 4 requests, context 64) said 176 / 245 ms
    at B = 16 / 32, while 16 requests at context 300 cost 336 / 408 ms (fp32, one thread). Rounds
    of 16 requests mostly verify no drafts (B = 16); the cost of verifying must not look lower
    than decoding because only B = 16 was measured."""
    profile = {1: 0.0889, 2: 0.0934, 4: 0.1375, 8: 0.1432, 16: 0.1757, 32: 0.2452}
    table = CostTable.from_step_seconds(profile)
    for _ in range(50):
        table.observe(16, 16, 0.336)
    steps = table.step_time(np.arange(16, 33), num_requests=16)  # [17]
    assert (np.diff(steps) > 0).all()
    assert steps[0] == pytest.approx(0.336, rel=1e-12)
    assert steps[-1] / steps[0] == pytest.approx(0.408 / 0.336, rel=0.05)
    # the profile's own points and other request counts' lookups are untouched by what R = 16 saw
    assert table.step_time(16) == profile[16]
    assert table.offset(16) == pytest.approx(0.336 - 0.1757, rel=1e-12)


def test_a_noisy_first_measurement_fades_by_the_ema_weight():
    table = CostTable.from_step_seconds({1: 0.01, 2: 0.01, 16: 0.01}, config=CostTableConfig(ema_weight=0.2))
    table.observe(16, 16, 0.06)  # one slow spell first
    errors = []
    for _ in range(40):
        table.observe(16, 16, 0.03)
        errors.append(abs(float(table.step_time(16, num_requests=16)) - 0.03))
    assert errors[-1] == pytest.approx(0.03 * 0.8**40, rel=1e-9)
    assert all(e1 < e0 for e0, e1 in zip(errors, errors[1:]))
    frozen = CostTable.from_step_seconds({1: 0.01}, config=CostTableConfig(ema_weight=0.0))
    frozen.observe(1, 1, 1.0)
    assert frozen.step_time(1, num_requests=1) == 0.01


def test_a_level_never_makes_a_step_free():
    table = CostTable.from_step_seconds({1: 0.05, 2: 0.01, 4: 0.06})  # a profile with a dip
    table.observe(1, 1, 0.005)  # serving far faster than the profile at B = 1: offset -0.045
    assert table.step_time(2, num_requests=1) == pytest.approx(MIN_STEP_FRACTION * 0.01, rel=1e-15)
    assert (table.round_rate_range(1, 4) > 0).all()


def test_observe_draft():
    table = CostTable.from_step_seconds({1: 0.01}, config=CostTableConfig(draft_ema_weight=0.5))
    table.observe_draft(0.004)
    assert table.draft_seconds == 0.004  # the first measurement replaces "never measured"
    table.observe_draft(0.008)
    assert table.draft_seconds == pytest.approx(0.006)
    # by request count: drafting 16 requests is measured apart from drafting one
    table.observe_draft(0.05, 16)
    table.observe_draft(0.07, 16)
    assert table.draft_time(16) == pytest.approx(0.06)
    assert table.draft_time(12) == pytest.approx(0.06)  # the nearest measured count
    assert table.draft_time() == pytest.approx(0.006)
    # B = 16 on a one-point profile: 0.01 s per token (T_last / B_last)
    assert table.round_rate_range(16, 1, ThetaObjective.DISAGGREGATED)[0] == pytest.approx(
        1 / (0.06 + 0.16), rel=1e-12)
    with pytest.raises(ValueError):
        table.observe(1, 3, -1.0)
    with pytest.raises(ValueError):
        table.observe(0, 3, 0.1)
    with pytest.raises(ValueError):
        table.observe(2, 1.5, 0.1)


def reference_line(rounds: list[tuple[int, float]], ema_weight: float, n: np.ndarray) -> np.ndarray:
    """Brute force of one weighted least-squares line: every round (the last with weight w, each
    earlier faded by 1 - w, the first with the weight left over), the slope ridge-penalised by
    SLOPE_RIDGE, evaluated at n clipped to the served range."""
    ns = np.array([x for x, _ in rounds], dtype=np.float64)  # [m]
    ys = np.array([y for _, y in rounds])  # [m]
    m = len(rounds)
    weights = ema_weight * (1.0 - ema_weight) ** np.arange(m - 1, -1, -1.0)  # [m]
    weights[0] = (1.0 - ema_weight) ** (m - 1)
    s0, s1, s2 = weights.sum(), (weights * ns).sum(), (weights * ns * ns).sum()
    normal = np.array([[s0, s1], [s1, s2 + SLOPE_RIDGE * s0]])
    level, slope = np.linalg.solve(normal, [(weights * ys).sum(), (weights * ns * ys).sum()])
    return level + slope * np.clip(n, ns.min(), ns.max())


def reference_above(rounds: list[tuple[int, float]], ema_weight: float, n: np.ndarray) -> np.ndarray:
    """Brute force of CostTable's seconds above the profile for one request count: the rounds
    without drafts and those with drafts as two separate lines (each faded only by its own
    rounds), joined by a straight segment from n = 0 to the fewest drafts served."""
    decode = [(x, y) for x, y in rounds if x == 0]
    drafts = [(x, y) for x, y in rounds if x > 0]
    n = n.astype(np.float64)
    if not drafts:
        return reference_line(decode, ema_weight, n)
    line = reference_line(drafts, ema_weight, n)
    if not decode:
        return line
    fewest = min(x for x, _ in drafts)
    zero = reference_line(decode, ema_weight, np.zeros(1))[0]
    first = reference_line(drafts, ema_weight, np.array([fewest]))[0]
    return np.where(n < fewest, zero + (first - zero) * n / fewest, line)


def reference_step_above(history: dict[int, list[tuple[int, float]]], r: int, ema_weight: float,
                         n: np.ndarray) -> np.ndarray:
    """Brute force of the seconds above the profile at R = r: R's own rounds (else the nearest
    served R's, the lower on a tie); without draft rounds, plus the nearest R with draft rounds'
    cost above its own n = 0."""
    def nearest(counts):
        return min(counts, key=lambda c: (abs(c - r), c)) if counts else None

    own = nearest(list(history))
    above = reference_above(history[own], ema_weight, n)
    if all(x == 0 for x, _ in history[own]):
        donor = nearest([c for c, rounds in history.items() if any(x > 0 for x, _ in rounds)])
        if donor is not None:
            above = above + reference_above(history[donor], ema_weight, n) - reference_above(
                history[donor], ema_weight, np.zeros_like(n))
    return above


def test_a_request_count_without_draft_rounds_prices_drafts_at_the_nearest_that_has_them():
    """At 16 users a request finishes and the next one's prompt is read over a few rounds at
    R = 15: nearly all of R = 15's rounds are decode rounds. Its drafts are priced by what drafts
    cost above decoding at R = 16, on top of R = 15's own decode level, not by the profile."""
    table = CostTable.from_step_seconds({8: 0.030, 64: 0.040})
    for _ in range(20):
        table.observe(16, 16, float(table.step_time(16)) + 0.020)
        table.observe(16, 16 + 20, float(table.step_time(36)) + 0.020 + 0.060)
        table.observe(16, 16 + 40, float(table.step_time(56)) + 0.020 + 0.100)
    table.observe(15, 15, float(table.step_time(15)) + 0.015)
    assert table.step_time(15, num_requests=15) == pytest.approx(
        float(table.step_time(15)) + 0.015, rel=1e-12)
    # 30 drafts at R = 15: the profile at B = 45, R = 15's level, R = 16's 80 ms for 30 drafts
    assert table.step_time(45, num_requests=15) == pytest.approx(
        float(table.step_time(45)) + 0.015 + 0.080, rel=1e-3)
    table.observe(15, 15 + 10, float(table.step_time(25)) + 0.030)  # R = 15's own draft round
    assert table.step_time(25, num_requests=15) == pytest.approx(
        float(table.step_time(25)) + 0.030, rel=1e-12)


def test_decode_rounds_do_not_fade_what_drafts_cost():
    """At 16 users (bf16) verifying rounds came tens of decode rounds apart. The price of a
    draft count must rest on the verifying rounds, however many decode rounds lie between them:
    here a jump of 5 ms and 1.2 ms a draft, learned to 0.1% at every verifying round."""
    table = CostTable.from_step_seconds({16: 0.030, 64: 0.060})

    def truth(n: int) -> float:
        above = 0.010 if n == 0 else 0.015 + 0.0012 * n
        return float(table.step_time(16 + n)) + above

    table.observe(16, 16, truth(0))
    for n in [24, 36, 28, 33, 25, 31, 27, 35]:
        for _ in range(35):
            table.observe(16, 16, truth(0))
        table.observe(16, 16 + n, truth(n))
        if n != 24:  # two draft counts served: the line is known
            for k in (25, 30, 35):
                assert table.step_time(16 + k, num_requests=16) == pytest.approx(truth(k), rel=1e-3)
        assert table.step_time(16, num_requests=16) == pytest.approx(truth(0), rel=1e-12)


@pytest.mark.parametrize("interpolation", list(Interpolation))
def test_rate_lookups_follow_every_update(interpolation):
    rng = np.random.default_rng(0)
    config = CostTableConfig(interpolation=interpolation, ema_weight=0.3)
    table = CostTable.from_step_seconds(STAIR, config=config, draft_seconds=0.002)
    profile = CostTable.from_step_seconds(STAIR, config=config)
    history: dict[int, list[tuple[int, float]]] = {}
    borrowed = 0
    for _ in range(60):
        r = int(rng.integers(1, 20))
        table.round_rate_range(r, 50, ThetaObjective.PAPER)
        # half the rounds verify nothing, so some request counts have no draft rounds yet
        n = int(rng.integers(1, 30)) if rng.random() < 0.5 else 0
        seconds = float(rng.uniform(0.005, 0.05))
        table.observe(r, r + n, seconds)
        table.observe_draft(float(rng.uniform(0.001, 0.01)), r)
        history.setdefault(r, []).append((n, seconds - float(profile.step_time(r + n))))
        for q in range(1, 25):  # every request count: served, served without drafts, or never
            bs = np.arange(q, q + 50)
            plain = profile.step_time(bs)  # [50]
            above = reference_step_above(history, q, config.ema_weight, bs - q)
            step = np.maximum(plain + above, MIN_STEP_FRACTION * plain)
            assert np.allclose(table.step_time(bs, num_requests=q), step, rtol=1e-9, atol=0)
            for objective in ThetaObjective:
                extra = 0.0 if objective is ThetaObjective.PAPER else table.draft_time(q)
                assert np.allclose(table.round_rate_range(q, 50, objective), 1.0 / (extra + step),
                                   rtol=1e-9, atol=0)
            borrowed += q in history and all(x == 0 for x, _ in history[q])
    assert borrowed > 100  # lookups of counts served only without drafts
