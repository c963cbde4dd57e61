"""Acceptance figures of a drafter against its target (docs/design.md section 9).

Generation runs through the embedded engine with a fixed verification length (no scheduler:
the paper's offline evaluation, section 4.2), and an observer on the engine records every round.

Glossary
- round record: one verification round of one request: the drafted block's raw confidences
  c_1..c_gamma (as the drafter returned them, before any STS), the admitted length l_r (drafts
  the target verified) and the accepted count n in 0..l_r.
- verification length: gamma for a full block (`fixed:gamma`), 1 for the MTP-1-like baseline.
- full round: l_r equals the verification length. The engine cuts l_r short when a request is
  about to reach max_tokens; such rounds are left out of every figure. Whether a round is cut
  depends only on how many tokens were produced before it, never on its own drafts, so leaving
  them out biases nothing.
- tau (acceptance length): tokens produced per round = n + 1 (accepted drafts plus the recovered
  or bonus token), averaged over full rounds.
- conditional acceptance at position k: among rounds that verified position k and accepted
  drafts 1..k-1, the fraction that accepted draft k (NaN when no round reached k).
  With full rounds only, tau = 1 + sum_k prod_{i<=k} (conditional acceptance at i).
- survival matrix: survived[i, k-1] = drafts 1..k of round i were all accepted (n >= k): the
  outcome STS calibrates the cumulative confidences a_k = prod_{i<=k} c_i against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np
import torch

from dspark.calibration.outcomes import survival_from_accepted_len
from dspark.calibration.report import CalibrationReport, calibration_report
from dspark.calibration.sts_map import STSCalibration
from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, EngineConfig
from dspark.loading import build_engine
from dspark.models.draft_types import DraftBlock, DraftRequest, Drafter
from dspark.sampling import SamplingParams
from dspark.step_result import RoundRecord, StepResult
from dspark.verifier import TargetVerifier


@dataclass
class AcceptanceRecords:
    """Round records of one evaluation run, one row per (request, round)."""

    request_ids: list[Hashable]
    """[num_rounds] the request of each row."""
    confidences: np.ndarray
    """[num_rounds, gamma] float64 raw c_k (NaN when the drafter has no confidence head)."""
    admitted: np.ndarray
    """[num_rounds] int64 l_r."""
    accepted: np.ndarray
    """[num_rounds] int64 accepted drafts, 0..l_r."""
    verify_len: int
    """The run's verification length (gamma for a full block, 1 for MTP-1-like)."""

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        confidences = np.asarray(self.confidences, dtype=np.float64)
        # [n, gamma]; a selection of no rows keeps its gamma, which reshape(0, -1) cannot infer
        self.confidences = confidences.reshape(n, confidences.shape[-1] if confidences.ndim == 2 else -1)
        self.admitted = np.asarray(self.admitted, dtype=np.int64).reshape(n)
        self.accepted = np.asarray(self.accepted, dtype=np.int64).reshape(n)
        if np.any(self.accepted > self.admitted) or np.any(self.accepted < 0):
            raise ValueError("accepted counts must lie in 0..admitted")
        if np.any(self.admitted > self.verify_len):
            raise ValueError(f"admitted lengths exceed the verification length {self.verify_len}")

    @property
    def num_rounds(self) -> int:
        return len(self.request_ids)

    @property
    def gamma(self) -> int:
        return int(self.confidences.shape[1])

    def full_rounds(self) -> "AcceptanceRecords":
        """Only the rounds that verified the whole verification length."""
        keep = self.admitted == self.verify_len  # [num_rounds]
        return AcceptanceRecords([r for r, k in zip(self.request_ids, keep) if k],
                                 self.confidences[keep], self.admitted[keep], self.accepted[keep],
                                 self.verify_len)

    def survival(self) -> np.ndarray:
        """[num_rounds, verify_len] bool prefix survival (call on full rounds)."""
        if np.any(self.admitted != self.verify_len):
            raise ValueError("survival is defined on full rounds only; call full_rounds() first")
        return survival_from_accepted_len(self.accepted, self.verify_len)


class RoundCollector:
    """Each speculative round's per-request rows, from the engine's step results (`add`)."""

    def __init__(self) -> None:
        self.request_ids: list[Hashable] = []
        self.confidences: list[np.ndarray] = []  # each [gamma]
        self.admitted: list[int] = []
        self.accepted: list[int] = []

    def add(self, result: StepResult) -> None:
        """A step's drafted requests, if it drafted (`RoundStats.drafted`)."""
        if result.stats.drafted is not None:
            self.add_record(result.stats.drafted)

    def add_record(self, record: RoundRecord) -> None:
        conf = record.confidences.detach().to("cpu", torch.float64).numpy()  # [num_requests, gamma]
        assert conf.shape[0] == len(record.request_ids), (conf.shape, len(record.request_ids))
        self.request_ids += list(record.request_ids)
        self.confidences += list(conf)
        self.admitted += [int(n) for n in record.num_admitted]
        self.accepted += [int(n) for n in record.num_accepted]

    def records(self, verify_len: int, gamma: int) -> AcceptanceRecords:
        conf = np.stack(self.confidences) if self.confidences else np.zeros((0, gamma))
        return AcceptanceRecords(list(self.request_ids), conf, self.admitted, self.accepted,
                                 verify_len)


# ------------------------------------------------------------------------------------------------
# The figures (pure functions of the records)
# ------------------------------------------------------------------------------------------------


def conditional_acceptance(admitted: np.ndarray, accepted: np.ndarray,
                           num_positions: int) -> np.ndarray:
    """Per-position conditional acceptance [num_positions] float64 (NaN where no round reached k).

    admitted, accepted: [num_rounds]. Position k is *at risk* in a round that verified it
    (admitted >= k) and accepted drafts 1..k-1 (accepted >= k - 1); it was accepted iff
    accepted >= k.
    """
    admitted = np.asarray(admitted, dtype=np.int64)
    accepted = np.asarray(accepted, dtype=np.int64)
    k = np.arange(1, num_positions + 1)  # [num_positions]
    at_risk = (admitted[:, None] >= k) & (accepted[:, None] >= k - 1)  # [num_rounds, num_positions]
    hit = at_risk & (accepted[:, None] >= k)
    num_at_risk = at_risk.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(num_at_risk > 0, hit.sum(axis=0) / num_at_risk, np.nan)


def acceptance_length(accepted: np.ndarray) -> float:
    """tau = mean(accepted + 1) over the given rounds (NaN for none)."""
    accepted = np.asarray(accepted, dtype=np.float64)
    return float(np.mean(accepted + 1.0)) if accepted.size else float("nan")


@dataclass
class AcceptanceSummary:
    """The acceptance figures of one method on one prompt set."""

    tau: float
    """Tokens per full round (accepted drafts + 1)."""
    accept_per_position: list[float]
    """[verify_len] conditional acceptance at positions 1..verify_len (NaN: never reached)."""
    rounds: int
    """Full rounds the figures average over."""
    rounds_cut: int
    """Rounds left out because max_tokens cut their verification length."""
    calibration: CalibrationReport | None = None
    """Per-position ECE (raw vs STS) and AUC, for drafters with a confidence head."""

    def to_dict(self) -> dict:
        out = {"tau": _finite_or_none(self.tau),
               "accept_per_position": [_finite_or_none(a) for a in self.accept_per_position],
               "rounds": self.rounds, "rounds_cut": self.rounds_cut}
        if self.calibration is not None:
            cal = self.calibration
            out.update(
                ece_before=[p.ece_before for p in cal.positions],
                ece_after=[p.ece_after for p in cal.positions],
                ece_floor=[p.ece_floor_after for p in cal.positions],
                auc=[_finite_or_none(p.auc_conditional) for p in cal.positions],
                auc_prefix=[_finite_or_none(p.auc_prefix_after) for p in cal.positions],
                sts_temperatures=list(cal.temperatures),
                sts_biases=list(cal.biases))
        return out


def _finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def summarize(records: AcceptanceRecords, calibration: STSCalibration | None = None,
              with_calibration: bool = False) -> AcceptanceSummary:
    """tau and conditional acceptance over the full rounds; with `with_calibration`, the ECE of
    the raw confidences and of `calibration` (identity when None: after = before) and the AUC."""
    full = records.full_rounds()
    summary = AcceptanceSummary(
        tau=acceptance_length(full.accepted),
        accept_per_position=conditional_acceptance(full.admitted, full.accepted,
                                                   records.verify_len).tolist(),
        rounds=full.num_rounds, rounds_cut=records.num_rounds - full.num_rounds)
    if with_calibration and full.num_rounds > 0:
        c_raw = full.confidences[:, :records.verify_len]  # [num_rounds, verify_len]
        if np.all(np.isfinite(c_raw)):
            sts = calibration or STSCalibration.identity(records.verify_len)
            if sts.gamma != records.verify_len:
                raise ValueError(f"calibration has gamma={sts.gamma}, the run verified "
                                 f"{records.verify_len} positions")
            summary.calibration = calibration_report(c_raw, full.survival(), sts)
    return summary


# ------------------------------------------------------------------------------------------------
# Collecting records with the engine
# ------------------------------------------------------------------------------------------------


class _FilledConfidences:
    """Wraps a drafter without a confidence head (NaN confidences): the admission rejects NaN even
    under a fixed policy, which ignores the values, so they go out as 1.0 (the records keep NaN)."""

    def __init__(self, drafter: Drafter) -> None:
        self.inner = drafter
        self.gamma = drafter.gamma

    def append_context(self, *args, **kwargs) -> None:
        self.inner.append_context(*args, **kwargs)

    def release(self, request_id: Hashable) -> None:
        self.inner.release(request_id)

    def draft(self, requests: Sequence[DraftRequest], sparse_top_k: int | None = None,
              num_positions: int | None = None) -> list[DraftBlock]:
        blocks = self.inner.draft(requests, sparse_top_k=sparse_top_k, num_positions=num_positions)
        for b in blocks:
            b.confidences = torch.nan_to_num(b.confidences, nan=1.0)
        return blocks


@dataclass(frozen=True)
class CollectConfig:
    """How an evaluation run generates."""

    verify_len: int
    """Drafts verified per round (`fixed:verify_len`); gamma for a full block."""
    temperature: float = 1.0
    """Sampling temperature of target and drafter (0 = greedy); no top-k / top-p."""
    max_tokens: int = 256
    max_running: int = 8
    """Requests generated together (one flattened target batch)."""
    seed: int = 0
    """Request i samples with seed `seed + i`: a run is reproducible."""
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.verify_len < 1 or self.max_tokens < 1 or self.max_running < 1:
            raise ValueError("verify_len, max_tokens and max_running must be >= 1")


@dataclass
class CollectResult:
    records: AcceptanceRecords
    output_ids: list[list[int]] = field(default_factory=list)
    """[num_prompts] generated tokens, in prompt order."""


def collect_records(verifier: TargetVerifier, drafter: Drafter, prompts: Sequence[Sequence[int]],
                    config: CollectConfig, has_confidences: bool = True,
                    progress=None) -> CollectResult:
    """Generate every prompt with `fixed:verify_len` verification and record every round.

    has_confidences: False for a drafter without a confidence head (DSpark/DFlash without one
    return NaN; the Eagle-style heuristic is not a head): its records hold NaN confidences.
    progress: optional callable(num_finished, num_prompts).
    """
    gamma = drafter.gamma
    if config.verify_len > gamma:
        raise ValueError(f"verify_len {config.verify_len} exceeds the drafter's gamma {gamma}")
    # The fixed policy never reads the cost table; a flat one satisfies the engine.
    table = CostTable.from_step_seconds({1: 1.0})
    engine_config = EngineConfig(AdmissionConfig(policy=f"fixed:{config.verify_len}"),
                                 batching=BatchingConfig(max_running=config.max_running),
                                 update_cost_table=False)
    engine = build_engine(verifier, drafter if has_confidences else _FilledConfidences(drafter),
                          table, engine_config)
    collector = RoundCollector()
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=config.temperature, seed=config.seed + i),
                           config.max_tokens, config.stop_token_ids, request_id=i)
    outputs: list[list[int]] = [[] for _ in prompts]
    finished = 0
    for result in engine.steps():
        collector.add(result)
        for out in result.outputs:
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                finished += 1
                if progress is not None:
                    progress(finished, len(prompts))
    records = collector.records(config.verify_len, gamma)
    if not has_confidences:
        records.confidences[:] = np.nan
    return CollectResult(records, outputs)
