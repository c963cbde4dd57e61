"""Tests of dspark/calibration/: metrics against slow references, STS on synthetic data with known
true probabilities (docs/design.md sections 4 and 9)."""

import json
import math
import struct
import zlib

import numpy as np
import pytest
import torch

from dspark.calibration.fit import STSFitConfig, crossfit_ece, fit_sts
from dspark.calibration.metrics import (brier_score, conditional_auc, ece_noise_floor,
                                        expected_calibration_error, roc_auc)
from dspark.calibration.outcomes import survival_from_accepted_len
from dspark.calibration.report import calibration_report, plot_reliability
from dspark.calibration.sts_map import CALIBRATION_FILENAME, CalibrationSet, STSCalibration

OVERCONFIDENCE = 2.5  # raw logit = 2.5 * true logit, so the ideal temperature is 2.5


# ----------------------------------------------------------------------------------------------
# Slow references, written independently of the module's vectorised code


def ece_reference(pred, obs, num_bins):
    """Loop over bins with explicit edges [lo, hi), the last bin closed at 1."""
    pred = [float(p) for p in pred]
    obs = [float(o) for o in obs]
    total = 0.0
    for b in range(num_bins):
        lo, hi = b / num_bins, (b + 1) / num_bins
        last = b == num_bins - 1
        members = [i for i, p in enumerate(pred) if lo <= p and (p < hi or (last and p <= 1.0))]
        if not members:
            continue
        mean_p = sum(pred[i] for i in members) / len(members)
        mean_o = sum(obs[i] for i in members) / len(members)
        total += len(members) / len(pred) * abs(mean_p - mean_o)
    return total


def auc_reference(score, label):
    """All positive/negative pairs: 1 if the positive scores higher, 1/2 on a tie."""
    score = np.asarray(score, dtype=np.float64)
    label = np.asarray(label, dtype=bool)
    pos, neg = score[label], score[~label]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (pos.size * neg.size)


def synthetic(num_samples, gamma, seed, overconfidence=OVERCONFIDENCE):
    """True per-position acceptance q ~ Beta(5, 1.5); raw confidence sigmoid(k * logit(q));
    outcomes drawn position by position from q, so survival is the running product."""
    rng = np.random.default_rng(seed)
    q = rng.beta(5.0, 1.5, size=(num_samples, gamma))  # [num_samples, gamma]
    c_raw = 1.0 / (1.0 + np.exp(-overconfidence * (np.log(q) - np.log1p(-q))))
    accepted = rng.random((num_samples, gamma)) < q
    survived = np.cumprod(accepted, axis=1).astype(bool)
    return q, c_raw, survived


@pytest.fixture(scope="module")
def fitted():
    q, c_raw, survived = synthetic(30_000, 5, seed=1234)
    return q, c_raw, survived, fit_sts(c_raw, survived)


# ----------------------------------------------------------------------------------------------
# Metrics


def test_ece_hand_computed():
    # 2 bins: [0, 0.5) holds 0.1, 0.3 (obs 0, 1): |0.2 - 0.5| = 0.3, weight 2/5;
    # [0.5, 1] holds 0.6, 0.8, 1.0 (obs 1, 1, 0): |0.8 - 2/3|, weight 3/5.
    pred = [0.1, 0.3, 0.6, 0.8, 1.0]
    obs = [0, 1, 1, 1, 0]
    expected = 0.4 * 0.3 + 0.6 * abs(0.8 - 2.0 / 3.0)
    assert expected_calibration_error(pred, obs, num_bins=2) == pytest.approx(expected, abs=1e-15)
    # one bin: |mean pred - mean obs|
    assert expected_calibration_error(pred, obs, num_bins=1) == pytest.approx(abs(0.56 - 0.6), abs=1e-15)


def test_ece_bin_edges():
    # 0.5 opens the upper bin of two; 1.0 belongs to the last bin; 0.0 to the first.
    assert expected_calibration_error([0.5, 0.0], [1, 0], num_bins=2) == pytest.approx(0.25)
    assert expected_calibration_error([0.5, 0.49], [1, 0], num_bins=2) == pytest.approx(0.5 * 0.5 + 0.5 * 0.49)
    assert expected_calibration_error([1.0, 0.0], [1, 0], num_bins=15) == 0.0
    assert expected_calibration_error([1.0, 0.0], [0, 1], num_bins=15) == 1.0
    with pytest.raises(ValueError):
        expected_calibration_error([1.2], [1])


@pytest.mark.parametrize("num_bins", [1, 7, 15])
def test_ece_matches_reference(num_bins):
    rng = np.random.default_rng(num_bins)
    pred = rng.random(2000) ** 2
    obs = rng.random(2000) < pred * 0.8 + 0.1
    got = expected_calibration_error(pred, obs, num_bins)
    assert got == pytest.approx(ece_reference(pred, obs, num_bins), abs=1e-12)
    # torch input, soft outcomes
    soft = rng.random(2000)
    got_t = expected_calibration_error(torch.from_numpy(pred), torch.from_numpy(soft), num_bins)
    assert got_t == pytest.approx(ece_reference(pred, soft, num_bins), abs=1e-12)


def test_auc_hand_computed_and_ties():
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [1, 1, 0, 0]) == 1.0
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [1, 1, 0, 0]) == 0.0
    # pairs (pos, neg): (0.5,0.5) tie, (0.5,0.1) win, (0.3,0.5) loss, (0.3,0.1) win -> 2.5 / 4
    assert roc_auc([0.5, 0.3, 0.5, 0.1], [1, 1, 0, 0]) == 0.625
    assert math.isnan(roc_auc([0.1, 0.2], [1, 1]))


def test_auc_matches_pairwise_reference():
    rng = np.random.default_rng(7)
    score = np.round(rng.random(1500), 2)  # coarse rounding: many ties
    label = rng.random(1500) < 0.3 + 0.4 * score
    assert roc_auc(score, label) == pytest.approx(auc_reference(score, label), abs=1e-14)
    assert roc_auc(torch.from_numpy(score), torch.from_numpy(label)) == roc_auc(score, label)


def test_brier():
    pred = np.array([0.1, 0.7, 0.4])
    obs = np.array([0, 1, 1])
    assert brier_score(pred, obs) == pytest.approx((0.01 + 0.09 + 0.36) / 3, abs=1e-15)


def test_ece_noise_floor_matches_a_loop_and_shrinks_with_samples():
    # Reference: draw outcomes from the predictions one draw at a time, score with ece_reference.
    rng = np.random.default_rng(3)
    pred = rng.beta(2.0, 5.0, size=300)
    draws = 40
    floor = ece_noise_floor(pred, 15, draws=draws, seed=11)
    block = np.random.default_rng(11).random((draws, pred.size)) < pred[None, :]  # the same stream
    ref = np.mean([ece_reference(pred, block[i], 15) for i in range(draws)])
    assert floor == pytest.approx(ref, abs=1e-12)
    # a perfectly calibrated predictor's ECE falls like 1 / sqrt(n)
    big = rng.beta(2.0, 5.0, size=30_000)
    assert ece_noise_floor(big[:750]) > 2.5 * ece_noise_floor(big)
    assert ece_noise_floor(np.zeros(10)) == 0.0  # certain outcomes: no noise
    with pytest.raises(ValueError):
        ece_noise_floor([1.5])


# ----------------------------------------------------------------------------------------------
# Outcomes


def test_survival_from_accepted_len():
    surv = survival_from_accepted_len(np.array([0, 2, 3]), gamma=3)
    np.testing.assert_array_equal(surv, [[0, 0, 0], [1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError):
        survival_from_accepted_len(np.array([4]), gamma=3)


def test_rejects_per_position_acceptance_matrix():
    c = np.full((2, 3), 0.5)
    with pytest.raises(ValueError, match="prefix-survival"):
        fit_sts(c, np.array([[1, 0, 1], [1, 1, 1]], dtype=bool))


# ----------------------------------------------------------------------------------------------
# STS


def test_sts_calibrates_overconfident_synthetic(fitted):
    q, c_raw, survived, sts = fitted
    report = calibration_report(c_raw, survived, sts)
    for pos in report.positions:
        assert pos.ece_after <= 0.015, pos
        assert pos.ece_before >= 0.05, pos  # clearly over-confident before
        assert pos.brier_after < pos.brier_before
    # the truth is T = 2.5 at every position; the grid search must land near it
    assert all(2.0 < t < 3.1 for t in sts.temperatures), sts.temperatures
    # and the calibrated survival is close to the true survival probabilities
    err = np.abs(sts.survival(c_raw) - np.cumprod(q, axis=1))
    assert err.mean() < 0.03


def test_sts_keeps_conditional_auc(fitted):
    _, c_raw, survived, sts = fitted
    calibrated = sts.apply(c_raw)
    report = calibration_report(c_raw, survived, sts)
    for k in range(1, c_raw.shape[1] + 1):
        before = conditional_auc(c_raw, survived, k)
        after = conditional_auc(calibrated, survived, k)
        assert abs(before - after) <= 1e-12
        assert report.positions[k - 1].auc_conditional == before
        assert 0.6 < before < 0.9  # informative but imperfect ranking


def test_sts_equals_brute_force_sequential_search():
    # Independent reference: for each k, loop over the grid, score each T with ece_reference
    # on the cumulative product built from the already-chosen temperatures.
    _, c_raw, survived = synthetic(400, 3, seed=5)
    grid = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0]
    sts = fit_sts(c_raw, survived, grid=grid, config=STSFitConfig(num_refine=0))
    logit = np.log(c_raw) - np.log1p(-c_raw)
    prefix = np.ones(c_raw.shape[0])
    chosen = []
    for k in range(3):
        scores = [ece_reference(prefix / (1 + np.exp(-logit[:, k] / t)), survived[:, k], 15) for t in grid]
        best = grid[int(np.argmin(scores))]
        chosen.append(best)
        prefix = prefix / (1 + np.exp(-logit[:, k] / best))
    assert sts.temperatures == chosen


def test_sts_is_left_to_right():
    # fitting more positions never changes the temperatures of earlier ones
    _, c_raw, survived = synthetic(5000, 4, seed=9)
    full = fit_sts(c_raw, survived)
    first_two = fit_sts(c_raw[:, :2], survived[:, :2])
    assert full.temperatures[:2] == first_two.temperatures


def test_sts_accepted_len_equals_survival_matrix():
    _, c_raw, survived = synthetic(3000, 4, seed=3)
    accepted_len = survived.sum(axis=1)
    a = fit_sts(c_raw, survived)
    b = fit_sts(torch.from_numpy(c_raw), accepted_len=torch.from_numpy(accepted_len))
    assert a.temperatures == b.temperatures


def test_sts_underconfident_gets_temperature_below_one():
    _, c_raw, survived = synthetic(8000, 2, seed=11, overconfidence=0.5)
    sts = fit_sts(c_raw, survived)
    assert all(0.35 < t < 0.7 for t in sts.temperatures), sts.temperatures


def shifted_synthetic(num_samples, gamma, seed, overconfidence=OVERCONFIDENCE, offset=1.2):
    """Like synthetic, but the raw logit is also offset: a head that over-predicts everywhere
    (true map: logit(q) = logit(c) / overconfidence - offset / overconfidence)."""
    rng = np.random.default_rng(seed)
    q = rng.beta(2.0, 3.0, size=(num_samples, gamma))  # [num_samples, gamma], mean 0.4
    c_raw = 1.0 / (1.0 + np.exp(-(overconfidence * (np.log(q) - np.log1p(-q)) + offset)))
    accepted = rng.random((num_samples, gamma)) < q
    survived = np.cumprod(accepted, axis=1).astype(bool)
    return q, c_raw, survived


def test_shifted_sts_calibrates_an_offset_head_that_plain_sts_cannot():
    q, c_raw, survived = shifted_synthetic(30_000, 4, seed=77)
    plain = calibration_report(c_raw, survived, fit_sts(c_raw, survived))
    sts = fit_sts(c_raw, survived, shift=True)
    shifted = calibration_report(c_raw, survived, sts)
    assert sts.shifted and shifted.biases == sts.biases
    for p_plain, p_shift in zip(plain.positions, shifted.positions):
        assert p_shift.ece_after <= 0.015, p_shift
        assert p_shift.brier_after <= p_plain.brier_after + 1e-12
    assert plain.positions[0].ece_after >= 0.03  # a temperature alone cannot undo the offset
    # the truth: T = 2.5 and b = -1.2 / 2.5 at every position
    assert 2.0 < sts.temperatures[0] < 3.1 and -0.75 < sts.biases[0] < -0.25, sts
    err = np.abs(sts.survival(c_raw) - np.cumprod(q, axis=1))
    assert err.mean() < 0.03
    # order-preserving per position: the conditional AUC is unchanged
    for k in range(1, 5):
        assert abs(conditional_auc(c_raw, survived, k)
                   - conditional_auc(sts.apply(c_raw), survived, k)) <= 1e-12


def test_shifted_sts_keeps_the_heads_sharpness():
    # An informative, well-calibrated head must stay sharp: log-loss never picks the flat
    # near-constant map that a joint ECE search can reach (Brier no worse than raw).
    q, c_raw, survived = synthetic(20_000, 3, seed=21, overconfidence=1.0)
    sts = fit_sts(c_raw, survived, shift=True)
    report = calibration_report(c_raw, survived, sts)
    for pos in report.positions:
        assert pos.brier_after <= pos.brier_before + 1e-4, pos
    assert all(0.8 < t < 1.25 for t in sts.temperatures[:2]), sts


def log_loss_reference(pred, obs):
    """Per-sample loop: -log p for a survivor, -log(1 - p) otherwise (p clipped to 1e-12)."""
    total = 0.0
    for p, y in zip(pred, obs):
        p = min(max(float(p), 1e-12), 1.0 - 1e-12)
        total -= math.log(p) if y else math.log(1.0 - p)
    return total / len(pred)


def test_shifted_sts_equals_brute_force_joint_search():
    # Independent reference: for each k, loop over every (T, b) of the grids, score with
    # log_loss_reference on the cumulative product of the already-chosen maps; first minimum wins.
    _, c_raw, survived = shifted_synthetic(400, 3, seed=5)
    config = STSFitConfig(num_refine=0, t_min=0.5, t_max=4.0, num_shift_temperatures=4,
                          b_min=-1.0, b_max=1.0, num_bias_grid=5)
    sts = fit_sts(c_raw, survived, shift=True, config=config)
    temps = np.geomspace(0.5, 4.0, 4)
    shifts = np.linspace(-1.0, 1.0, 5)
    logit = np.log(c_raw) - np.log1p(-c_raw)
    prefix = np.ones(c_raw.shape[0])
    chosen_t, chosen_b = [], []
    for k in range(3):
        best = None
        for t in temps:
            for b in shifts:
                score = log_loss_reference(prefix / (1 + np.exp(-(logit[:, k] / t + b))), survived[:, k])
                if best is None or score < best[0] - 1e-12:
                    best = (score, t, b)
        chosen_t.append(best[1])
        chosen_b.append(best[2])
        prefix = prefix / (1 + np.exp(-(logit[:, k] / best[1] + best[2])))
    np.testing.assert_allclose(sts.temperatures, chosen_t, rtol=1e-12)
    np.testing.assert_allclose(sts.biases, chosen_b, atol=1e-12)


def test_shifted_fit_refuses_an_explicit_temperature_grid():
    _, c_raw, survived = synthetic(100, 2, seed=1)
    with pytest.raises(ValueError, match="plain fit"):
        fit_sts(c_raw, survived, shift=True, grid=[1.0, 2.0])


# ----------------------------------------------------------------------------------------------
# apply / persistence


def test_apply_torch_matches_numpy_and_formula():
    sts = STSCalibration([0.5, 2.0, 3.0])
    gen = torch.Generator().manual_seed(0)
    c = torch.rand(2, 4, 3, generator=gen, dtype=torch.float64)  # [..., gamma]
    out = sts.apply(c)
    assert isinstance(out, torch.Tensor) and out.shape == c.shape and out.dtype == torch.float64
    logit = torch.log(c / (1 - c))
    expected = 1 / (1 + torch.exp(-logit / torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sts.apply(c.numpy()), out.numpy(), rtol=1e-12, atol=1e-14)
    out32 = sts.apply(c.float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, out.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sts.survival(c), torch.cumprod(out, dim=-1))


def test_apply_with_shift_matches_formula():
    sts = STSCalibration([0.5, 2.0, 3.0], [0.3, -1.0, 0.0])
    c = torch.rand(5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logit = torch.log(c / (1 - c))
    expected = torch.sigmoid(logit / torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
                             + torch.tensor([0.3, -1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(sts.apply(c), expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sts.apply(c.numpy()), expected.numpy(), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="biases"):
        STSCalibration([1.0, 1.0], [0.0])
    with pytest.raises(ValueError, match="finite"):
        STSCalibration([1.0], [float("nan")])


def test_apply_clamps_extremes_and_half():
    sts = STSCalibration([2.0, 0.5])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        c = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=dtype)
        out = sts.apply(c)
        assert out.dtype == dtype
        assert torch.isfinite(out.float()).all()
        if dtype != torch.bfloat16:  # bf16 rounds 1 - 3.5e-4 to 1.0
            assert (out[:, 0] > 0).all() and (out[:, 0] < 1).all()  # T=2 pulls inward
    np.testing.assert_allclose(STSCalibration.identity(2).apply(np.array([0.3, 0.9])), [0.3, 0.9], rtol=1e-15)
    with pytest.raises(ValueError):
        sts.apply(torch.rand(3))
    with pytest.raises(ValueError):
        STSCalibration([1.0, -1.0])


def test_json_round_trip(tmp_path, fitted):
    _, c_raw, _, sts = fitted
    file_path = tmp_path / "x.json"
    sts.save(file_path)
    loaded = STSCalibration.load(file_path)
    assert loaded == sts
    np.testing.assert_array_equal(loaded.apply(c_raw), sts.apply(c_raw))
    assert json.loads(file_path.read_text())["temperatures"] == sts.temperatures
    # a checkpoint directory gets calibration.json
    sts.save(tmp_path)
    assert (tmp_path / CALIBRATION_FILENAME).exists()
    assert STSCalibration.load(tmp_path) == sts
    with pytest.raises(ValueError):
        STSCalibration.from_dict({"format": "other", "temperatures": [1.0]})


def test_calibration_set_picks_the_nearest_sampling_temperature(tmp_path):
    greedy = STSCalibration([1.0, 1.0], [0.5, 0.0], sampling_temperature=0.0)
    t1 = STSCalibration([2.0, 2.0], [-0.5, 0.0], sampling_temperature=1.0)
    fits = CalibrationSet([t1, greedy])
    assert fits.fits == [greedy, t1]  # sorted by sampling temperature
    assert fits.for_temperature(0.0) is greedy and fits.for_temperature(0.4) is greedy
    assert fits.for_temperature(0.5) is greedy  # a tie goes to the lower temperature
    assert fits.for_temperature(0.7) is t1 and fits.for_temperature(1.5) is t1
    fits.save(tmp_path)
    data = json.loads((tmp_path / CALIBRATION_FILENAME).read_text())
    assert data["version"] == 2 and [f["sampling_temperature"] for f in data["fits"]] == [0.0, 1.0]
    assert CalibrationSet.load(tmp_path) == fits
    with pytest.raises(ValueError, match="use CalibrationSet"):
        STSCalibration.load(tmp_path)
    with pytest.raises(ValueError, match="sampling_temperature"):
        CalibrationSet([t1, STSCalibration([1.0, 1.0])])
    with pytest.raises(ValueError, match="same sampling temperature"):
        CalibrationSet([t1, t1])
    with pytest.raises(ValueError, match="gamma"):
        CalibrationSet([greedy, STSCalibration([1.0], sampling_temperature=1.0)])
    with pytest.raises(ValueError, match="sampling_temperature"):
        STSCalibration([1.0], sampling_temperature=-1.0)
    # one fit of any temperature serves every request
    only = CalibrationSet([t1])
    assert only.for_temperature(0.0) is t1


def test_json_versions(tmp_path):
    # plain STS is written as version 1 (what older code reads); a shift needs version 2
    plain = STSCalibration([0.5, 2.0])
    assert plain.to_dict() == {"format": "dspark.sts", "version": 1, "temperatures": [0.5, 2.0]}
    shifted = STSCalibration([0.5, 2.0], [-0.4, 0.0])
    shifted.save(tmp_path / "s.json")
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["version"] == 2 and data["fits"] == [{"temperatures": [0.5, 2.0], "biases": [-0.4, 0.0]}]
    assert STSCalibration.load(tmp_path / "s.json") == shifted
    assert STSCalibration.from_dict({"format": "dspark.sts", "version": 1,
                                     "temperatures": [1.5]}).biases == [0.0]
    with pytest.raises(ValueError, match="version"):
        STSCalibration.from_dict({"format": "dspark.sts", "version": 3, "temperatures": [1.0]})


# ----------------------------------------------------------------------------------------------
# Report and diagram


def test_report_matches_metrics(fitted):
    _, c_raw, survived, sts = fitted
    report = calibration_report(c_raw, survived, sts)
    a_raw = np.cumprod(c_raw, axis=1)
    a_cal = sts.survival(c_raw)
    for k, pos in enumerate(report.positions):
        assert pos.position == k + 1
        assert pos.num_at_risk == (len(c_raw) if k == 0 else int(survived[:, k - 1].sum()))
        assert pos.ece_before == expected_calibration_error(a_raw[:, k], survived[:, k])
        assert pos.ece_after == expected_calibration_error(a_cal[:, k], survived[:, k])
        assert pos.brier_after == brier_score(a_cal[:, k], survived[:, k])
        assert pos.auc_prefix_after == roc_auc(a_cal[:, k], survived[:, k])
    table = report.format_table()
    assert len(table.splitlines()) == len(report.positions) + 2
    assert json.loads(json.dumps(report.to_dict()))["temperatures"] == sts.temperatures


def _png_size(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    ihdr = data[16:29]
    (crc,) = struct.unpack(">I", data[29:33])
    assert zlib.crc32(b"IHDR" + ihdr) == crc
    assert data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", ihdr[:8])


def test_reliability_png(tmp_path, fitted):
    _, c_raw, survived, sts = fitted
    one = plot_reliability(tmp_path / "one.png", c_raw[:3000], survived[:3000], sts, positions=[2])
    several = plot_reliability(tmp_path / "several.png", c_raw[:3000], survived[:3000], sts)
    w1, h1 = _png_size(open(one, "rb").read())
    w5, h5 = _png_size(open(several, "rb").read())
    assert w1 > 100 and h1 > 100
    assert w5 > w1  # one panel per position
    raw_only = plot_reliability(tmp_path / "raw.png", c_raw[:3000], survived[:3000], None)
    _png_size(open(raw_only, "rb").read())
    with pytest.raises(ValueError):
        plot_reliability(tmp_path / "bad.png", c_raw, survived, sts, positions=[0])


def test_crossfit_ece_matches_the_in_sample_ece_on_rounds_from_one_distribution():
    # 2 parameters a position on 20k rounds hardly overfit: held-out and in-sample ECE agree,
    # both near the noise floor and far below the raw head's.
    q, c_raw, survived = shifted_synthetic(20_000, 3, seed=5)
    sts = fit_sts(c_raw, survived, shift=True)
    report = calibration_report(c_raw, survived, sts, crossfit_folds=2)
    assert report.ece_crossfit == crossfit_ece(c_raw, survived, shift=True, folds=2)
    for pos, cv in zip(report.positions, report.ece_crossfit):
        assert abs(cv - pos.ece_after) < 0.01 and cv < 0.02 < pos.ece_before, (pos, cv)
    assert "ECE cv" in report.format_table() and "cross-fitted" in report.format_table()
    assert report.to_dict()["ece_crossfit"] == report.ece_crossfit


def test_crossfit_ece_shows_a_drift_that_the_in_sample_ece_hides():
    # The first half's head over-predicts, the second half's under-predicts by as much: one fit
    # on both halves is calibrated on the pooled rounds (small in-sample ECE), but a fit on
    # either half is badly off on the other, which the cross-fitted ECE shows.
    rng = np.random.default_rng(9)
    n, gamma = 20_000, 2
    q = rng.beta(2.0, 2.0, size=(n, gamma))  # [n, gamma]
    offset = np.where(np.arange(n) < n // 2, 0.6, -0.6)[:, None]  # [n, 1]
    c_raw = 1.0 / (1.0 + np.exp(-(np.log(q) - np.log1p(-q) + offset)))
    survived = np.cumprod(rng.random((n, gamma)) < q, axis=1).astype(bool)
    sts = fit_sts(c_raw, survived, shift=True)
    report = calibration_report(c_raw, survived, sts, crossfit_folds=2)
    for pos, cv in zip(report.positions, report.ece_crossfit):
        assert pos.ece_after < 0.03 and cv > 0.12, (pos, cv)


def test_crossfit_ece_needs_two_folds_and_enough_rounds():
    _, c_raw, survived = shifted_synthetic(10, 2, seed=1)
    with pytest.raises(ValueError, match="folds"):
        crossfit_ece(c_raw, survived, folds=1)
    with pytest.raises(ValueError, match="folds"):
        crossfit_ece(c_raw, survived, folds=11)
    assert calibration_report(c_raw, survived, fit_sts(c_raw, survived)).ece_crossfit is None
