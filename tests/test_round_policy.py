"""One policy object per PolicyKind: which class each policy gets, what its rounds do before
verification, and that only async_topk skips drafting, probes a sample or holds features."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.admission import AdmissionConfig, PolicyKind
from dspark.cost_table import CostTable
from dspark.drafting_gate import DraftingGateConfig, RoundMode
from dspark.round_policy import (AsyncTopKPolicy, BlockPolicy, TargetOnlyPolicy,
                                 make_round_policy)

# Every extra verified token doubles the step time: no draft pays, so async_topk's K is 0.
STEEP = CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)})


def policy(text: str, has_drafter: bool = True, **gate):
    return make_round_policy(AdmissionConfig(policy=text), DraftingGateConfig(**gate), STEEP,
                             hold_features=True, has_drafter=has_drafter)


@pytest.mark.parametrize("text, kind", [("none", TargetOnlyPolicy), ("fixed:2", BlockPolicy),
                                        ("threshold:0.5", BlockPolicy),
                                        ("sync_greedy", BlockPolicy),
                                        ("async_topk", AsyncTopKPolicy)])
def test_each_policy_kind_has_its_object(text, kind):
    assert type(policy(text)) is kind
    assert type(policy(text, has_drafter=False)) is TargetOnlyPolicy
    assert not policy(text, has_drafter=False).speculative


def test_block_policies_draft_and_admit_every_round():
    p = policy("fixed:2")
    c = np.full((3, 4), 0.9)
    for _ in range(5):
        assert p.plan(["a", "b", "c"], 4, reads_prompt=False, load=3).mode is RoundMode.DRAFT
        assert p.admit(c, np.array([4, 1, 0]), 4, 3, None).tolist() == [2, 1, 0]
        assert not p.holds(RoundMode.DRAFT, 3, 3) and p.capacity_used is None
    assert p.observe_draft(["a", "b"], 2) is False  # a new batch: its drafting is no sample
    assert p.observe_draft(["a", "b"], 2) is True


def test_async_topk_skips_probes_a_sample_and_then_holds_features():
    """With K known to be 0 after the warm-up, rounds skip drafting, a probe drafts a sample of
    probe_requests, and once a probe found nothing to verify the skipped rounds hold features."""
    p = policy("async_topk", probe_interval=2, max_probe_interval=2, probe_requests=1)
    ids = ["a", "b", "c"]
    modes = []
    for _ in range(8):
        plan = p.plan(ids, 4, reads_prompt=False, load=3)
        modes.append(plan.mode)
        if plan.mode.drafts:
            drafted = len(plan.probe_sample or ids)
            lengths = p.admit(np.full((drafted, 4), 0.5), np.full(3, 4), 4, 3, plan.probe_sample)
            assert lengths.tolist() == [0, 0, 0]  # K is 0: nothing verified
            p.observe_draft(None if plan.probe_sample else ids, load=3)
            assert p.capacity_used == 0
    assert modes[:2] == [RoundMode.DRAFT, RoundMode.DRAFT]  # warm-up: K from the prior
    assert RoundMode.SKIP in modes and RoundMode.PROBE_SAMPLE in modes
    assert p.holds(RoundMode.SKIP, 0, 3) and not p.holds(RoundMode.PLAIN_CHECK, 0, 3)
    assert p.gate.found_nothing_to_verify
    assert p.admitter.config.policy.kind is PolicyKind.ASYNC_TOPK
    assert p.admission.next_step == 8  # every round recorded: admitted, probed or skipped
    assert p.capacity_known_zero()
