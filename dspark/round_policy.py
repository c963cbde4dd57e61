"""The admission policy as a round sees it: one object per `PolicyKind` (docs/design.md section 6).

Each round the engine asks its policy:
1. `plan(running_ids, gamma, reads_prompt, load) -> RoundPlan`: what the round does before
   verification (draft the batch, a probe's sample, skip drafting, a plain check, or decode with
   the target alone);
2. after drafting, `positions_to_draft(gamma)` before and `admit(...) -> l_r` after: how many
   drafts of each request the target verifies;
3. `observe_draft(...)`: the round drafted (whether its drafting time is a sample of what a
   round's drafting costs), and `holds(...)`: whether requests the round did not draft leave
   their features with the verifier.
`forget` (a request left) and `reset_if_idle` (the engine emptied) keep the policy's state.

- `TargetOnlyPolicy` (`none`, or no drafter): every round is an ordinary decoding step.
- `BlockPolicy` (`fixed:N`, `threshold:H`, `sync_greedy`): every round drafts every running
  request and admits from that round's own block.
- `AsyncTopKPolicy` (`async_topk`): K comes from rounds `lag` before (its running means of the
  confidences live in `AsyncTopKAdmission`), so before drafting it knows whether any draft can
  be verified; it owns the drafting gate (probes, skips, plain checks, dspark/drafting_gate.py),
  records the rounds that verify no drafts with its admission, and decides when the verifier
  holds features (dspark/held_features.py).
Every decision before verification uses old rounds, the load and which requests run, never the
round's own drafts, so the output stays exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Sequence

import numpy as np

from dspark.admission import (AdmissionConfig, AdmissionPolicy, Admitter, AsyncTopKAdmission,
                              PolicyKind)
from dspark.cost_table import CostTable
from dspark.drafting_gate import DraftingGate, DraftingGateConfig, RoundMode, RoundPlan


class RoundPolicy:
    """The interface; by itself, a policy that drafts every round (see BlockPolicy)."""

    def __init__(self, admission: AdmissionConfig, cost_table: CostTable | None) -> None:
        self.admitter = Admitter(admission, cost_table)
        self._last_drafted: list | None = None
        """The requests the previous round drafted (all of them), or None (for `steady`)."""

    @property
    def speculative(self) -> bool:
        return True

    @property
    def capacity_used(self) -> int | None:
        """The K the last planned or drafted round used (async_topk; None for the others)."""
        return self.admitter.capacity_used

    def plan(self, running_ids: Sequence[Hashable], gamma: int, reads_prompt: bool,
             load: int) -> RoundPlan:
        return RoundPlan(RoundMode.DRAFT)

    def positions_to_draft(self, gamma: int) -> int:
        return self.admitter.positions_to_draft(gamma)

    def admit(self, confidences: Any, caps: np.ndarray, gamma: int, num_running: int,
              sample: list[int] | None) -> np.ndarray:
        """l_r [num_running] int64 from the drafted blocks' confidences [S, positions] (S =
        num_running, or a probe's sample, which verifies nothing); caps [num_running]: drafts
        each request may still emit."""
        assert sample is None, "only async_topk probes a sample"
        return self.admitter.admit(confidences, max_lengths=caps, block_size=gamma)

    def observe_draft(self, drafted_ids: list | None, load: int) -> bool:
        """After a drafting round drafted (`drafted_ids`: every running request's id, or None
        for a sampled probe): whether it drafted the same requests as the round before, so that
        its drafting time is a sample of what drafting a round costs (DraftingGate.record_draft)."""
        steady = drafted_ids is not None and drafted_ids == self._last_drafted
        self._last_drafted = drafted_ids
        return steady

    def holds(self, mode: RoundMode, num_drafted: int, num_running: int) -> bool:
        """Whether the round leaves the features of requests it does not draft with the
        verifier (only async_topk's rounds leave requests undrafted)."""
        return False

    def forget(self, request_id: Hashable) -> None:
        """The request left the engine."""

    def reset_if_idle(self, load: int) -> None:
        """Called whenever a request leaves, with the requests left in the engine."""


class TargetOnlyPolicy(RoundPolicy):
    """`none`, or an engine without a drafter: every round decodes with the target alone."""

    def __init__(self, admission: AdmissionConfig, cost_table: CostTable | None) -> None:
        super().__init__(dataclasses.replace(admission, policy=AdmissionPolicy(PolicyKind.NONE)),
                         cost_table)

    @property
    def speculative(self) -> bool:
        return False

    def plan(self, running_ids: Sequence[Hashable], gamma: int, reads_prompt: bool,
             load: int) -> RoundPlan:
        return RoundPlan(RoundMode.TARGET_ONLY)


class BlockPolicy(RoundPolicy):
    """`fixed:N`, `threshold:H`, `sync_greedy`: each round drafts every running request and
    admits from its own block (dspark.admission's functions)."""


class AsyncTopKPolicy(RoundPolicy):
    """`async_topk`: its admission (K from `lag` rounds before, running means), its drafting
    gate and its decision to hold features."""

    def __init__(self, admission: AdmissionConfig, gate: DraftingGateConfig,
                 cost_table: CostTable, hold_features: bool) -> None:
        super().__init__(admission, cost_table)
        self.gate = DraftingGate(gate)
        """Decides whether each round drafts (probes, skips, plain checks)."""
        self.hold_features = hold_features
        """EngineConfig.hold_features."""

    @property
    def admission(self) -> AsyncTopKAdmission:
        """The lagged admission's state (K per step, the running means)."""
        return self.admitter.async_topk

    def capacity_known_zero(self) -> bool:
        """Whether the next round's K, decided ``lag`` rounds ago, is 0: such a round verifies
        no drafts whatever the drafter returns, so it may skip drafting or draft only a probe's
        sample. (The decision uses only old information: never the values of its drafts.)"""
        return self.admission.planned_capacity() == 0

    def plan(self, running_ids: Sequence[Hashable], gamma: int, reads_prompt: bool,
             load: int) -> RoundPlan:
        """The gate decides from the admission's old decision, the load and which requests run;
        a round that drafts nothing verifies no drafts, and the K of the round ``lag`` later
        comes from the running means (AsyncTopKAdmission.skip). The gate skips only rounds
        whose K is known to be 0; a plain check may skip one whose K is > 0."""
        self.gate.reset_if_load_fell(load)
        plan = self.gate.plan_round(running_ids, self.capacity_known_zero(),
                                    self.admission.planned_gain(), reads_prompt)
        if plan.mode in (RoundMode.PLAIN_CHECK, RoundMode.SKIP):
            self.admission.skip(self.admission.next_step, len(running_ids), gamma)
        return plan

    def admit(self, confidences: Any, caps: np.ndarray, gamma: int, num_running: int,
              sample: list[int] | None) -> np.ndarray:
        if sample is None:
            return self.admitter.admit(confidences, max_lengths=caps, block_size=gamma)
        # a sampled probe: its K is 0 (the gate probes only then), nothing is verified, the
        # sample's confidences only inform the K of a later round
        self.admission.probe(confidences, self.admission.next_step, num_running, gamma)
        return np.zeros(num_running, dtype=np.int64)

    def observe_draft(self, drafted_ids: list | None, load: int) -> bool:
        steady = self.gate.record_draft(drafted_ids)
        if self.admitter.capacity_used is not None:
            self.gate.record_capacity(self.admitter.capacity_used, load)
        return steady

    def holds(self, mode: RoundMode, num_drafted: int, num_running: int) -> bool:
        """Once a probe found nothing to verify (and no round has verified drafts since), a
        round that skips drafting, or a probe. While drafts are verified, rounds without drafts
        come between drafting rounds that draft the whole batch, and holding would only add a
        call to take the features back; a plain check is such a round."""
        return (self.hold_features and mode is not RoundMode.PLAIN_CHECK
                and self.gate.found_nothing_to_verify and num_drafted < num_running)

    def forget(self, request_id: Hashable) -> None:
        self.gate.forget(request_id)

    def reset_if_idle(self, load: int) -> None:
        self.gate.reset_if_idle(load)


def make_round_policy(admission: AdmissionConfig, gate: DraftingGateConfig,
                      cost_table: CostTable | None, hold_features: bool,
                      has_drafter: bool) -> RoundPolicy:
    """The policy object of `admission.policy` (target only without a drafter)."""
    kind = admission.policy.kind
    if kind is PolicyKind.NONE or not has_drafter:
        return TargetOnlyPolicy(admission, cost_table)
    if kind is PolicyKind.ASYNC_TOPK:
        return AsyncTopKPolicy(admission, gate, cost_table, hold_features)
    return BlockPolicy(admission, cost_table)
