"""Acceptance figures (dspark.evaluation.acceptance): hand counts on constructed records, an
oracle drafter (the target's own greedy continuation) through the real engine, and the engine's
round observer against the engine's own per-request metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.calibration.metrics import expected_calibration_error
from dspark.calibration.sts_map import STSCalibration
from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig
from dspark.evaluation.acceptance import (AcceptanceRecords, CollectConfig, RoundCollector,
                                          acceptance_length, collect_records,
                                          conditional_acceptance, summarize)
from dspark.models.draft_types import DraftBlock
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.sampling import SamplingParams
from loadtest.tiny_models import GAMMA, LAYER_IDS, VOCAB
from dspark.verifier import TargetVerifier

from ..conftest import tiny_dspark

PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [40], [8, 8, 8, 8, 8]]


def make_runner(folder) -> TargetRunner:
    return TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS, kv_cache_tokens=4096))


# ------------------------------------------------------------------------------------------------
# Constructed records
# ------------------------------------------------------------------------------------------------


def reference_conditional(admitted, accepted, num_positions):
    """Loop-by-loop hand count of the definition."""
    out = []
    for k in range(1, num_positions + 1):
        at_risk = hits = 0
        for l, n in zip(admitted, accepted):
            if l >= k and n >= k - 1:  # verified position k and accepted 1..k-1
                at_risk += 1
                hits += n >= k
        out.append(hits / at_risk if at_risk else float("nan"))
    return np.array(out)


def test_conditional_acceptance_by_hand():
    admitted = [3, 3, 3, 3, 2, 3]
    accepted = [0, 1, 3, 2, 2, 3]
    # all rounds: position 1 at risk in 6 rounds, accepted in 5; position 2: at risk 5 (accepted
    # >= 1), accepted in 4; position 3: only admitted == 3 and accepted >= 2 -> 3 rounds, 2 hits.
    np.testing.assert_allclose(conditional_acceptance(admitted, accepted, 3), [5 / 6, 4 / 5, 2 / 3])
    records = AcceptanceRecords(list(range(6)), np.full((6, 3), 0.5), admitted, accepted, 3)
    s = summarize(records)
    # full rounds only (the cut round 4 is left out): accepted [0, 1, 3, 2, 3]
    assert s.rounds == 5 and s.rounds_cut == 1
    np.testing.assert_allclose(s.accept_per_position, [4 / 5, 3 / 4, 2 / 3])
    assert s.tau == pytest.approx((1 + 2 + 4 + 3 + 4) / 5)
    # tau = 1 + sum_k prod_{i<=k} conditional acceptance on the same rounds
    assert s.tau == pytest.approx(1 + np.cumprod(s.accept_per_position).sum())
    np.testing.assert_array_equal(records.full_rounds().survival(),
                                  [[0, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])


def test_conditional_acceptance_matches_loop_on_random_records():
    rng = np.random.default_rng(3)
    admitted = rng.integers(0, 6, size=500)
    accepted = np.array([rng.integers(0, l + 1) for l in admitted])
    np.testing.assert_allclose(conditional_acceptance(admitted, accepted, 6),
                               reference_conditional(admitted, accepted, 6), equal_nan=True)


def test_unreached_position_is_nan_and_tau_of_nothing():
    got = conditional_acceptance([2, 2], [0, 0], 3)
    assert got[0] == 0.0 and np.isnan(got[1]) and np.isnan(got[2])
    assert np.isnan(acceptance_length(np.zeros(0)))
    with pytest.raises(ValueError):
        AcceptanceRecords([0], np.zeros((1, 2)), [1], [2], 2)  # accepted > admitted


def test_a_run_without_full_rounds_reports_none():
    """Every round cut short (answers shorter than a block): no full round, so no tau, not a crash."""
    records = AcceptanceRecords([0, 1], np.full((2, 3), 0.5), [2, 1], [1, 0], 3)
    full = records.full_rounds()
    assert full.num_rounds == 0 and full.gamma == 3
    summary = summarize(records)
    assert np.isnan(summary.tau) and summary.rounds == 0 and summary.rounds_cut == 2


def test_summary_calibration_uses_the_cumulative_raw_confidences():
    rng = np.random.default_rng(0)
    n, gamma = 400, 3
    conf = rng.uniform(0.05, 0.95, size=(n, gamma))
    accepted = rng.integers(0, gamma + 1, size=n)
    records = AcceptanceRecords(list(range(n)), conf, np.full(n, gamma), accepted, gamma)
    sts = STSCalibration([0.5, 2.0, 1.0])
    s = summarize(records, sts, with_calibration=True)
    surv = accepted[:, None] >= np.arange(1, gamma + 1)
    for k in range(gamma):
        raw = np.prod(conf[:, :k + 1], axis=1)
        scaled = 1 / (1 + np.exp(-np.log(conf / (1 - conf)) / np.array(sts.temperatures)))
        after = np.prod(scaled[:, :k + 1], axis=1)
        assert s.calibration.positions[k].ece_before == pytest.approx(
            expected_calibration_error(raw, surv[:, k]))
        assert s.calibration.positions[k].ece_after == pytest.approx(
            expected_calibration_error(after, surv[:, k]))
    d = s.to_dict()
    assert len(d["ece_before"]) == gamma and d["sts_temperatures"] == [0.5, 2.0, 1.0]


# ------------------------------------------------------------------------------------------------
# Through the engine
# ------------------------------------------------------------------------------------------------


class OracleDrafter:
    """Drafts the target's own greedy continuation (from the context the engine appended), with
    position `wrong` (1-based; None: none) replaced by a token the target does not pick."""

    def __init__(self, model, gamma: int, wrong: int | None = None) -> None:
        self.model, self.gamma, self.wrong = model, gamma, wrong
        self.tokens: dict = {}

    def append_context(self, request_id, features, positions, token_ids=None) -> None:
        seq = self.tokens.setdefault(request_id, {})
        for p, t in zip(positions.tolist(), token_ids.tolist()):
            seq[p] = t

    def release(self, request_id) -> None:
        self.tokens.pop(request_id, None)

    @torch.no_grad()
    def draft(self, requests, sparse_top_k=None, num_positions=None):
        assert num_positions in (None, self.gamma)  # fixed:gamma drafts whole blocks
        blocks = []
        for r in requests:
            seq = self.tokens[r.request_id]
            ids = [seq[p] for p in range(r.anchor_position)] + [r.anchor_token]
            out = []
            for _ in range(self.gamma):
                nxt = int(self.model(torch.tensor([ids + out])).logits[0, -1].argmax())
                out.append(nxt)
            if self.wrong is not None:
                out[self.wrong - 1] = (out[self.wrong - 1] + 1) % VOCAB
            tokens = torch.tensor(out)
            probs = torch.nn.functional.one_hot(tokens, VOCAB).float()  # [gamma, vocab_size]
            blocks.append(DraftBlock(tokens, probs, torch.linspace(0.9, 0.6, self.gamma)))
        return blocks


@pytest.mark.parametrize("wrong", [None, 3])
def test_oracle_drafter_acceptance(tiny_target, wrong):
    folder, model = tiny_target
    runner = make_runner(folder)
    cfg = CollectConfig(verify_len=GAMMA, temperature=0.0, max_tokens=20, max_running=3)
    out = collect_records(TargetVerifier(runner), OracleDrafter(model, GAMMA, wrong), PROMPTS, cfg)
    s = summarize(out.records)
    assert s.rounds > len(PROMPTS)
    if wrong is None:  # every draft is the target's argmax: all accepted
        assert s.tau == GAMMA + 1
        assert s.accept_per_position == [1.0] * GAMMA
    else:  # drafts 1..wrong-1 right, draft `wrong` never accepted, later ones never reached
        assert s.tau == wrong
        assert s.accept_per_position[:wrong] == [1.0] * (wrong - 1) + [0.0]
        assert all(np.isnan(a) for a in s.accept_per_position[wrong:])
    np.testing.assert_allclose(out.records.confidences[0], np.linspace(0.9, 0.6, GAMMA), rtol=1e-6)
    # the drafts change nothing in greedy output: plain greedy decoding of the same target
    for prompt, got in zip(PROMPTS, out.output_ids):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert got == ref


def test_collected_rows_add_up_to_the_engine_metrics(tiny_target):
    folder, _ = tiny_target
    runner = make_runner(folder)
    drafter = tiny_dspark(0, runner, noisy_confidence=True)
    engine = Engine(TargetVerifier(runner), drafter, CostTable.from_step_seconds({1: 1.0}),
                    EngineConfig(AdmissionConfig(policy=f"fixed:{GAMMA}"),
                                 batching=BatchingConfig(max_running=4), update_cost_table=False))
    collector = RoundCollector()
    done = [engine.request(engine.add_request(p, SamplingParams(temperature=1.0, seed=7), 16))
            for p in PROMPTS]
    for result in engine.steps():
        collector.add(result)
    records = collector.records(GAMMA, GAMMA)
    assert records.num_rounds == sum(r.metrics.rounds for r in done)
    assert int(records.accepted.sum()) == sum(r.metrics.drafts_accepted for r in done)
    assert int(records.admitted.sum()) == sum(r.metrics.drafts_verified for r in done)
    for r in done:  # per request, too
        mine = np.array(records.request_ids) == r.request_id
        assert int(records.accepted[mine].sum()) == r.metrics.drafts_accepted
        # per-position accepted counts from the rows equal the engine's counters
        got = [(records.accepted[mine] >= k).sum() for k in range(1, GAMMA + 1)]
        assert got == r.metrics.accepted_per_position
    assert records.confidences.shape == (records.num_rounds, GAMMA)
    assert np.all((records.confidences > 0) & (records.confidences < 1))
    # raw confidences: exactly what the drafter computes with temperature 1
    assert torch.equal(drafter.confidence_temperatures, torch.ones(1, GAMMA))
    assert torch.equal(drafter.confidence_biases, torch.zeros(1, GAMMA))
    # a full-block run with every round full except those cut by max_tokens
    assert set(records.admitted.tolist()) <= set(range(GAMMA + 1))
    assert (records.admitted == GAMMA).sum() > 0
