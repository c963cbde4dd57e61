"""How many drafts a seeded request verifies, from its own confidences only.

A seeded request must give the same tokens every time it is sent. Its random numbers
are keyed by its seed and its rounds' anchors (dspark.random_draws), so it repeats as long as
its rounds do: as long as the number of drafts l each of its rounds verifies depends on its own
prefix and seed only. `fixed:N`, `threshold:H` and `none` decide per request already; `async_topk`
and `sync_greedy` decide from the whole batch, the cost table and (async_topk) the confidences of
two steps before, all of which change with the crowd and the clock. For a seeded request under
those two, the engine replaces its l by `seeded_lengths`: the same greedy rule as sync_greedy
(Algorithm 1, docs/design.md section 6) on the request alone, against a fixed cost model instead of
the measured one.

The rule: with survival a_j = prod_{i<=j} c_i, a round of l drafts yields 1 + S_l tokens in
expectation (S_l = a_1 + .. + a_l) and costs `base + per_draft * l` target steps of one token
(`SeededCostModel`); extend l to j while that raises tokens per cost,

    a_j * (base + per_draft * (j - 1)) > per_draft * (1 + S_{j-1}),

and stop at the first j where it does not. The test at j reads a_1..a_j, which depend on the
drafts x_1..x_{j-1} only, never on x_j, and nothing after the first failure is looked at: the
rule is non-anticipating, hence lossless (docs/design.md section 6).

Unseeded requests keep the policy's decision; the drafting gate is not consulted while a seeded
request runs (it would skip drafting for timing reasons), and every position of the block is
drafted (async_topk may otherwise draft fewer, as its crowd-dependent K allows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dspark.admission import PolicyKind

# Policies whose decision depends on other requests, the cost table or the clock.
CROWD_POLICIES = (PolicyKind.ASYNC_TOPK, PolicyKind.SYNC_GREEDY)


@dataclass(frozen=True)
class SeededCostModel:
    """A round's cost in target steps of one token: `base + per_draft * l`. Fixed numbers, not a
    measurement, so that the decision repeats on any machine and at any load. The defaults:
    drafting a block costs about a seventh of a target step and each verified draft about 2% of
    one on the CPU target (docs/design.md section 11: 8 verified tokens cost about 1.15 steps)."""

    base: float = 1.15
    per_draft: float = 0.02

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.per_draft > 0):
            raise ValueError(f"base and per_draft must be > 0, got {self.base}, {self.per_draft}")


def seeded_lengths(confidences: Any, max_lengths: Sequence[int],
                   cost: SeededCostModel = SeededCostModel()) -> np.ndarray:
    """l for each row from its own confidences: confidences [n, gamma] in [0, 1] (NaN = no
    confidence head: the whole block up to the cap), max_lengths [n] -> [n] int64 (module doc)."""
    if hasattr(confidences, "detach"):
        confidences = confidences.detach().cpu().numpy()
    c = np.asarray(confidences, dtype=np.float64)
    assert c.ndim == 2, c.shape
    n, gamma = c.shape
    caps = np.minimum(np.asarray(max_lengths, dtype=np.int64), gamma)
    assert caps.shape == (n,), (caps.shape, n)
    c = np.where(np.isnan(c), 1.0, c)
    a = np.cumprod(c, axis=1)  # [n, gamma] survival a_j
    before = np.cumsum(a, axis=1) - a  # [n, gamma] S_{j-1}
    j0 = np.arange(gamma)  # j - 1
    gains = a * (cost.base + cost.per_draft * j0) > cost.per_draft * (1.0 + before)
    within = j0[None, :] < caps[:, None]
    extend = gains & within  # [n, gamma]
    return np.cumprod(extend, axis=1).sum(axis=1).astype(np.int64)


def override_seeded(policy: PolicyKind, lengths: np.ndarray, confidences: Any,
                    max_lengths: Sequence[int], seeded: Sequence[bool]) -> np.ndarray:
    """The policy's lengths [n] with the seeded rows' replaced by `seeded_lengths`, under the
    crowd-dependent policies (the others decide per request already)."""
    rows = np.flatnonzero(np.asarray(seeded, dtype=bool))
    if policy not in CROWD_POLICIES or rows.size == 0:
        return lengths
    if hasattr(confidences, "detach"):
        confidences = confidences.detach().cpu().numpy()
    out = np.array(lengths, dtype=np.int64, copy=True)
    out[rows] = seeded_lengths(np.asarray(confidences)[rows],
                               np.asarray(max_lengths, dtype=np.int64)[rows])
    return out


def gate_bypassed(policy: PolicyKind, seeded: Sequence[bool]) -> bool:
    """Whether a round drafts every running request without asking the drafting gate (and
    drafts whole blocks): a seeded request runs under a crowd-dependent policy."""
    return policy in CROWD_POLICIES and any(seeded)
