"""Tests of dspark/admission.py against independent references (brute force, Algorithm 1 read literally)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from dspark.admission import (
    AdmissionConfig,
    AdmissionPolicy,
    Admitter,
    AsyncTopKAdmission,
    PolicyKind,
    admit_fixed,
    admit_sync_greedy,
    admit_threshold,
    admit_top_k,
    best_capacity,
    prior_candidates,
    sorted_candidates,
    stopping_count,
    survival_probs,
    sync_greedy_count,
    theta_curve,
)
from dspark.cost_table import CostTable, ThetaObjective


def async_topk(table: CostTable, **config) -> AsyncTopKAdmission:
    """async_topk under the paper's objective and the plain argmax (min_gain 1), as these tests
    pin it; AdmissionConfig's defaults (the engine's) are checked in test_engine.py."""
    return AsyncTopKAdmission(table, AdmissionConfig(
        **{"objective": ThetaObjective.PAPER, "min_gain": 1.0, **config}))


# ------------------------------------------------------------------------------------- references
def reference_survival(c: np.ndarray) -> np.ndarray:
    a = np.zeros_like(c, dtype=np.float64)
    for r in range(c.shape[0]):
        prod = 1.0
        for j in range(c.shape[1]):
            prod *= float(c[r, j])
            a[r, j] = prod
    return a


def reference_theta(a: np.ndarray, lengths, table: CostTable, objective=ThetaObjective.PAPER) -> float:
    """Theta of one length vector, from the definitions of docs/design.md section 6."""
    num_requests = a.shape[0]
    tau = num_requests + sum(float(a[r, :l].sum()) for r, l in enumerate(lengths))
    batch = num_requests + int(sum(lengths))
    rate = 1.0 / table.step_time(batch)
    drafts_paid = objective is ThetaObjective.DISAGGREGATED or (
        objective is ThetaObjective.SHARED_DEVICE and batch > num_requests)
    if drafts_paid:
        rate = 1.0 / (table.draft_seconds + table.step_time(batch))
    return tau * rate


def brute_force_best(a: np.ndarray, table: CostTable, caps=None, objective=ThetaObjective.PAPER) -> float:
    """max Theta over every length vector l_r in 0..cap_r, within the paper's candidate space E
    (a > 0: with a measured table that is not monotone, padding with zero-survival drafts could
    otherwise look "faster")."""
    num_requests, gamma = a.shape
    caps = [gamma] * num_requests if caps is None else list(caps)
    caps = [min(cap, int((a[r] > 0).sum())) for r, cap in enumerate(caps)]
    return max(
        reference_theta(a, lengths, table, objective)
        for lengths in itertools.product(*[range(cap + 1) for cap in caps])
    )


def reference_order(a: np.ndarray, caps=None) -> list[tuple[int, int]]:
    """Candidates (r, j) with a > 0, sorted by a descending, then j, then r."""
    num_requests, gamma = a.shape
    caps = [gamma] * num_requests if caps is None else list(caps)
    cands = [(r, j) for r in range(num_requests) for j in range(1, caps[r] + 1) if a[r, j - 1] > 0]
    return sorted(cands, key=lambda rj: (-a[rj[0], rj[1] - 1], rj[1], rj[0]))


def algorithm_1(c: np.ndarray, table: CostTable, caps=None, objective=ThetaObjective.PAPER) -> list[int]:
    """The paper's Algorithm 1, line by line (scalar loop with the early-stop break)."""
    a = reference_survival(c)
    num_requests = a.shape[0]
    rate = (lambda b: 1.0 / table.step_time(b)) if objective is ThetaObjective.PAPER else (
        lambda b: 1.0 / (table.draft_seconds + table.step_time(b)))
    lengths = [0] * num_requests
    best_lengths = [0] * num_requests
    batch, tau = num_requests, float(num_requests)
    theta_best = num_requests * rate(num_requests)
    for r, j in reference_order(a, caps):
        lengths[r] = j
        batch += 1
        tau += a[r, j - 1]
        theta = tau * rate(batch)
        if theta > theta_best:
            theta_best = theta
            best_lengths = list(lengths)
        else:
            break
    return best_lengths


def convex_table(rng: np.random.Generator, max_b: int, draft_seconds: float = 0.0) -> CostTable:
    """Step time t0 + t1 B + t2 B^2 measured at every B: convex and increasing, so Theta is unimodal."""
    t0, t1, t2 = rng.uniform(0.01, 0.05), rng.uniform(0.0005, 0.02), rng.uniform(0.0, 0.002)
    return CostTable.from_step_seconds(
        {b: t0 + t1 * b + t2 * b * b for b in range(1, max_b + 1)}, draft_seconds=draft_seconds
    )


def random_confidences(rng: np.random.Generator, num_requests: int, gamma: int) -> np.ndarray:
    """A mix of continuous confidences, exact 1.0 (float ties of a) and exact 0.0."""
    c = rng.uniform(0.3, 1.0, size=(num_requests, gamma))
    c[rng.random(c.shape) < 0.2] = 1.0
    c[rng.random(c.shape) < 0.05] = 0.0
    return c


def assert_prefixes(candidates, lengths_for_k):
    """Every leading run of the admission order is a set of per-request prefixes."""
    for k in range(len(candidates) + 1):
        lengths = lengths_for_k(k)
        admitted = set(zip(candidates.request[:k].tolist(), candidates.position[:k].tolist()))
        expected = {(r, j) for r, l in enumerate(lengths.tolist()) for j in range(1, l + 1)}
        assert admitted == expected, f"prefix order broken at k={k}"


# ------------------------------------------------------------------------------------- basics
def test_survival_probs_matches_loop_and_accepts_torch():
    rng = np.random.default_rng(0)
    c = rng.uniform(0, 1, size=(5, 7))
    assert np.allclose(survival_probs(c), reference_survival(c), rtol=1e-15, atol=0)
    c32 = torch.tensor(c, dtype=torch.float32)
    assert np.allclose(survival_probs(c32), reference_survival(c32.numpy()), rtol=1e-15, atol=0)


@pytest.mark.parametrize("bad", [np.array([[0.5, 1.2]]), np.array([[0.5, -0.1]]), np.array([[np.nan, 0.5]]),
                                 np.array([0.5, 0.5])])
def test_invalid_confidences_raise(bad):
    with pytest.raises(ValueError):
        survival_probs(bad)


def test_policy_parsing():
    assert AdmissionPolicy.parse("none").kind is PolicyKind.NONE
    assert AdmissionPolicy.parse("fixed:3") == AdmissionPolicy(PolicyKind.FIXED, fixed_length=3)
    assert AdmissionPolicy.parse("threshold:0.25") == AdmissionPolicy(PolicyKind.THRESHOLD, threshold=0.25)
    assert AdmissionPolicy.parse("sync_greedy").kind is PolicyKind.SYNC_GREEDY
    assert AdmissionPolicy.parse(" ASYNC_TOPK ").kind is PolicyKind.ASYNC_TOPK
    for text in ("fixed:3", "threshold:0.25", "none", "async_topk", "sync_greedy"):
        assert str(AdmissionPolicy.parse(text)) == text
    for bad in ("fixed", "fixed:-1", "threshold:1.5", "threshold", "greedy", "none:2", "fixed:x"):
        with pytest.raises(ValueError):
            AdmissionPolicy.parse(bad)
    assert AdmissionConfig(policy="fixed:2").policy.fixed_length == 2
    with pytest.raises(ValueError):
        AdmissionConfig(lag=0)
    with pytest.raises(ValueError):
        Admitter(AdmissionConfig(policy="sync_greedy"), None)


def test_none_fixed_threshold_semantics():
    rng = np.random.default_rng(1)
    c = random_confidences(rng, 20, 6)
    a = reference_survival(c)
    caps = rng.integers(0, 7, size=20)
    admit = lambda policy, **kw: Admitter(AdmissionConfig(policy=policy)).admit(c, **kw)  # noqa: E731
    assert admit("none").tolist() == [0] * 20
    assert admit("none", max_lengths=caps).tolist() == [0] * 20
    assert admit("fixed:1").tolist() == [1] * 20
    assert admit("fixed:6").tolist() == [6] * 20
    assert admit("fixed:99").tolist() == [6] * 20  # capped by gamma
    assert admit("fixed:4", max_lengths=caps).tolist() == np.minimum(4, caps).tolist()
    for h in (0.0, 0.2, 0.5, 0.9, 1.0):
        expected = []
        for r in range(20):
            l = 0
            while l < 6 and a[r, l] >= h:
                l += 1
            expected.append(l)
        assert admit(f"threshold:{h}").tolist() == expected
        assert admit(f"threshold:{h}", max_lengths=caps).tolist() == np.minimum(expected, caps).tolist()
    assert admit_fixed(c, 2).dtype == np.int64 and admit_threshold(c, 0.5).dtype == np.int64


# ------------------------------------------------------------------------------------- ordering
def test_admission_order_and_prefix_property_with_ties():
    rng = np.random.default_rng(2)
    for trial in range(60):
        num_requests, gamma = int(rng.integers(1, 7)), int(rng.integers(1, 7))
        c = random_confidences(rng, num_requests, gamma)
        if trial % 3 == 0:  # coarse values: many exact ties across requests and positions
            c = rng.choice([0.5, 1.0], size=c.shape)
        caps = rng.integers(0, gamma + 1, size=num_requests) if trial % 2 else None
        a = survival_probs(c)
        cand = sorted_candidates(a, caps)
        got = list(zip(cand.request.tolist(), cand.position.tolist()))
        assert got == reference_order(reference_survival(c), caps)
        assert np.array_equal(cand.survival, np.array([a[r, j - 1] for r, j in got]))
        assert_prefixes(cand, lambda k: admit_top_k(cand, k))


def test_all_ones_ties_fill_positions_in_order():
    cand = sorted_candidates(survival_probs(np.ones((3, 4))))
    # equal survival everywhere: position 1 of every request, then position 2, ...
    assert list(zip(cand.request.tolist(), cand.position.tolist()))[:6] == [
        (0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)]
    assert admit_top_k(cand, 5).tolist() == [2, 2, 1]


# ------------------------------------------------------------------------------------- sync greedy
@pytest.mark.parametrize("objective", [ThetaObjective.PAPER, ThetaObjective.DISAGGREGATED])
def test_sync_greedy_equals_brute_force_when_theta_is_unimodal(objective):
    rng = np.random.default_rng(3)
    for trial in range(80):
        num_requests, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        c = random_confidences(rng, num_requests, gamma)
        caps = rng.integers(0, gamma + 1, size=num_requests) if trial % 2 else None
        table = convex_table(rng, num_requests * (gamma + 1), draft_seconds=rng.uniform(0, 0.05))
        lengths = admit_sync_greedy(c, table, caps, objective)
        assert lengths.tolist() == algorithm_1(c, table, caps, objective)
        a = reference_survival(c)
        best = brute_force_best(a, table, caps, objective)
        assert reference_theta(a, lengths, table, objective) == pytest.approx(best, rel=1e-12)
        # and the global search agrees when Theta is unimodal
        cand = sorted_candidates(survival_probs(c), caps)
        k = best_capacity(cand, table, objective)
        assert reference_theta(a, admit_top_k(cand, k), table, objective) == pytest.approx(best, rel=1e-12)
        if caps is not None:
            assert (lengths <= caps).all()


def test_sync_greedy_matches_algorithm_1_on_random_staircases():
    rng = np.random.default_rng(4)
    for _ in range(60):
        num_requests, gamma = int(rng.integers(1, 8)), int(rng.integers(1, 8))
        c = random_confidences(rng, num_requests, gamma)
        steps = np.cumsum(rng.uniform(0, 0.01, size=num_requests * (gamma + 1))) + 0.02
        steps[rng.random(steps.shape) < 0.5] = np.nan  # bucketed: keep about half the points
        table = CostTable.from_step_seconds({b + 1: s for b, s in enumerate(steps) if s == s} or {1: 0.02})
        assert admit_sync_greedy(c, table).tolist() == algorithm_1(c, table)


# ------------------------------------------------------------------------------------- saw-tooth
def sawtooth_table() -> CostTable:
    # Step time jumps from 1.0 to 1.5 s as soon as the batch exceeds 4 tokens (one bucket of 4, then
    # one of 8), then grows gently.
    return CostTable.from_step_seconds({1: 1.0, 4: 1.0, 5: 1.5, 8: 1.5, 9: 2.4, 12: 2.4})


def test_async_global_search_climbs_over_a_saw_tooth_where_greedy_stops():
    table = sawtooth_table()
    c = np.full((4, 2), 0.95)  # 4 requests, confident drafts
    a = reference_survival(c)
    cand = sorted_candidates(survival_probs(c))
    curve = theta_curve(cand.survival, 4, table)
    assert curve[0] == pytest.approx(4.0) and curve[1] == pytest.approx(4.95 / 1.5)  # Theta falls first
    greedy = admit_sync_greedy(c, table)
    assert greedy.tolist() == [0, 0, 0, 0]  # stopped at the cliff
    k = best_capacity(cand, table)
    assert k == 4 and admit_top_k(cand, k).tolist() == [1, 1, 1, 1]
    best = brute_force_best(a, table)
    assert reference_theta(a, admit_top_k(cand, k), table) == pytest.approx(best, rel=1e-12)
    assert best == pytest.approx((4 + 4 * 0.95) / 1.5)
    assert reference_theta(a, greedy, table) < best - 1.0
    # In steady state (the same confidences every step) the async wrapper reaches the optimum.
    admitter = async_topk(table, lag=2)
    for step in range(4):
        lengths = admitter.admit(c, step)
    assert not admitter.used_prior
    assert reference_theta(a, lengths, table) == pytest.approx(best, rel=1e-12)


def test_global_search_equals_brute_force_on_random_staircases():
    rng = np.random.default_rng(5)
    for _ in range(40):
        num_requests, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        c = random_confidences(rng, num_requests, gamma)
        bucket = int(rng.integers(1, 4))
        table = CostTable.from_step_seconds(
            {b: 0.02 + 0.01 * ((b - 1) // bucket) + rng.uniform(0, 0.002) for b in range(1, 13)})
        a = reference_survival(c)
        cand = sorted_candidates(survival_probs(c))
        lengths = admit_top_k(cand, best_capacity(cand, table))
        assert reference_theta(a, lengths, table) == pytest.approx(brute_force_best(a, table), rel=1e-12)


@pytest.mark.parametrize("objective", list(ThetaObjective))
def test_global_search_equals_brute_force_for_every_objective(objective):
    """The global search is exact whatever the objective, also where the shared-device curve
    jumps down between 0 and 1 admitted drafts (the cost of drafting at all)."""
    rng = np.random.default_rng(6)
    for _ in range(40):
        num_requests, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        c = random_confidences(rng, num_requests, gamma)
        table = CostTable.from_step_seconds(
            {b: 0.02 + 0.004 * b + rng.uniform(0, 0.002) for b in range(1, 13)},
            draft_seconds=rng.uniform(0.0, 0.03))
        a = reference_survival(c)
        cand = sorted_candidates(survival_probs(c))
        lengths = admit_top_k(cand, best_capacity(cand, table, objective))
        assert reference_theta(a, lengths, table, objective) == pytest.approx(
            brute_force_best(a, table, objective=objective), rel=1e-12)


def test_shared_device_verifies_a_draft_only_when_it_pays_for_drafting():
    # One request: a step costs 36 ms alone, 40 ms with one draft; drafting costs 8.5 ms.
    table = CostTable.from_step_seconds({1: 0.036, 2: 0.040}, draft_seconds=0.0085)
    cand = sorted_candidates(survival_probs(np.array([[0.2]])))
    curves = {o: theta_curve(cand.survival, 1, table, o) for o in ThetaObjective}
    # paper: drafting is free, and 1.2 / 40 ms beats 1 / 36 ms
    assert curves[ThetaObjective.PAPER].tolist() == pytest.approx([1 / 0.036, 1.2 / 0.040])
    # disaggregated: every round pays drafting, so the draft looks worth verifying
    assert curves[ThetaObjective.DISAGGREGATED].tolist() == pytest.approx([1 / 0.0445, 1.2 / 0.0485])
    # shared device: not verifying saves the drafting too, and 1 / 36 ms wins
    assert curves[ThetaObjective.SHARED_DEVICE].tolist() == pytest.approx([1 / 0.036, 1.2 / 0.0485])
    best = {o: best_capacity(cand, table, o) for o in ThetaObjective}
    assert best == {ThetaObjective.PAPER: 1, ThetaObjective.DISAGGREGATED: 1, ThetaObjective.SHARED_DEVICE: 0}
    # A confident draft pays for it: 1.9 / 48.5 ms > 1 / 36 ms.
    confident = sorted_candidates(survival_probs(np.array([[0.9]])))
    assert best_capacity(confident, table, ThetaObjective.SHARED_DEVICE) == 1


def test_min_gain_keeps_k_at_zero_unless_drafts_gain_that_factor():
    """One request, drafting 8.5 ms, a step 36 ms alone and 40 ms with one draft (the test
    above): a draft confident at c gives Theta(1) / Theta(0) = (1 + c) * 36 / 48.5. At c = 0.4
    that is 1.039: the plain argmax verifies it, a 5% margin does not; at c = 0.9 (1.410) both
    do. Through the Admitter, the async K handed on two steps later obeys the same margin."""
    table = CostTable.from_step_seconds({1: 0.036, 2: 0.040}, draft_seconds=0.0085)
    shared = ThetaObjective.SHARED_DEVICE
    close = sorted_candidates(survival_probs(np.array([[0.4]])))
    theta = theta_curve(close.survival, 1, table, shared)
    gain = theta[1] / theta[0]
    assert gain == pytest.approx(1.4 * 0.036 / 0.0485, rel=1e-12)
    assert best_capacity(close, table, shared) == 1
    assert best_capacity(close, table, shared, min_gain=1.05) == 0
    assert best_capacity(close, table, shared, min_gain=gain) == 1  # the margin is inclusive
    confident = sorted_candidates(survival_probs(np.array([[0.9]])))
    assert best_capacity(confident, table, shared, min_gain=1.05) == 1
    for min_gain, k in ((1.0, 1), (1.05, 0)):
        admitter = Admitter(AdmissionConfig(policy=AdmissionPolicy.parse("async_topk"),
                                            objective=shared, min_gain=min_gain), table)
        for _ in range(2):  # the warm-up: K from the prior
            admitter.admit(np.array([[0.4]]))
        assert admitter.planned_capacity() == k
    with pytest.raises(ValueError, match="min_gain"):
        AdmissionConfig(min_gain=0.99)


def test_sync_greedy_counts_drafting_as_paid_under_shared_device():
    """sync_greedy drafts before it decides, so under SHARED_DEVICE the Admitter judges its
    drafts by SPS(B) alone, as the paper's objective does."""
    table = CostTable.from_step_seconds({1: 0.036, 2: 0.040}, draft_seconds=0.0085)
    c = np.array([[0.2]])
    shared = Admitter(AdmissionConfig(policy=AdmissionPolicy.parse("sync_greedy"),
                                      objective=ThetaObjective.SHARED_DEVICE), table)
    assert shared.admit(c).tolist() == [1] == admit_sync_greedy(c, table, objective=ThetaObjective.PAPER).tolist()


# ------------------------------------------------------------------------------------- async lag
def test_fresh_trim_admits_the_stopping_count_of_the_lagged_top_k():
    """With fresh_trim the K still comes from two rounds before; the round admits the first
    stopping_count of its own top K (drafting paid: the paper's objective), never more."""
    rng = np.random.default_rng(16)
    table = CostTable.from_step_seconds({b: 0.03 + 0.002 * b for b in range(1, 65)})
    num_requests, gamma = 3, 6
    trimmed, whole = async_topk(table, lag=2), async_topk(table, lag=2, fresh_trim=False)
    cut = 0
    for step in range(40):
        c = rng.uniform(0.0, 1.0, size=(num_requests, gamma)) ** rng.uniform(0.1, 3.0)
        lengths, all_k = trimmed.admit(c, step), whole.admit(c, step)
        k = trimmed.capacity_used
        assert k == whole.capacity_used  # the trim never changes K
        cand = sorted_candidates(survival_probs(c))
        assert all_k.tolist() == admit_top_k(cand, k).tolist()
        expected = admit_top_k(cand, stopping_count(cand, k, table))
        assert lengths.tolist() == expected.tolist() and (lengths <= all_k).all()
        cut += int(lengths.sum() < all_k.sum())
    assert cut >= 3  # the instance trims


def test_stopping_count_is_the_early_stop_where_the_step_time_is_a_straight_line():
    rng = np.random.default_rng(17)
    for _ in range(200):
        base, slope = rng.uniform(0.005, 0.05), rng.uniform(0.0, 0.02)
        table = CostTable.from_step_seconds({b: base + slope * b for b in (1, 2, 64)})
        num_requests, gamma = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        cand = sorted_candidates(survival_probs(random_confidences(rng, num_requests, gamma)))
        assert stopping_count(cand, len(cand), table) == sync_greedy_count(cand, table)


def test_stopping_count_admits_each_candidate_from_the_survivals_up_to_it():
    """The lossless condition: whether candidate i is admitted must not depend on any survival
    after it (those depend on the draft at i), nor on how many candidates there are (a zero
    survival drops one). Brute force: every tail after i redrawn below a_i, or cut off."""
    rng = np.random.default_rng(18)
    tables = [CostTable.from_step_seconds({1: 1.0, 4: 1.0, 5: 1.5, 8: 1.5, 9: 2.4, 12: 2.4, 64: 9.0}),
              CostTable.from_step_seconds({b: 0.03 + 0.0004 * b * b for b in range(1, 65)})]
    for _ in range(150):
        table = tables[int(rng.integers(2))]
        num_requests, gamma = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        cand = sorted_candidates(survival_probs(random_confidences(rng, num_requests, gamma)))
        horizon = int(rng.integers(0, len(cand) + 3))
        count = stopping_count(cand, horizon, table)
        assert 0 <= count <= min(horizon, len(cand))
        for i in range(1, min(horizon, len(cand)) + 1):  # candidate i, 1-based
            keep = cand.survival[:i]
            tail = np.sort(rng.uniform(0.0, keep[-1], size=int(rng.integers(0, 6))))[::-1]
            other = dataclasses.replace(cand, survival=np.concatenate([keep, tail]),
                                        request=np.zeros(i + tail.size, dtype=np.int64),
                                        position=np.arange(1, i + tail.size + 1))
            assert (stopping_count(other, horizon, table) >= i) == (count >= i)


def test_stopping_count_climbs_a_step_that_pays_back():
    table = sawtooth_table()
    cand = sorted_candidates(survival_probs(np.full((4, 2), 0.95)))
    assert sync_greedy_count(cand, table) == 0  # the early stop halts at the cliff
    assert stopping_count(cand, 4, table) == 4 == best_capacity(cand, table)
    assert stopping_count(cand, 1, table) == 0  # one draft does not pay for the step to B = 5


def test_async_capacity_comes_from_two_steps_before():
    rng = np.random.default_rng(6)
    table = CostTable.from_step_seconds({b: 0.03 + 0.0002 * b + 0.000002 * b * b for b in range(1, 401)})
    num_requests, gamma = 24, 8
    # Confidence levels that change from step to step, so step t-2's K differs from step t's own.
    levels = [0.9, 0.2, 0.5, 0.85, 0.3, 0.6, 0.1, 0.9]
    history = [rng.uniform(lo, lo + 0.1, size=(num_requests, gamma)) for lo in levels]
    fresh_k_differs = 0
    first = async_topk(table, lag=2, fresh_trim=False)  # every one of the top K (trim: below)
    for step, c in enumerate(history):
        lengths = first.admit(c, step)
        # An admitter with the same history up to step t-1 but a different step-t block: step t's
        # confidences must not change step t's K.
        second = async_topk(table, lag=2, fresh_trim=False)
        for old_step in range(step):
            second.admit(history[old_step], old_step)
        other = rng.uniform(0.0, 1.0, size=c.shape)
        other[:, 0] = np.where(rng.random(num_requests) < 0.5, 1.0, other[:, 0])
        lengths_other = second.admit(other, step)
        assert first.capacity_used == second.capacity_used
        if step < 2:
            # during warm-up K is the token-free prior
            assert first.used_prior and second.used_prior
            prior = prior_candidates(num_requests, gamma, 0.5)
            assert first.capacity_used == best_capacity(prior, table)
        else:
            # afterwards it is the global optimum of step t-2's curve (brute force over the count)
            assert not first.used_prior
            a_old = survival_probs(history[step - 2])
            values = np.sort(a_old.ravel())[::-1]
            thetas = [(num_requests + values[:n].sum()) * table.sps(num_requests + n)
                      for n in range(values.size + 1)]
            assert first.capacity_used == int(np.argmax(thetas))
        # the fresh top-K by fresh survival, prefixes only
        cand = sorted_candidates(survival_probs(c))
        fresh_k_differs += best_capacity(cand, table) != first.capacity_used
        assert lengths.tolist() == admit_top_k(cand, first.capacity_used).tolist()
        assert lengths.sum() == min(first.capacity_used, len(cand))
        assert lengths_other.sum() == min(second.capacity_used, len(sorted_candidates(survival_probs(other))))
    assert fresh_k_differs >= 4  # the instance can tell a lagged K from a fresh one


@pytest.mark.parametrize("lag", [1, 3])
def test_async_lag_is_structural(lag):
    table = sawtooth_table()
    high, low = np.full((4, 2), 0.95), np.full((4, 2), 0.05)
    admitter = async_topk(table, lag=lag, prior_confidence=0.0)
    used = []
    for step in range(8):
        admitter.admit(high if step == 0 else low, step)
        used.append(admitter.capacity_used)
    # prior 0 -> K = 0 for the warm-up steps; the single confident step 0 shows up exactly lag later
    assert used[:lag] == [0] * lag
    assert used[lag] == 4
    assert all(k == 0 for k in used[lag + 1:])


def nearly_flat_table() -> CostTable:
    """Verifying one more token costs almost nothing: every positive-survival draft pays."""
    return CostTable.from_step_seconds({b: 0.03 + 0.0001 * b for b in range(1, 41)})


def test_async_sees_undrafted_positions_at_their_running_means():
    table = nearly_flat_table()
    admitter = async_topk(table, lag=2, prior_confidence=0.5, mean_decay=0.0)
    full = np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.9, 0.9]])
    admitter.admit(full, 0)  # the whole block: every position's mean is known
    short = np.array([[0.95, 0.9], [0.3, 0.8]])
    admitter.admit(short, 1, block_size=4)  # only 2 of 4 positions drafted
    # decay 0: positions 1-2 take this round's batch means; 3-4 keep their ratio to position 1
    # (step 0: 0.8 / 0.7 and 0.75 / 0.7), so they move from 0.8, 0.75 as position 1 moves 0.7 -> 0.625
    m3, m4 = 0.8 * 0.625 / 0.7, 0.75 * 0.625 / 0.7
    np.testing.assert_allclose(admitter.mean_confidence, [0.625, 0.85, m3, m4])
    extended = np.array([[0.95, 0.9, m3, m4], [0.3, 0.8, m3, m4]])
    a = reference_survival(extended)
    k = admitter.planned_capacity(3)
    assert k == 8  # more than the 2 x 2 drafted candidates could ever give
    lengths = admit_top_k(sorted_candidates(survival_probs(extended)), k)
    assert reference_theta(a, lengths, table) == pytest.approx(brute_force_best(a, table), rel=1e-12)
    # without block_size, K is capped by what was drafted (the old behaviour)
    plain = async_topk(table, lag=2, prior_confidence=0.5)
    plain.admit(short, 1)
    assert plain.planned_capacity(3) == 4


def test_async_undrafted_means_follow_position_one_down():
    """A burst of confident early rounds must not freeze the means of positions that later
    rounds stop drafting: they keep their ratio to position 1 as it falls."""
    admitter = async_topk(nearly_flat_table(), lag=2, prior_confidence=0.5, mean_decay=0.5)
    admitter.admit(np.array([[0.8, 0.9, 0.6]]), 0)  # whole block drafted
    for step in range(1, 6):
        admitter.admit(np.array([[0.2]]), step, block_size=3)  # only position 1 from now on
    m1 = admitter.mean_confidence[0]
    assert m1 == pytest.approx(0.2 + 0.6 * 0.5 ** 5)
    np.testing.assert_allclose(admitter.mean_confidence[1:], [0.9 * m1 / 0.8, 0.6 * m1 / 0.8])
    # ratios above 1 are capped: a mean confidence is a probability
    capped = async_topk(nearly_flat_table(), lag=2, mean_decay=0.0)
    capped.admit(np.array([[0.5, 0.9]]), 0)
    capped.admit(np.array([[0.9]]), 1, block_size=2)
    np.testing.assert_allclose(capped.mean_confidence, [0.9, 1.0])


@pytest.mark.parametrize("steep", [False, True])
def test_async_skip_hands_on_the_capacity_of_the_running_means(steep):
    table = (CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)}) if steep
             else nearly_flat_table())
    admitter = async_topk(table, lag=2, prior_confidence=0.0, mean_decay=0.5)
    admitter.admit(np.full((2, 3), 0.6), 0)
    admitter.skip(1, num_requests=2, block_size=3)
    means = np.full((2, 3), 0.6)
    a = reference_survival(means)
    best = max(itertools.product(range(4), range(4)),
               key=lambda lengths: (reference_theta(a, lengths, table), -sum(lengths)))
    assert admitter.planned_capacity(3) == sum(best)
    assert (admitter.planned_capacity(3) == 0) == steep
    # a skip that names no requests hands on 0, as before
    admitter.skip(2)
    assert admitter.planned_capacity(4) == 0


def test_async_probe_of_a_sample_fills_in_the_other_requests_with_the_running_means():
    """A probe drafts a sample of the batch (its K is 0: it verifies nothing). The K it hands on
    is the best over a block whose sampled rows are fresh and whose other rows are the running
    means (after the sample's own update), checked against every length vector."""
    table = CostTable.from_step_seconds({b: 0.01 + 0.004 * b for b in range(1, 41)})
    admitter = async_topk(table, lag=2, prior_confidence=0.0, mean_decay=0.5)
    admitter.admit(np.full((3, 3), 0.2), 0)
    sample = np.array([[0.95]])  # one request, one position drafted
    admitter.probe(sample, 1, num_requests=3, block_size=3)
    # position 1's mean: 0.5 * 0.2 + 0.5 * 0.95; positions 2-3 keep their ratio to it (1)
    np.testing.assert_allclose(admitter.mean_confidence, [0.575, 0.575, 0.575])
    block = np.full((3, 3), 0.575)
    block[0, 0] = 0.95
    a = reference_survival(block)
    best = max(itertools.product(range(4), repeat=3),
               key=lambda lengths: (reference_theta(a, lengths, table), -sum(lengths)))
    assert admitter.planned_capacity(3) == sum(best) and 0 < sum(best) < 9
    assert admitter.capacity_used == 0
    with pytest.raises(ValueError, match="does not fit"):
        admitter.probe(np.full((4, 1), 0.5), 2, num_requests=3, block_size=3)


def test_admitter_async_default_step_numbering_and_gap():
    table = sawtooth_table()
    admitter = Admitter(AdmissionConfig(policy="async_topk", prior_confidence=0.0,
                                        objective=ThetaObjective.PAPER), table)
    high = np.full((4, 2), 0.95)
    assert admitter.admit(high).sum() == 0  # step 0, prior K = 0
    assert admitter.admit(high).sum() == 0  # step 1, prior K = 0
    assert admitter.admit(high).sum() == 4  # step 2, K from step 0
    assert admitter.admit(high, step_index=10).sum() == 0  # a gap: no history for step 10, prior again


# ------------------------------------------------------------------------------------- caps
@pytest.mark.parametrize("policy", ["none", "fixed:2", "fixed:9", "threshold:0.3", "sync_greedy", "async_topk"])
def test_every_policy_respects_max_lengths(policy):
    rng = np.random.default_rng(7)
    table = convex_table(rng, 600)
    admitter = Admitter(AdmissionConfig(policy=policy, prior_confidence=0.9,
                                        objective=ThetaObjective.PAPER), table)
    for step in range(5):
        c = torch.tensor(random_confidences(rng, 40, 9), dtype=torch.float32)
        caps = torch.tensor(rng.integers(0, 12, size=40))  # some above gamma
        lengths = admitter.admit(c, step, max_lengths=caps)
        assert lengths.shape == (40,) and lengths.dtype == np.int64
        assert (lengths >= 0).all() and (lengths <= np.minimum(caps.numpy(), 9)).all()


@pytest.mark.parametrize("policy", ["none", "fixed:2", "threshold:0.3", "sync_greedy", "async_topk"])
def test_the_admitter_answers_every_question_under_every_policy(policy):
    """What only async_topk records between admissions belongs to its round policy: each
    public method of the Admitter answers whatever the policy (None where it has no K)."""
    admitter = Admitter(AdmissionConfig(policy=policy, objective=ThetaObjective.PAPER),
                        sawtooth_table())
    for _ in range(3):
        assert 1 <= admitter.positions_to_draft(4) <= 4
        lengths = admitter.admit(np.full((2, 4), 0.9), block_size=4)
        assert lengths.shape == (2,) and (lengths <= 4).all()
    asynchronous = policy == "async_topk"
    assert (admitter.capacity_used is not None) == asynchronous
    assert (admitter.planned_capacity() is not None) == asynchronous
    assert (admitter.async_topk is not None) == asynchronous


def test_capped_requests_leave_room_for_others():
    # request 0 is very confident but may take only 1 more token; request 1 takes the capacity
    table = CostTable.from_step_seconds({b: 0.01 for b in range(1, 20)})  # free tokens up to 19
    c = np.array([[1.0, 1.0, 1.0], [0.9, 0.9, 0.9]])
    assert admit_sync_greedy(c, table, max_lengths=np.array([1, 3])).tolist() == [1, 3]
    cand = sorted_candidates(survival_probs(c), np.array([1, 3]))
    assert len(cand) == 4 and best_capacity(cand, table) == 4


def test_positions_to_draft_stop_where_no_policy_admits_more():
    """fixed:N drafts N positions (at least one), async_topk K + 1 once K is decided, the other
    policies the whole block; and what each policy admits never passes those positions."""
    table = CostTable.from_step_seconds({b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    gamma = 7
    for text, positions in (("fixed:2", 2), ("fixed:0", 1), ("fixed:9", 7), ("none", 7),
                            ("threshold:0.5", 7), ("sync_greedy", 7)):
        admitter = Admitter(AdmissionConfig(policy=AdmissionPolicy.parse(text),
                                            objective=ThetaObjective.PAPER), table)
        assert admitter.positions_to_draft(gamma) == positions, text
        c = np.full((3, positions), 0.99)
        assert int(admitter.admit(c, block_size=gamma).max()) <= positions, text
    admitter = Admitter(AdmissionConfig(policy=AdmissionPolicy.parse("async_topk"),
                                        objective=ThetaObjective.PAPER), table)
    assert admitter.positions_to_draft(gamma) == gamma  # no K decided yet
    for _ in range(4):
        admitter.admit(np.full((1, gamma), 0.99))
        k = admitter.planned_capacity()
        if k is not None:
            assert admitter.positions_to_draft(gamma) == min(gamma, k + 1)
    assert admitter.planned_capacity() is not None
