"""The drafting gate alone: its rules against hand-worked round sequences (no models)."""

from __future__ import annotations

import pytest

from dspark.drafting_gate import DraftingGate, DraftingGateConfig, RoundMode

DRAFT, SKIP, PLAIN_CHECK, PROBE_SAMPLE = (RoundMode.DRAFT, RoundMode.SKIP, RoundMode.PLAIN_CHECK,
                                          RoundMode.PROBE_SAMPLE)


def run_fruitless_rounds(gate: DraftingGate, rounds: int, load: int = 1,
                         warm_up: int = 2) -> list[int]:
    """Rounds (1-based) that draft when no draft ever pays: K is unknown in the first `warm_up`
    rounds (they draft and decide K = 0), and known to be 0 after them."""
    drafted = []
    for t in range(1, rounds + 1):
        gate.reset_if_load_fell(load)
        plan = gate.plan_round(["a"], capacity_known_zero=t > warm_up, planned_gain=1.0,
                               reads_prompt=False)
        if plan.mode is DRAFT:
            gate.record_draft(["a"])
            gate.record_capacity(0, load)
            drafted.append(t)
        else:
            assert plan.mode is SKIP
    return drafted


def test_fruitless_probes_double_the_interval_up_to_the_max():
    # warm-up rounds 1, 2 double it 2 -> 4 -> 8; the probes then come every 8th round
    gate = DraftingGate(DraftingGateConfig(probe_interval=2, max_probe_interval=8))
    assert run_fruitless_rounds(gate, 34) == [1, 2, 10, 18, 26, 34]
    assert gate.probe_interval == 8 and gate.fruitless_load == 1
    # without the warm-up: a skip, then probes at gaps 2, 4, 8, 8
    gate = DraftingGate(DraftingGateConfig(probe_interval=2, max_probe_interval=8))
    assert run_fruitless_rounds(gate, 22, warm_up=0) == [2, 6, 14, 22]


def test_no_backoff_when_the_max_is_the_interval_and_no_skips_at_interval_0():
    gate = DraftingGate(DraftingGateConfig(probe_interval=4, max_probe_interval=4))
    assert run_fruitless_rounds(gate, 14) == [1, 2, 6, 10, 14]
    gate = DraftingGate(DraftingGateConfig(probe_interval=0, max_probe_interval=0))
    assert run_fruitless_rounds(gate, 5) == [1, 2, 3, 4, 5]
    assert gate.probe_interval == 0 and gate.fruitless_load is None


def test_a_verifying_round_resets_the_interval():
    gate = DraftingGate(DraftingGateConfig(probe_interval=2, max_probe_interval=8))
    run_fruitless_rounds(gate, 2)
    assert gate.probe_interval == 8 and gate.found_nothing_to_verify
    gate.record_capacity(3, load=1)
    assert gate.probe_interval == 2 and not gate.found_nothing_to_verify


def test_the_interval_resets_only_at_half_the_lightest_fruitless_load():
    gate = DraftingGate(DraftingGateConfig(probe_interval=2, max_probe_interval=8))
    gate.record_capacity(0, load=4)
    gate.record_capacity(0, load=3)  # the lightest fruitless load is now 3
    assert (gate.probe_interval, gate.fruitless_load) == (8, 3)
    gate.reset_if_load_fell(3)
    gate.reset_if_load_fell(2)  # 2 * 2 > 3: a small dip, no reset
    assert (gate.probe_interval, gate.fruitless_load) == (8, 3)
    gate.reset_if_load_fell(1)
    assert (gate.probe_interval, gate.fruitless_load) == (2, None)
    # at load 4, half is 2 exactly: that resets
    gate.record_capacity(0, load=4)
    gate.reset_if_load_fell(2)
    assert (gate.probe_interval, gate.fruitless_load) == (2, None)


def test_an_empty_engine_resets_the_interval():
    gate = DraftingGate(DraftingGateConfig(probe_interval=2, max_probe_interval=8))
    gate.record_capacity(0, load=1)
    gate.reset_if_idle(1)
    assert gate.probe_interval == 4
    gate.reset_if_idle(0)
    assert (gate.probe_interval, gate.fruitless_load) == (2, None)


def run_verifying_rounds(gate: DraftingGate, rounds: int, planned_gain: float | None,
                         prompt_rounds: tuple[int, ...] = ()) -> list[RoundMode]:
    """Modes of rounds whose K is always > 0 (2): every drafting round verifies drafts."""
    modes = []
    for t in range(1, rounds + 1):
        plan = gate.plan_round(["a"], capacity_known_zero=False, planned_gain=planned_gain,
                               reads_prompt=t in prompt_rounds)
        if plan.mode is DRAFT:
            gate.record_draft(["a"])
            gate.record_capacity(2, load=1)
        modes.append(plan.mode)
    return modes


def test_a_plain_check_follows_n_verifying_rounds_when_the_gain_is_close():
    config = DraftingGateConfig(plain_check_interval=3, plain_check_gain=1.3)
    assert run_verifying_rounds(DraftingGate(config), 8, planned_gain=1.1) == [
        DRAFT, DRAFT, DRAFT, PLAIN_CHECK, DRAFT, DRAFT, DRAFT, PLAIN_CHECK]
    # a clear gain, or none known: never
    assert run_verifying_rounds(DraftingGate(config), 8, planned_gain=1.3) == [DRAFT] * 8
    assert run_verifying_rounds(DraftingGate(config), 8, planned_gain=None) == [DRAFT] * 8
    # a prompt chunk in the round puts the check off to the next round without one
    assert run_verifying_rounds(DraftingGate(config), 6, planned_gain=1.1,
                                prompt_rounds=(4,)) == [DRAFT] * 4 + [PLAIN_CHECK, DRAFT]
    # interval 0: never
    config = DraftingGateConfig(plain_check_interval=0)
    assert run_verifying_rounds(DraftingGate(config), 40, planned_gain=1.0) == [DRAFT] * 40


def test_a_fruitless_round_restarts_the_count_of_verifying_rounds():
    gate = DraftingGate(DraftingGateConfig(plain_check_interval=2, plain_check_gain=1.3))
    gate.record_capacity(2, load=1)
    gate.record_capacity(0, load=1)
    gate.record_capacity(2, load=1)
    assert gate.rounds_verifying == 1
    assert not gate.plain_check_due(1.0)
    gate.record_capacity(2, load=1)
    assert gate.plain_check_due(1.0)


def test_a_probe_keeps_its_sample_and_fills_it_with_the_newest():
    gate = DraftingGate(DraftingGateConfig(probe_requests=2))
    plan = gate.plan_round(list("abcdef"), capacity_known_zero=True, planned_gain=1.0,
                           reads_prompt=False)  # rounds_without_draft starts at 0: a skip
    assert plan.mode is SKIP
    gate = DraftingGate(DraftingGateConfig(probe_interval=0, max_probe_interval=0,
                                           probe_requests=2))
    plan = gate.plan_round(list("abcdef"), True, 1.0, False)
    assert (plan.mode, plan.probe_sample) == (PROBE_SAMPLE, [4, 5])
    assert gate.probe_members == {"e", "f"}
    # "f" finished and "g" joined: "e" stays, the newest ("g") fills in
    plan = gate.plan_round(list("abcdeg"), True, 1.0, False)
    assert plan.probe_sample == [4, 5] and gate.probe_members == {"e", "g"}
    gate.forget("e")  # "e" finished
    plan = gate.plan_round(list("abcdg"), True, 1.0, False)
    assert plan.probe_sample == [3, 4] and gate.probe_members == {"d", "g"}
    # a batch the sample covers, or K not known to be 0: every request is drafted
    assert gate.plan_round(list("ab"), True, 1.0, False).mode is DRAFT
    assert gate.plan_round(list("abcdg"), False, 1.0, False).mode is DRAFT
    assert gate.probe_members == {"d", "g"}


def test_a_round_is_steady_when_it_drafts_what_the_round_before_drafted():
    gate = DraftingGate()
    assert [gate.record_draft(ids) for ids in (["a", "b"], ["a", "b"], None, ["a", "b"],
                                               ["a", "b"], ["a", "b", "c"])] == [
        False, True, False, False, True, False]
    # a round that drafts nothing breaks the run too
    gate = DraftingGate(DraftingGateConfig(plain_check_interval=1, plain_check_gain=1.3))
    gate.record_draft(["a"])
    gate.record_capacity(1, load=1)
    assert gate.plan_round(["a"], False, 1.0, False).mode is PLAIN_CHECK
    assert not gate.record_draft(["a"])


def test_config_rejects_a_cap_below_the_interval_and_negative_counts():
    with pytest.raises(ValueError, match="max_probe_interval"):
        DraftingGateConfig(probe_interval=8, max_probe_interval=4)
    for field in ("probe_interval", "plain_check_interval", "probe_requests"):
        with pytest.raises(ValueError, match=field):
            DraftingGateConfig(**{field: -1})
