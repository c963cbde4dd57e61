"""Admission: how many draft tokens of each request to verify this round (docs/design.md sections 2, 6, 12).

Glossary
--------
- *anchor* ``x0``: the last token already produced for a request; it is always sent to the target,
  so every request costs at least one batch token.
- *draft tokens* ``x_1..x_gamma``: the drafter's block for a request; ``gamma`` = block size.
- *confidence* ``c_{r,j}``: predicted P(x_j accepted | x_1..x_{j-1} accepted) for request r. It
  depends on ``x_{j-1}`` but never on ``x_j`` (docs/design.md section 3).
- *candidate* ``(r, j)``: "verify request r's draft up to position j" (1-based j).
- *survival* ``a_{r,j} = prod_{i<=j} c_{r,i}``: probability that r's prefix of length j is accepted;
  non-increasing in j, and exactly the expected tokens gained by extending ``l_r`` from j-1 to j.
- *verification length* ``l_r`` in ``0..gamma``: drafts of request r sent to the target this round.
- *B* = ``sum_r (1 + l_r)``: tokens in the target's flattened verification batch.
- *tau* = ``sum_r (1 + sum_{j<=l_r} a_{r,j})``: expected tokens produced this round.
- *Theta* = ``tau * rate(B)``: expected accepted tokens per second; ``rate`` is SPS(B) or
  ``1 / (T_draft + T_verify(B))``, or the latter only when drafts are verified, see
  :class:`dspark.cost_table.ThetaObjective`.
- *admission order*: all candidates sorted by ``a_{r,j}`` descending, ties by smaller j, then by
  smaller r. Because ``a_{r,j} <= a_{r,j-1}`` (also in floating point, where ``c = 1.0`` gives exact
  ties), ``(r, j-1)`` always precedes ``(r, j)``, so any leading run of the order is a set of
  per-request prefixes: admitting the first n candidates never admits j before j-1.
- *capacity* K: how many candidates to admit (``B = R + K``).

Policies (:class:`PolicyKind`, parsed by :meth:`AdmissionPolicy.parse`)
------------------------------------------------------------------------
- ``none``: ``l_r = 0`` (target only). ``fixed:N``: ``l_r = min(N, gamma)`` whatever the confidence
  (``fixed:1`` = the MTP-1-like baseline, ``fixed:gamma`` = the full block, DFlash-style).
  ``threshold:H``: verify while ``a_{r,j} >= H`` (the static-threshold prior art).
- ``sync_greedy`` (Algorithm 1): admit in admission order, evaluating Theta after each admission,
  and stop at the first admission that does not raise Theta. Only candidates with ``a > 0`` are
  considered (the paper's candidate space E). Lossless: the decision about ``(r, j)`` looks only at
  candidates that precede it in the order, none of which depends on ``x_{r,j}``. Optimal when Theta
  is unimodal in the admission count (convex non-decreasing step time).
- ``async_topk`` (the service default): K for step t is the unconstrained argmax over the whole
  Theta curve (every admission count n, no early stop, so it climbs over saw-teeth of a staircase
  SPS) computed from step ``t - lag`` (lag = 2) candidates and the cost table as it stood then; step
  t then admits its top-K candidates by their *fresh* survival. K cannot depend on step t's tokens,
  so no early stop is needed for losslessness (docs/design.md section 6). :class:`AsyncTopKAdmission`
  makes the lag structural: the K used at step t was computed by the call for step ``t - lag``.
  *Warm-up*: for the first ``lag`` steps (and after any gap in the step indices) there is no history;
  K is then the argmax of the Theta curve of a *prior* block in which every admissible position has
  confidence ``prior_confidence`` (a config value). That K depends only on the number of requests,
  gamma, the per-request caps and the cost table, never on the current tokens or confidences.

A global argmax over the *current* step's Theta curve is Appendix A's biased scheduler (it leaks
``x_k`` into the decision about k); it is deliberately not offered here (it lives only in
``tests/test_counterexample.py`` as the negative example).

Per-request caps (``max_lengths``): a request near its ``max_tokens`` may need fewer than gamma
drafts; candidates with ``j > max_lengths[r]`` are never admitted by any policy.

All functions take confidences as a float numpy array or torch tensor ``[num_requests, gamma]`` and
return ``lengths`` as a numpy int64 array ``[num_requests]`` (``torch.from_numpy`` is free).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.cost_table import CostTable, ThetaObjective


# ------------------------------------------------------------------------------------- policy
class PolicyKind(enum.Enum):
    NONE = "none"
    FIXED = "fixed"
    THRESHOLD = "threshold"
    SYNC_GREEDY = "sync_greedy"
    ASYNC_TOPK = "async_topk"


@dataclass(frozen=True)
class AdmissionPolicy:
    """A policy and its parameter (``fixed``: N drafts; ``threshold``: H in [0, 1])."""

    kind: PolicyKind
    fixed_length: int = 0
    """``fixed:N`` only: drafts verified per request (capped by gamma and max_lengths)."""
    threshold: float = 0.0
    """``threshold:H`` only: verify while the survival probability ``a_{r,j} >= H``."""

    def __post_init__(self) -> None:
        if self.fixed_length < 0:
            raise ValueError(f"fixed length must be >= 0, got {self.fixed_length}")
        if not (0.0 <= self.threshold <= 1.0):
            raise ValueError(f"threshold must lie in [0, 1], got {self.threshold}")

    @classmethod
    def parse(cls, text: str) -> "AdmissionPolicy":
        """Parse ``none``, ``fixed:N``, ``threshold:H``, ``sync_greedy`` or ``async_topk``."""
        name, _, arg = text.strip().partition(":")
        try:
            kind = PolicyKind(name.strip().lower())
        except ValueError:
            raise ValueError(
                f"unknown admission policy {text!r}; expected one of none, fixed:N, threshold:H, "
                "sync_greedy, async_topk"
            ) from None
        if kind is PolicyKind.FIXED:
            if not arg:
                raise ValueError("fixed needs a length, e.g. fixed:1")
            return cls(kind, fixed_length=int(arg))
        if kind is PolicyKind.THRESHOLD:
            if not arg:
                raise ValueError("threshold needs a probability, e.g. threshold:0.5")
            return cls(kind, threshold=float(arg))
        if arg:
            raise ValueError(f"policy {name} takes no argument, got {text!r}")
        return cls(kind)

    @property
    def drafts(self) -> bool:
        """Whether the policy runs with a drafter: False for ``none`` only, which decodes with the
        target alone, so no drafter is loaded or started (``fixed:0`` keeps one, though it
        verifies none of its drafts)."""
        return self.kind is not PolicyKind.NONE

    def __str__(self) -> str:
        if self.kind is PolicyKind.FIXED:
            return f"fixed:{self.fixed_length}"
        if self.kind is PolicyKind.THRESHOLD:
            return f"threshold:{self.threshold:g}"
        return self.kind.value


@dataclass(frozen=True)
class AdmissionConfig:
    """Everything an :class:`Admitter` needs besides the cost table."""

    policy: AdmissionPolicy = AdmissionPolicy(PolicyKind.ASYNC_TOPK)
    """Admission policy (docs/design.md section 6); `none` = target only."""
    objective: ThetaObjective = ThetaObjective.SHARED_DEVICE
    """What admission maximises. SHARED_DEVICE (default): drafting and verification take turns
    on the same device, and a round whose K is 0 skips drafting, so a draft is verified only
    when it pays for its share of the drafting as well; the drafting time per round is measured
    (`CostTable.observe_draft`). PAPER: Theta = tau * SPS(B), drafting overlapped with
    verification (cohorts). `sync_greedy` decides after drafting, so it always uses PAPER."""
    lag: int = 2
    """``async_topk``: K for step t comes from step t - lag (>= 1; 2 in the paper's ZOS pipeline)."""
    prior_confidence: float = 0.5
    """``async_topk`` warm-up: per-position confidence of the prior block used while there is no
    history (see the module docstring)."""
    mean_decay: float = 0.9
    """``async_topk``: weight of the past in the running per-position mean confidence that stands
    in for positions a round did not draft and for rounds that skipped drafting (0: last round
    only)."""
    min_gain: float = 1.05
    """``async_topk``: K > 0 only when its expected Theta is at least this many times Theta
    without drafts. The estimate of a round with drafts is the less certain one (drafting after
    skipped rounds absorbs context, and a load that drafts keeps the round without drafts
    unmeasured), and a wrong choice to draft is paid for a whole spell: at 16 users on a 2-core
    CPU in bf16, rounds that the cost table expected to gain 5-10% lost 5%. 1.0: the
    plain argmax. K is still computed from old rounds only, so the margin keeps the output
    distribution exact."""
    fresh_trim: bool = True
    """``async_topk``: a round admits its top K fresh candidates only as far as they pay by its
    own confidences (`stopping_count`: candidate i is admitted unless even i..K all surviving
    as likely as i could not beat stopping before it; the drafting is paid by then, so a shared
    device's rate is SPS(B)). K comes from running means of older rounds, which are high
    just when a round of confident drafts lifted them: at one stream on a q4 CPU target the
    rounds that verified drafts had been decided on 40.5 surviving drafts where their own
    confidences gave 24.5 and the target accepted 20 (docs/results/target_decode_q4.md). On a
    device whose step time does not grow with B the rule keeps all K. False: admit all K."""

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            object.__setattr__(self, "policy", AdmissionPolicy.parse(self.policy))
        if not isinstance(self.objective, ThetaObjective):
            object.__setattr__(self, "objective", ThetaObjective(self.objective))
        if self.lag < 1:
            raise ValueError(f"lag must be >= 1 (0 would be the biased retrospective search), got {self.lag}")
        if not (0.0 <= self.prior_confidence <= 1.0):
            raise ValueError(f"prior_confidence must lie in [0, 1], got {self.prior_confidence}")
        if not (0.0 <= self.mean_decay < 1.0):
            raise ValueError(f"mean_decay must lie in [0, 1), got {self.mean_decay}")
        if not (math.isfinite(self.min_gain) and self.min_gain >= 1.0):
            raise ValueError(f"min_gain must be >= 1, got {self.min_gain}")


# ------------------------------------------------------------------------------------- pure maths
def _as_confidences(c: Any) -> np.ndarray:
    """Confidences as float64 numpy ``[num_requests, gamma]``, validated to lie in [0, 1]."""
    if hasattr(c, "detach"):  # torch.Tensor, without importing torch here
        c = c.detach().cpu().numpy()
    c = np.asarray(c, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"confidences must be [num_requests, gamma], got shape {c.shape}")
    if c.size and not ((c >= 0.0) & (c <= 1.0)).all():  # also rejects NaN
        raise ValueError("confidences must lie in [0, 1]")
    return c


def _as_caps(max_lengths: Any, num_requests: int, gamma: int) -> np.ndarray | None:
    """Per-request caps as int64 ``[num_requests]`` clipped to 0..gamma, or None for no caps."""
    if max_lengths is None:
        return None
    if hasattr(max_lengths, "detach"):
        max_lengths = max_lengths.detach().cpu().numpy()
    caps = np.asarray(max_lengths)
    if caps.shape != (num_requests,) or not np.issubdtype(caps.dtype, np.integer):
        raise ValueError(f"max_lengths must be integers of shape ({num_requests},), got {caps.dtype} {caps.shape}")
    if caps.size and caps.min() < 0:
        raise ValueError("max_lengths must be >= 0")
    return np.minimum(caps.astype(np.int64), gamma)


def survival_probs(c: Any) -> np.ndarray:
    """``a_{r,j} = prod_{i<=j} c_{r,i}``: ``[num_requests, gamma]`` float64, non-increasing in j."""
    return np.cumprod(_as_confidences(c), axis=1)  # [num_requests, gamma]


@dataclass(frozen=True)
class Candidates:
    """The admissible candidates of one round, in admission order (``a`` desc, then j, then r)."""

    request: np.ndarray  # [num_candidates] int64: r
    position: np.ndarray  # [num_candidates] int64: j, 1-based
    survival: np.ndarray  # [num_candidates] float64: a_{r,j}, non-increasing (see sorted_candidates)
    num_requests: int

    def __len__(self) -> int:
        return int(self.request.shape[0])


_ONE_BITS = np.float64(1.0).view(np.int64)  # IEEE-754 bit pattern of 1.0


def sorted_candidates(a: np.ndarray, max_lengths: Any = None, positive_only: bool = True) -> Candidates:
    """Sort the candidates of survival matrix ``a [num_requests, gamma]`` into admission order.

    Candidates with ``j > max_lengths[r]`` are dropped; with ``positive_only`` (the paper's candidate
    space E) so are those with ``a_{r,j} == 0``, which can only cost batch slots.

    Speed: instead of a stable float argsort (about 4x slower) one int64 key per candidate is sorted,
    ``((bits(1.0) - bits(a)) >> s) << s | f``, where ``f = (j - 1) * R + r`` is the position-major
    flat index and ``2^s`` > the number of flat indices. For non-negative doubles the bit pattern
    is monotone in the value, so the key orders by ``a`` descending, then by j, then by r; the
    only approximation is that survivals agreeing to within ``2^s`` units in the last place
    (relative ``2^(s-52)``, about 1e-12 for 256 x 16 candidates) count as ties and so fall back
    to (j, r) order. Prefix order is exact: ``a_{r,j} <= a_{r,j-1}`` gives a key that is not smaller
    in its first part and larger in f.
    """
    a = np.asarray(a, dtype=np.float64)
    assert a.ndim == 2, a.shape
    num_requests, gamma = a.shape
    caps = _as_caps(max_lengths, num_requests, gamma)
    a_jr = np.ascontiguousarray(a.T).reshape(-1) + 0.0  # [gamma * num_requests]; + 0.0: no -0.0
    valid = a_jr > 0.0 if positive_only else np.ones(a_jr.shape, dtype=bool)
    if caps is not None:
        j_of_flat = np.repeat(np.arange(1, gamma + 1), num_requests)  # [gamma * num_requests]
        valid &= j_of_flat <= np.tile(caps, gamma)
    flat = np.flatnonzero(valid)  # [num_candidates]
    shift = max(1, int(a_jr.shape[0] - 1).bit_length())
    keys = (((_ONE_BITS - a_jr[flat].view(np.int64)) >> shift) << shift) | flat  # [num_candidates]
    keys.sort()  # all keys differ (distinct f), so an unstable sort is deterministic
    flat = keys & ((1 << shift) - 1)
    return Candidates(
        request=flat % num_requests,
        position=flat // num_requests + 1,
        survival=a_jr[flat],
        num_requests=num_requests,
    )


def expected_tokens(survival_sorted: np.ndarray, num_requests: int) -> np.ndarray:
    """``R + the sum of the first n survivals`` for n = 0..N: a round's expected committed
    tokens (one bonus token a request) when it admits the first n candidates, ``[N + 1]``."""
    tau = np.empty(survival_sorted.shape[0] + 1, dtype=np.float64)  # [N + 1]
    tau[0] = 0.0
    np.cumsum(survival_sorted, out=tau[1:])
    return tau + num_requests


def theta_curve(
    survival_sorted: np.ndarray,
    num_requests: int,
    cost_table: CostTable,
    objective: ThetaObjective = ThetaObjective.PAPER,
) -> np.ndarray:
    """``Theta(n)`` for admitting the first n = 0..N candidates: ``[N + 1]`` float64.

    ``Theta(n) = (R + sum of the first n survivals) * rate(R + n)``; under
    :attr:`ThetaObjective.SHARED_DEVICE` the round with n = 0 does not draft, so its rate is SPS(R).
    """
    n_cand = survival_sorted.shape[0]
    tau = expected_tokens(survival_sorted, num_requests)  # [N + 1]
    steps = cost_table.round_step_range(num_requests, n_cand + 1)  # [N + 1] seconds
    theta = tau * cost_table.rate(steps, objective, num_requests)
    if objective is ThetaObjective.SHARED_DEVICE:
        theta[0] = num_requests * cost_table.rate(steps[0], ThetaObjective.PAPER, num_requests)
    return theta


def best_capacity(
    candidates: Candidates, cost_table: CostTable, objective: ThetaObjective = ThetaObjective.PAPER,
    min_gain: float = 1.0,
) -> int:
    """Unconstrained global search: the admission count n maximising Theta (smallest on ties),
    or 0 when that maximum is below ``min_gain`` times Theta without drafts."""
    return capacity_and_gain(candidates, cost_table, objective, min_gain)[0]


def capacity_and_gain(
    candidates: Candidates, cost_table: CostTable, objective: ThetaObjective = ThetaObjective.PAPER,
    min_gain: float = 1.0,
) -> tuple[int, float]:
    """:func:`best_capacity`, and the gain of the best admission count over none,
    ``max Theta / Theta(0)`` (>= 1; 1.0 without requests), whether or not min_gain let it in."""
    if candidates.num_requests == 0:
        return 0, 1.0
    theta = theta_curve(candidates.survival, candidates.num_requests, cost_table, objective)
    k = int(np.argmax(theta))
    gain = float(theta[k] / theta[0])
    return (k if gain >= min_gain else 0), gain


def admit_top_k(candidates: Candidates, k: int) -> np.ndarray:
    """Admit the first k candidates in admission order: ``lengths [num_requests]`` int64."""
    k = max(0, min(int(k), len(candidates)))
    return np.bincount(candidates.request[:k], minlength=candidates.num_requests).astype(np.int64)


def objective_after_drafting(objective: ThetaObjective) -> ThetaObjective:
    """The objective of a decision taken after the round drafted: its drafting is paid, so a
    shared device's round rate is SPS(B), the paper's."""
    return ThetaObjective.PAPER if objective is ThetaObjective.SHARED_DEVICE else objective


def sync_greedy_count(
    candidates: Candidates, cost_table: CostTable, objective: ThetaObjective = ThetaObjective.PAPER
) -> int:
    """Algorithm 1's admission count: stop at the first admission that does not raise Theta.

    Vectorised over the whole curve, but the result is exactly the sequential loop's: the count
    n such that Theta rose at every admission 1..n and did not rise at n + 1.
    """
    if candidates.num_requests == 0:
        return 0
    theta = theta_curve(candidates.survival, candidates.num_requests, cost_table, objective)
    stops = np.flatnonzero(theta[1:] <= theta[:-1])
    return int(stops[0]) if stops.size else len(candidates)


def stopping_count(
    candidates: Candidates, horizon: int, cost_table: CostTable,
    objective: ThetaObjective = ThetaObjective.PAPER,
) -> int:
    """How many of the first ``horizon`` candidates to admit, decided as a stopping rule: stop
    before candidate i when Theta(i - 1) is at least the best Theta over m = i..horizon with
    candidates i..m all surviving a_i (the most any of them can, the order being by survival).

    Admitting candidate i then depends only on survivals up to a_i and on ``horizon`` (decided
    before drafting), never on what follows i: a request's draft x_j enters the verification
    from c_1..c_j alone (c_j is computed before x_j is sampled), as the lossless verification
    needs (docs/design.md section 6; tests/test_counterexample.py). Neither a global argmax
    over the round's own curve nor a horizon at the number of candidates would do: c_(j+1),
    computed from x_j, would decide whether x_j is verified (a zero survival drops a
    candidate). Where the step time is a straight line in B this is `sync_greedy_count`'s early
    stop (with constant survivals past i the optimistic Theta is monotone in m); where it jumps
    (bucketed batch shapes) it climbs a step that pays back from a_i on.
    """
    n = min(len(candidates), horizon)
    if n == 0:
        return 0
    r = candidates.num_requests
    survival = candidates.survival[:n]  # [n]
    tau = expected_tokens(survival, r)  # [n + 1]
    rate = cost_table.rate(cost_table.round_step_range(r, horizon + 1), objective, r)  # [horizon + 1]
    i = np.arange(1, n + 1)[:, None]  # [n, 1]: the candidate about to be admitted
    m = np.arange(horizon + 1)[None, :]  # [1, horizon + 1]: an admission count
    optimistic = (tau[i - 1] + (m - i + 1) * survival[i - 1]) * rate  # [n, horizon + 1]
    best = np.where(m >= i, optimistic, -np.inf).max(axis=1)  # [n]
    stops = np.flatnonzero(best <= tau[:-1] * rate[:n])
    return int(stops[0]) if stops.size else n


def admit_sync_greedy(
    c: Any,
    cost_table: CostTable,
    max_lengths: Any = None,
    objective: ThetaObjective = ThetaObjective.PAPER,
) -> np.ndarray:
    """Algorithm 1 (synchronous greedy with early stop): ``lengths [num_requests]``."""
    candidates = sorted_candidates(survival_probs(c), max_lengths)
    return admit_top_k(candidates, sync_greedy_count(candidates, cost_table, objective))


def admit_fixed(c: Any, length: int, max_lengths: Any = None) -> np.ndarray:
    """``l_r = min(length, gamma, max_lengths[r])`` whatever the confidences."""
    c = _as_confidences(c)
    num_requests, gamma = c.shape
    lengths = np.full(num_requests, min(int(length), gamma), dtype=np.int64)
    caps = _as_caps(max_lengths, num_requests, gamma)
    return lengths if caps is None else np.minimum(lengths, caps)


def admit_threshold(c: Any, threshold: float, max_lengths: Any = None) -> np.ndarray:
    """Verify while ``a_{r,j} >= threshold``: the count of such j (a prefix, a being non-increasing)."""
    a = survival_probs(c)
    num_requests, gamma = a.shape
    lengths = (a >= threshold).sum(axis=1).astype(np.int64)  # [num_requests]
    caps = _as_caps(max_lengths, num_requests, gamma)
    return lengths if caps is None else np.minimum(lengths, caps)


def prior_candidates(
    num_requests: int, gamma: int, prior_confidence: float, max_lengths: Any = None
) -> Candidates:
    """Candidates of a block in which every position has confidence ``prior_confidence``."""
    c = np.full((num_requests, gamma), float(prior_confidence))
    return sorted_candidates(survival_probs(c), max_lengths)


# ------------------------------------------------------------------------------------- stateful
class AsyncTopKAdmission:
    """``async_topk`` with a structural lag: step t admits the top-K of its fresh candidates, where
    K was computed by the call for step ``t - lag`` from *that* step's candidates and the cost table
    as it stood then. Each call then computes, from its own candidates, the K for step ``t + lag``.

    A running per-position mean of the confidences seen so far (``mean_confidence``, old rounds
    only) fills in what a round does not have: positions it did not draft (the engine drafts only
    K + 1 of them once K is known) and whole rounds that skipped drafting because their K was 0.
    Without it, K could rise by only one position per ``lag`` rounds, and one unlucky block would
    hand K = 0 from skipped round to skipped round until a probe.
    """

    def __init__(self, cost_table: CostTable, config: AdmissionConfig = AdmissionConfig()) -> None:
        self.config = config
        self.cost_table = cost_table
        self.lag = config.lag
        self.objective = config.objective
        self.prior_confidence = config.prior_confidence
        self.mean_decay = config.mean_decay
        self.min_gain = config.min_gain
        self._capacity_for_step: dict[int, int] = {}  # step index -> K computed lag steps earlier
        self._gain_for_step: dict[int, float] = {}  # step index -> that decision's gain
        self.mean_confidence = np.zeros(0)
        """Running mean conditional confidence per draft position ``[positions seen]``."""
        self._means_version = 0
        """Bumped whenever mean_confidence changes (keys the cache below)."""
        self._mean_candidates_cache: tuple[tuple[int, int, int], Candidates] | None = None
        """((R, block size, means version), the sorted candidates of that block of means)."""
        self.capacity_used: int | None = None
        """K used by the last :meth:`admit` call (before clipping to the available candidates)."""
        self.used_prior: bool = False
        """Whether the last call had no history and used the warm-up prior K."""
        self.next_step = 0
        """The step after the last one recorded (admitted, probed or skipped): the default
        ``step_index`` of :meth:`admit`, :meth:`planned_capacity` and :meth:`planned_gain`."""

    def _mean_block(self, num_requests: int, block_size: int) -> np.ndarray:
        """``[num_requests, block_size]`` of the running means (the prior where none yet)."""
        means = np.full(block_size, self.prior_confidence)
        seen = min(block_size, self.mean_confidence.size)
        means[:seen] = self.mean_confidence[:seen]
        return np.broadcast_to(means, (num_requests, block_size))

    def _mean_candidates(self, num_requests: int, block_size: int) -> Candidates:
        """The sorted candidates of a block of running means (:meth:`_mean_block`), kept until
        the means change: under a load where no draft pays, every skipped round decides from
        the same means. At 16 users (bf16, AVX512 CPU) the engine thread's CPU before the verifier call
        (mostly this decision) went from 0.32 to 0.21 ms a round."""
        key = (num_requests, block_size, self._means_version)
        if self._mean_candidates_cache is None or self._mean_candidates_cache[0] != key:
            block = self._mean_block(num_requests, block_size)
            self._mean_candidates_cache = (key, sorted_candidates(survival_probs(block)))
        return self._mean_candidates_cache[1]

    def _update_means(self, c: np.ndarray) -> None:
        """Fold this round's per-position batch means ``c [num_requests, n]`` into the running mean.

        Positions past n (not drafted this round) move in proportion with position 1: they keep
        their last seen ratio to it. Left alone they would freeze at whatever they were when last
        drafted, typically the first rounds of an answer, which are the most predictable (held-out
        T=1 acceptance at k=1 falls from 0.48 in round 2 to 0.25 after round 10), and a skipped
        round's K, computed from them, would keep admitting drafts that no longer pay."""
        if c.shape[0] == 0 or c.shape[1] == 0:
            return
        fresh = c.mean(axis=0)  # [n]
        n = fresh.size
        old = self.mean_confidence
        if old.size < n:  # first sight of these positions: start them at their value
            old = np.concatenate([old, fresh[old.size:]])
        old = old.copy()
        first_before = old[0]
        old[:n] = self.mean_decay * old[:n] + (1.0 - self.mean_decay) * fresh
        if old.size > n and first_before > 0.0:
            old[n:] = np.clip(old[n:] * (old[0] / first_before), 0.0, 1.0)
        self.mean_confidence = old
        self._means_version += 1

    def admit(self, c_fresh: Any, step_index: int | None = None, max_lengths: Any = None,
              block_size: int | None = None) -> np.ndarray:
        """Lengths ``[num_requests]`` for step ``step_index`` (default :attr:`next_step`) from
        confidences ``[num_requests, n]``.

        block_size: the drafter's whole block (>= n) when it drafted only the first n positions;
        the K handed to step ``t + lag`` then sees positions n+1..block_size at their running
        means (after this round's own).
        """
        if step_index is None:
            step_index = self.next_step
        c = _as_confidences(c_fresh)
        a = survival_probs(c)  # [num_requests, n]
        num_requests, n = a.shape
        # 1. K for this step: decided lag steps ago (or the token-free warm-up prior).
        k = self._capacity_for_step.pop(step_index, None)
        self.used_prior = k is None
        if k is None:
            prior = prior_candidates(num_requests, n, self.prior_confidence, max_lengths)
            k = self._decide(prior)[0]
        self.capacity_used = k
        # 2. Admit the top-K fresh candidates (those of them that pay, with fresh_trim).
        candidates = sorted_candidates(a, max_lengths)
        lengths = admit_top_k(candidates, self._fresh_count(candidates, k))
        # 3. From this step's information, the K of step t + lag; forget steps already past.
        self._update_means(c)
        if block_size is not None and block_size > n:
            extended = np.concatenate(
                [c, self._mean_block(num_requests, block_size)[:, n:]], axis=1)  # [R, block_size]
            caps = None if max_lengths is None else np.where(
                np.asarray(max_lengths) >= n, block_size, np.asarray(max_lengths))
            candidates = sorted_candidates(survival_probs(extended), caps)
        self._hand_on(step_index, self._decide(candidates))
        return lengths

    def _fresh_count(self, candidates: Candidates, k: int) -> int:
        """How many of the top k fresh candidates this round admits: all k, or with
        ``fresh_trim`` as many as `stopping_count` lets in."""
        if not self.config.fresh_trim or k == 0:
            return k
        return stopping_count(candidates, k, self.cost_table,
                              objective_after_drafting(self.objective))

    def _decide(self, candidates: Candidates) -> tuple[int, float]:
        """(K, gain) from these candidates and the cost table as it stands (capacity_and_gain)."""
        return capacity_and_gain(candidates, self.cost_table, self.objective, self.min_gain)

    def _hand_on(self, step_index: int, decision: tuple[int, float]) -> None:
        """(K, gain) for step ``t + lag``; forget what was decided for steps already past."""
        self.next_step = step_index + 1
        for stale in [s for s in self._capacity_for_step if s <= step_index]:
            del self._capacity_for_step[stale]
            self._gain_for_step.pop(stale, None)
        self._capacity_for_step[step_index + self.lag], self._gain_for_step[
            step_index + self.lag] = decision

    def probe(self, c_sample: Any, step_index: int, num_requests: int, block_size: int) -> None:
        """Step ``step_index`` verifies no drafts (its K is 0), but the drafter drafted a *sample*
        of its ``num_requests`` requests anyway: a probe, so that fresh confidences can raise K
        again. ``c_sample [S, n]`` (S <= num_requests, n <= block_size) are the sample's
        confidences; which requests were sampled must not depend on their drafts. They refresh
        the running means, and the K of step ``t + lag`` comes from a block in which the sampled
        requests have their fresh confidences (their undrafted positions the running means) and
        every other request has the running means: the same candidates :meth:`admit` would build,
        with the means standing in for the requests not drafted."""
        c = _as_confidences(c_sample)
        sampled, n = c.shape
        if sampled > num_requests or n > block_size:
            raise ValueError(f"a probe of {sampled} requests x {n} positions does not fit "
                             f"{num_requests} requests x {block_size}")
        self._update_means(c)
        block = self._mean_block(num_requests, block_size).copy()  # [num_requests, block_size]
        block[:sampled, :n] = c
        self._hand_on(step_index, self._decide(sorted_candidates(survival_probs(block))))
        self.capacity_used = 0
        self.used_prior = False

    def planned_capacity(self, step_index: int | None = None) -> int | None:
        """K already decided for step ``step_index`` (default :attr:`next_step`; None: no
        history, the prior will decide)."""
        return self._capacity_for_step.get(self.next_step if step_index is None else step_index)

    def planned_gain(self, step_index: int | None = None) -> float | None:
        """The expected gain (max Theta / Theta without drafts) of that decision, or None."""
        return self._gain_for_step.get(self.next_step if step_index is None else step_index)

    def skip(self, step_index: int, num_requests: int | None = None,
             block_size: int | None = None) -> None:
        """Step ``step_index`` drafted nothing because its K was 0: it verifies no drafts. With no
        fresh candidates, the K of step ``t + lag`` comes from a block of running means for
        ``num_requests`` requests (0 if they are not given or nothing was seen yet)."""
        decision = (0, 1.0)
        if num_requests and block_size and self.mean_confidence.size:
            decision = self._decide(self._mean_candidates(num_requests, block_size))
        self._hand_on(step_index, decision)
        self.capacity_used = 0
        self.used_prior = False


class Admitter:
    """One admission decision per round under a configured policy (thin wrapper over the maths).

    What only ``async_topk`` does between its admissions (skipped rounds, plain checks, probes)
    is its round policy's (dspark.round_policy.AsyncTopKPolicy), on :attr:`async_topk`."""

    def __init__(self, config: AdmissionConfig, cost_table: CostTable | None = None) -> None:
        self.config = config
        self.cost_table = cost_table
        kind = config.policy.kind
        if kind in (PolicyKind.SYNC_GREEDY, PolicyKind.ASYNC_TOPK) and cost_table is None:
            raise ValueError(f"policy {config.policy} needs a cost table")
        self.async_topk = (
            AsyncTopKAdmission(cost_table, config)
            if kind is PolicyKind.ASYNC_TOPK
            else None
        )
        """The lagged admission's state under ``async_topk``; None for the other policies."""

    @property
    def capacity_used(self) -> int | None:
        """``async_topk``: the K its last decision used (None for the other policies)."""
        return None if self.async_topk is None else self.async_topk.capacity_used

    def planned_capacity(self) -> int | None:
        """``async_topk``: the next step's K, decided ``lag`` steps ago (None: other policies, or
        no history yet). It bounds the next step's admissions: a request's j-th draft is only
        admitted with its first j - 1, so no draft past position K can be verified."""
        return None if self.async_topk is None else self.async_topk.planned_capacity()

    def positions_to_draft(self, gamma: int) -> int:
        """Block positions worth drafting for the next step: no policy admits a draft past them.
        ``fixed:N``: N (at least 1, so that ``fixed:0`` still drafts); ``async_topk`` with a K
        already decided: K + 1 (a request's j-th draft is only admitted with its first j - 1, so
        none past K; the extra position lets this round's confidences raise K for a later one);
        otherwise the whole block. Drafting fewer positions leaves the admitted drafts'
        distributions as they are."""
        policy = self.config.policy
        if policy.kind is PolicyKind.FIXED:
            return min(gamma, max(1, policy.fixed_length))
        planned = self.planned_capacity()
        return gamma if planned is None else min(gamma, planned + 1)

    def admit(self, c: Any, step_index: int | None = None, max_lengths: Any = None,
              block_size: int | None = None) -> np.ndarray:
        """Lengths ``[num_requests]`` (int64, 0..gamma) for confidences ``c [num_requests, gamma]``.

        ``step_index`` numbers the rounds (only ``async_topk`` uses it); by default consecutive calls
        are consecutive steps.
        """
        policy = self.config.policy
        kind = policy.kind
        if kind is PolicyKind.NONE:
            return admit_fixed(c, 0)
        if kind is PolicyKind.FIXED:
            return admit_fixed(c, policy.fixed_length, max_lengths)
        if kind is PolicyKind.THRESHOLD:
            return admit_threshold(c, policy.threshold, max_lengths)
        if kind is PolicyKind.SYNC_GREEDY:
            # Its confidences come from this round's drafts.
            return admit_sync_greedy(c, self.cost_table, max_lengths,
                                     objective_after_drafting(self.config.objective))
        if kind is PolicyKind.ASYNC_TOPK:
            return self.async_topk.admit(c, step_index, max_lengths, block_size)
        raise AssertionError(f"unhandled policy {kind}")
