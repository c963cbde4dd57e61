"""The few scheduler `/metrics` figures the sweep needs, read from Prometheus text with
prometheus_client's parser.

Mean verification length per request (the paper's Figure 8) over a load level is the number of
draft tokens sent to the target divided by the number of draft blocks verified (one block per
request per speculative round), both as differences of the counters between the level's start
and end; the acceptance length (tokens per request per round) likewise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "generation_tokens_total")


def _samples(text: str, prefix: str) -> Iterator[Sample]:
    """Every sample whose name has `prefix`, parsed by prometheus_client."""
    for family in text_string_to_metric_families(text):
        yield from (s for s in family.samples if s.name.startswith(prefix))


def counter_values(text: str, prefix: str = "dspark:") -> dict[str, float]:
    """COUNTERS' values, each summed over its label sets."""
    out = {name: 0.0 for name in COUNTERS}
    for s in _samples(text, prefix):
        name = s.name[len(prefix):]
        if name in out:
            out[name] += s.value
    return out


def stage_seconds(text: str, prefix: str = "dspark:") -> dict[str, float]:
    """`round_seconds_total` by its `stage` label (empty for a scheduler without it)."""
    out: dict[str, float] = {}
    for s in _samples(text, prefix + "round_seconds_total"):
        if "stage" in s.labels:
            out[s.labels["stage"]] = out.get(s.labels["stage"], 0.0) + s.value
    return out


def round_count(text: str, prefix: str = "dspark:") -> float:
    """Verification rounds so far (the count of the verify batch-size histogram)."""
    name = prefix + "spec_decode_verify_batch_tokens_count"
    return sum(s.value for s in _samples(text, name) if s.name == name)


@dataclass(frozen=True)
class SpeculationDelta:
    drafts: float
    draft_tokens: float
    accepted_tokens: float
    generated_tokens: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Engine seconds by stage over the level (prefill, draft, admission, verify, verify_call,
    other)."""

    @classmethod
    def between(cls, before: dict[str, float], after: dict[str, float],
                stages_before: dict[str, float] | None = None,
                stages_after: dict[str, float] | None = None) -> "SpeculationDelta":
        d = {k: after[k] - before[k] for k in COUNTERS}
        stages = {k: v - (stages_before or {}).get(k, 0.0) for k, v in (stages_after or {}).items()}
        return cls(d["spec_decode_num_drafts_total"], d["spec_decode_num_draft_tokens_total"],
                   d["spec_decode_num_accepted_tokens_total"], d["generation_tokens_total"], stages)

    @property
    def mean_verification_length(self) -> float:
        """Drafts verified per request per round; 0 without speculation (policy none)."""
        return self.draft_tokens / self.drafts if self.drafts else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens per request per speculative round (accepted drafts + 1); NaN without any."""
        return (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else math.nan
