"""Whether a round drafts at all (async_topk, docs/design.md section 6).

With `async_topk` a round's K (its capacity: drafts it may verify) was decided two rounds
earlier, so before drafting the engine knows whether any draft can be verified. The gate turns
that, the round counts and the engine's load into the round's mode:

- **draft**: the drafter drafts every running request and the admission decides l_r;
- **probe**: K is known to be 0, but a probe is due, so the drafter drafts anyway, so that fresh
  confidences can raise K again; when the batch is larger than `probe_requests`, only a sample
  of it (`RoundMode.PROBE_SAMPLE`), which verifies nothing; otherwise the whole batch (`DRAFT`);
- **skip**: K is known to be 0 and no probe is due: the round drafts nothing;
- **plain check**: K may be > 0, but after a long run of verifying rounds with close decisions
  the round drafts nothing, so that the cost table measures a round without drafts.

A *fruitless* round is a drafting round that found nothing to verify (its K was 0); each one
doubles the gap to the next probe (the back-off). The *load* is the number of requests in the
engine: waiting, reading their prompts or running. A *steady* round drafts the same requests as
the round before it, so its drafting time is a sample of what drafting a round costs.

Every rule decides from round counts, old decisions and which requests run, never from this
round's drafts or tokens, so the output stays exact.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True)
class DraftingGateConfig:
    """The gate's rules: probes, their back-off and plain checks (`EngineConfig.gate`)."""

    probe_interval: int = 8
    """A round whose K (decided two rounds earlier) is 0 verifies no drafts, so it skips
    drafting; but at least every `probe_interval` rounds the drafter drafts anyway, so that
    fresh confidences can raise K again. 0 = always draft. When drafter and verifier share one
    device, drafting costs the round time; this keeps a weak drafter from slowing decoding."""
    max_probe_interval: int = 64
    """A probe that again leads to K = 0 doubles the interval, up to this many rounds; a round
    that verifies drafts, or at most half as many requests in the engine as at any such probe
    since (a much lighter load, down to an empty engine), brings it back to `probe_interval`;
    a request joining, or one finishing before the next arrives, does not. Under load that no
    draft can pay for, probes then cost a few tenths of a percent instead of a few percent (a
    probe drafts for every running request). = probe_interval: no backoff."""
    probe_requests: int = 4
    """A probe (a drafting round whose K is known to be 0, so it verifies nothing) drafts at most
    this many of the running requests (never chosen by their tokens): those the last probe drafted
    that still run, then the newest joiners; the admission fills in the others with its running
    means. Under a load where no draft pays, a probe then costs the drafting of a few requests,
    not of the whole batch, and each probe's requests bring little context the drafter has not
    seen (the same requests since the last probe, or a prompt just read); the context of requests
    that are never drafted is never projected (or, with a remote drafter, never sent). 0 = every
    probe drafts every request."""
    plain_check_interval: int = 16
    """After this many rounds in a row that verified drafts, one round drafts nothing (a plain
    check), when the decision was close (below `plain_check_gain`) and no prompt chunk rides in
    the round, so that the cost table measures the round without drafts now. While every round
    drafts, nothing else measures the option not taken, and the cost table extrapolates it
    (bf16: 126-141 ms estimated at 16 requests where such rounds took about 120). Decided by
    round counts and old decisions only, so the output stays exact. 0 = never."""
    plain_check_gain: float = 1.3
    """A plain check only while the planned K's expected gain over no drafts is below this:
    at one user, where drafts clearly pay, no round gives them up."""

    def __post_init__(self) -> None:
        if self.probe_interval < 0:
            raise ValueError("probe_interval must be >= 0")
        if self.plain_check_interval < 0:
            raise ValueError(f"plain_check_interval must be >= 0, got {self.plain_check_interval}")
        if self.probe_requests < 0:
            raise ValueError(f"probe_requests must be >= 0, got {self.probe_requests}")
        if self.max_probe_interval < self.probe_interval:
            raise ValueError(f"max_probe_interval ({self.max_probe_interval}) must be >= "
                             f"probe_interval ({self.probe_interval})")


class RoundMode(enum.Enum):
    """What a round does before verification."""

    DRAFT = "draft"
    """Draft every running request and admit from the blocks (also a probe of the whole batch)."""
    PROBE_SAMPLE = "probe_sample"
    """K is known to be 0: draft only `RoundPlan.probe_sample`; nothing is verified."""
    SKIP = "skip"
    """K is known to be 0 and no probe is due: draft nothing."""
    PLAIN_CHECK = "plain_check"
    """K may be > 0, but draft nothing, so that the cost table measures such a round."""
    TARGET_ONLY = "target_only"
    """No drafter (or policy `none`): an ordinary decoding step. The engine's, never the gate's."""

    @property
    def drafts(self) -> bool:
        """Whether the drafter drafts in this round (the whole batch or a probe's sample)."""
        return self in (RoundMode.DRAFT, RoundMode.PROBE_SAMPLE)


@dataclass(frozen=True)
class RoundPlan:
    mode: RoundMode
    probe_sample: list[int] | None = None
    """PROBE_SAMPLE only: indices into the running batch, ascending, of the requests drafted."""


class DraftingGate:
    """The state machine that decides each round's mode; the engine hands it the facts."""

    def __init__(self, config: DraftingGateConfig = DraftingGateConfig()) -> None:
        self.config = config
        self.probe_interval = config.probe_interval
        """Rounds between probes now: probe_interval, doubled after each fruitless probe."""
        self.fruitless_load: int | None = None
        """The lightest load of a drafting round that found nothing to verify since the probe
        interval was last reset (None: none since)."""
        self.probe_members: set = set()
        """The requests the last sampled probe drafted (the next probe keeps those that run)."""
        self.rounds_without_draft = 0
        """Rounds in a row that skipped drafting (for the probe interval)."""
        self.rounds_verifying = 0
        """Rounds in a row whose K was > 0 (for the plain checks)."""
        self.last_drafted_ids: list | None = None
        """The requests the previous round drafted (all of them), or None (for `steady`)."""

    # -- deciding ----------------------------------------------------------------------------
    def plan_round(self, running_ids: Sequence[Hashable], capacity_known_zero: bool,
                   planned_gain: float | None, reads_prompt: bool) -> RoundPlan:
        """The round's mode, from the admission's planned (old) decision (`capacity_known_zero`:
        K is 0; `planned_gain`: its expected gain over no drafts, None if unknown), whether a
        prompt chunk rides in the round, and which requests run (in join order). Records the
        round as started: a skip or a plain check is done when planned; a drafting round is
        finished by `record_draft` and, with a decision, `record_capacity`."""
        if self.skip_drafting(capacity_known_zero):
            self.rounds_without_draft += 1
            self.rounds_verifying = 0
            self.last_drafted_ids = None
            return RoundPlan(RoundMode.SKIP)
        if not reads_prompt and self.plain_check_due(planned_gain):
            self.rounds_verifying = 0
            self.last_drafted_ids = None
            return RoundPlan(RoundMode.PLAIN_CHECK)
        self.rounds_without_draft = 0
        sample = self.probe_sample(running_ids, capacity_known_zero)
        if sample is None:
            return RoundPlan(RoundMode.DRAFT)
        return RoundPlan(RoundMode.PROBE_SAMPLE, sample)

    def skip_drafting(self, capacity_known_zero: bool) -> bool:
        """Whether this round's K is known to be 0 and no probe is due."""
        interval = self.probe_interval
        return interval > 0 and self.rounds_without_draft < interval - 1 and capacity_known_zero

    def plain_check_due(self, planned_gain: float | None) -> bool:
        """Whether this round, which would draft, gives it up to measure a round without drafts
        (DraftingGateConfig.plain_check_interval): only round counts and the planned (old) decision's
        gain decide, never this round's drafts."""
        interval = self.config.plain_check_interval
        return (interval > 0 and self.rounds_verifying >= interval and planned_gain is not None
                and planned_gain < self.config.plain_check_gain)

    def probe_sample(self, running_ids: Sequence[Hashable],
                     capacity_known_zero: bool) -> list[int] | None:
        """Indices into the running batch for a probe that drafts only some of it: the requests
        the last probe drafted that still run, then the newest joiners, up to `probe_requests`
        (so each probe's requests bring little context the drafter has not absorbed). None when
        this round is not a probe (K not known to be 0) or the whole batch fits the sample.
        Depends on which requests run and their join order only, never on their tokens."""
        limit = self.config.probe_requests
        if limit == 0 or len(running_ids) <= limit or not capacity_known_zero:
            return None
        kept = [i for i, rid in enumerate(running_ids) if rid in self.probe_members]
        newest = [i for i in reversed(range(len(running_ids))) if i not in kept]
        sample = sorted((kept + newest)[:limit])
        self.probe_members = {running_ids[i] for i in sample}
        return sample

    # -- recording ---------------------------------------------------------------------------
    def record_draft(self, drafted_ids: list | None) -> bool:
        """After a drafting round drafted (`drafted_ids`: every running request's id, or None for
        a sampled probe): whether the round was steady. Only a steady round's drafting is a
        sample of what drafting costs a round: the drafter absorbs context lazily (at the next
        draft), so the first draft after skipped rounds, a probe's sample or a join also pays
        for the context of the rounds before; charging that to every draft would make a skip
        look like it pays for itself. (A probe's sample would also understate drafting the
        whole batch.)"""
        steady = drafted_ids is not None and drafted_ids == self.last_drafted_ids
        self.last_drafted_ids = drafted_ids
        return steady

    def record_capacity(self, capacity_used: int, load: int) -> None:
        """After a drafting round's admission decided with K = `capacity_used`, at `load`
        requests in the engine: the back-off, and the count of verifying rounds in a row."""
        self.back_off_probes(capacity_used, load)
        self.rounds_verifying = self.rounds_verifying + 1 if capacity_used > 0 else 0

    def back_off_probes(self, capacity_used: int, load: int) -> None:
        """After a drafting round: a probe (K was 0, so it verified nothing) doubles the probe
        interval, up to max_probe_interval, and remembers the load it found that at; a round
        that could verify drafts resets it. Only past rounds' K decide, never this round's
        drafts."""
        base = self.config.probe_interval
        if capacity_used > 0 or base == 0:
            self.probe_interval, self.fruitless_load = base, None
        else:
            self.probe_interval = min(2 * self.probe_interval, self.config.max_probe_interval)
            self.fruitless_load = min(load, self.fruitless_load or load)

    def reset_if_load_fell(self, load: int) -> None:
        """At most half the load of any fruitless probe since the last reset, where drafts may
        pay again: probe soon (the interval goes back to probe_interval). The load counts every
        request in the engine, so a request that finishes while the next one waits or reads
        its prompt leaves it as it was, and a join only makes it heavier; K that was 0 at a load
        as a rule stays 0 at a heavier one (a verified token costs more the fuller the batch,
        and drafting costs more with more requests). Half, not any fall: under steady load a
        round often starts between one user's last token and its next request (16 -> 15 in the
        engine), and resetting there kept the probes 12-28 rounds apart at 16 users. A smaller
        fall needs no probe to raise K: a skipped round hands on the K of the running means at
        its own request count (AsyncTopKAdmission.skip)."""
        if self.fruitless_load is not None and 2 * load <= self.fruitless_load:
            self.probe_interval, self.fruitless_load = self.config.probe_interval, None

    def reset_if_idle(self, load: int) -> None:
        """An engine left with no request has the lightest load there is: the next request
        starts with the probe interval at probe_interval, as on a fresh engine. (A round never
        sees this load, so `reset_if_load_fell` at the round's start cannot.)"""
        if not load:
            self.reset_if_load_fell(load)

    def forget(self, request_id: Hashable) -> None:
        """A request left the engine: the next probe's sample no longer keeps it."""
        self.probe_members.discard(request_id)

    @property
    def found_nothing_to_verify(self) -> bool:
        """Whether a drafting round found nothing to verify since the probe interval was last
        reset (the engine then holds the features of requests a round does not draft)."""
        return self.fruitless_load is not None
