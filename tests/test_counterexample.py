"""The paper's Appendix A counterexample, end to end (docs/design.md section 6).

drafting -> admission -> lossless rejection sampling (dspark.rejection.verify), 10^5 seeded rounds.

One request, gamma = 2, vocabulary {A, B}; SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45.
Position 1: p^d = (0.5, 0.5), p^t = (0.7, 0.3), so c_1 = a_1 = sum min(p^t, p^d) = 0.8.
Position 2 depends on x_1 (the Markov confidence head sees x_1):
  x_1 = A: p^d_2 = (0.8, 0.2), p^t_2 = (0.9, 0.1) -> c_2 = 0.9 (calibrated: sum min = 0.9);
  x_1 = B: p^d_2 = (1.0, 0.0), p^t_2 = (0.0, 1.0) -> c_2 = 0.0.
Theta_0 = 1.0, Theta_1 = 0.9, Theta_2 = 1.134 (A) or 0.81 (B).

A *retrospective* scheduler (global argmax of Theta over the current round's confidences, no
early stop) verifies 2 tokens after A and none after B: the first output token becomes
(0.85, 0.15). It is defined here only, as the negative example. sync_greedy (early stop) and
async_topk (K from two rounds before) must give the target's (0.7, 0.3).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, chi2_contingency

from dspark.admission import (
    AdmissionConfig,
    Admitter,
    admit_top_k,
    best_capacity,
    prior_candidates,
    sorted_candidates,
    stopping_count,
    survival_probs,
    theta_curve,
)
from dspark.cost_table import CostTable, ThetaObjective
from dspark.random_draws import CounterGenerator
from dspark.rejection import RandomDraws, VerifyBatch, draw_uniforms, verify
from dspark.sampling import SamplingParams

A, B = 0, 1
NUM_ROUNDS = 100_000
P_TARGET_1 = torch.tensor([0.7, 0.3])
P_DRAFT_1 = torch.tensor([0.5, 0.5])
P_DRAFT_2 = torch.tensor([[0.8, 0.2], [1.0, 0.0]])  # [x_1, vocab]
P_TARGET_2 = torch.tensor([[0.9, 0.1], [0.0, 1.0]])  # [x_1, vocab]
P_TARGET_3 = torch.tensor([0.5, 0.5])  # bonus position after two accepted drafts (any distribution)
C_2 = {A: 0.9, B: 0.0}
WRAPPER_ROUNDS = 4_000
ALPHA = 1e-3  # a correct scheduler must not be rejected at this level (fixed seed: deterministic)


def seeded_draws(draft_lens: torch.Tensor, seed: int) -> RandomDraws:
    """Keyed draws (dspark.random_draws) for a batch of independent requests: one seed, request
    r's anchor at position r."""
    return draw_uniforms(draft_lens, CounterGenerator(seed), torch.arange(len(draft_lens)))


def cost_table() -> CostTable:
    return CostTable.from_sps({1: 1.0, 2: 0.5, 3: 0.45})


def confidences(x1: int) -> np.ndarray:
    """The drafter's confidences [1, gamma = 2] after drafting x_1."""
    return np.array([[0.8, C_2[x1]]])


@pytest.fixture(scope="module")
def drafts():
    """Draft all rounds at once: x_1 ~ p^d_1, x_2 ~ p^d_2(. | x_1)."""
    g = torch.Generator().manual_seed(20260529)
    x1 = torch.multinomial(P_DRAFT_1, NUM_ROUNDS, replacement=True, generator=g)  # [num_rounds]
    u = torch.rand(NUM_ROUNDS, generator=g)
    x2 = (u >= P_DRAFT_2[x1, 0]).long()  # [num_rounds], inverse CDF over {A, B}
    return x1, x2


# ------------------------------------------------------------------------------------- schedulers
def retrospective_lengths(x1: torch.Tensor, table: CostTable) -> np.ndarray:
    """NEGATIVE EXAMPLE: argmax of Theta over the current round's whole curve (leaks x_1)."""
    out = np.empty(x1.shape[0], dtype=np.int64)
    for token in (A, B):  # the scheduler is a deterministic function of the round's confidences
        cand = sorted_candidates(survival_probs(confidences(token)), positive_only=False)
        k = int(np.argmax(theta_curve(cand.survival, 1, table)))
        out[(x1 == token).numpy()] = admit_top_k(cand, k)[0]
    return out


def stateless_policy_lengths(policy: str, x1: torch.Tensor, table: CostTable) -> np.ndarray:
    """A stateless policy run on every round; it is a deterministic function of the round's
    confidences, which take one of two values here, so each value is decided once."""
    admitter = Admitter(AdmissionConfig(policy=policy, objective=ThetaObjective.PAPER), table)
    decided = {token: int(admitter.admit(confidences(token))[0]) for token in (A, B)}
    return np.where(x1.numpy() == A, decided[A], decided[B]).astype(np.int64)


def async_lengths(x1: torch.Tensor, table: CostTable) -> tuple[np.ndarray, np.ndarray]:
    """async_topk over the stream of rounds: K of round t from round t - 2, top-K of round t.

    Vectorised with the pure functions of dspark.admission (one admission call per round for 10^5
    rounds would take ~10 s here); the stateful wrapper is run for real on the first
    WRAPPER_ROUNDS rounds and must agree exactly.
    """
    cand = {t: sorted_candidates(survival_probs(confidences(t))) for t in (A, B)}
    k_from = {t: best_capacity(cand[t], table) for t in (A, B)}
    x1_np = x1.numpy()
    prior = best_capacity(prior_candidates(1, 2, AdmissionConfig().prior_confidence), table)
    capacities = np.full(x1_np.shape[0], prior, dtype=np.int64)  # warm-up: rounds 0 and 1
    capacities[2:] = np.where(x1_np[:-2] == A, k_from[A], k_from[B])
    # the round admits the stopping count of its own top K (AdmissionConfig.fresh_trim)
    admitted_if = {t: [int(admit_top_k(cand[t], stopping_count(cand[t], k, table))[0]) for k in range(3)]
                   for t in (A, B)}
    lengths = np.where(x1_np == A, np.take(admitted_if[A], capacities), np.take(admitted_if[B], capacities))

    admitter = Admitter(AdmissionConfig(policy="async_topk", objective=ThetaObjective.PAPER), table)
    for t, token in enumerate(x1_np[:WRAPPER_ROUNDS].tolist()):
        assert admitter.admit(confidences(token), step_index=t)[0] == lengths[t]
        assert admitter.capacity_used == capacities[t]
    return lengths.astype(np.int64), capacities


# ------------------------------------------------------------------------------------- verification
def first_output_tokens(x1: torch.Tensor, x2: torch.Tensor, lengths: np.ndarray, seed: int) -> torch.Tensor:
    """Verify every round with the project's lossless verifier; return the first output token."""
    num_rounds = x1.shape[0]
    draft_lens = torch.from_numpy(lengths)  # [num_rounds]
    keep = torch.arange(2).unsqueeze(0) < draft_lens.unsqueeze(1)  # [num_rounds, 2]
    draft_tokens = torch.stack([x1, x2], dim=1)[keep]  # [num_drafts], request order
    draft_probs = torch.stack([P_DRAFT_1.expand(num_rounds, 2), P_DRAFT_2[x1]], dim=1)[keep]  # [num_drafts, 2]
    target_probs = torch.stack(
        [P_TARGET_1.expand(num_rounds, 2), P_TARGET_2[x1], P_TARGET_3.expand(num_rounds, 2)], dim=1
    )  # [num_rounds, 3, vocab]
    keep_target = torch.arange(3).unsqueeze(0) < (draft_lens + 1).unsqueeze(1)  # [num_rounds, 3]
    target_logits = torch.log(target_probs[keep_target])  # [num_drafts + num_rounds, vocab]; log 0 = -inf
    batch = VerifyBatch(
        draft_tokens=draft_tokens,
        draft_lens=draft_lens,
        draft_probs=draft_probs,
        target_logits=target_logits,
        sampling=[SamplingParams(temperature=1.0)] * num_rounds,
    )
    result = verify(batch, seeded_draws(draft_lens, seed))
    assert bool((result.num_accepted <= draft_lens).all())
    first = torch.tensor([tokens[0] for tokens in result.output_tokens(batch)])  # [num_rounds]
    # the accepted draft x_1 when one was accepted, otherwise the recovered/plain token
    assert torch.equal(first, torch.where(result.num_accepted > 0, x1, result.next_tokens))
    return first


def p_value_first_token_is_a(first: torch.Tensor, p_a: float) -> float:
    return binomtest(int((first == A).sum()), first.shape[0], p_a).pvalue


# ------------------------------------------------------------------------------------- tests
def test_theta_values_exactly():
    table = cost_table()
    expected = {A: [1.0, 0.9, 1.134], B: [1.0, 0.9, 0.81]}
    for token in (A, B):
        cand = sorted_candidates(survival_probs(confidences(token)), positive_only=False)
        curve = theta_curve(cand.survival, 1, table)
        assert np.abs(curve - np.array(expected[token])).max() < 1e-9
    # with the paper's candidate space E (a > 0), B's zero-survival second position is not a candidate
    cand_b = sorted_candidates(survival_probs(confidences(B)))
    assert np.abs(theta_curve(cand_b.survival, 1, table) - np.array([1.0, 0.9])).max() < 1e-9


def test_retrospective_scheduler_is_biased(drafts):
    x1, x2 = drafts
    lengths = retrospective_lengths(x1, cost_table())
    assert np.array_equal(lengths, np.where(x1.numpy() == A, 2, 0))  # admits x_1 iff x_1 = A
    first = first_output_tokens(x1, x2, lengths, seed=1)
    freq_a = float((first == A).float().mean())
    assert abs(freq_a - 0.85) < 0.01
    assert p_value_first_token_is_a(first, 0.85) > ALPHA
    assert p_value_first_token_is_a(first, 0.7) < 1e-12  # the test has power: the bias is caught


def test_sync_greedy_is_lossless(drafts):
    x1, x2 = drafts
    lengths = stateless_policy_lengths("sync_greedy", x1, cost_table())
    assert (lengths == 0).all()  # Theta_1 = 0.9 < Theta_0 = 1.0: stop before looking at c_2
    first = first_output_tokens(x1, x2, lengths, seed=2)
    assert abs(float((first == A).float().mean()) - 0.7) < 0.01
    assert p_value_first_token_is_a(first, 0.7) > ALPHA
    assert p_value_first_token_is_a(first, 0.85) < 1e-12


def test_async_topk_is_lossless(drafts):
    x1, x2 = drafts
    lengths, capacities = async_lengths(x1, cost_table())
    x1_np = x1.numpy()
    # K of round t is the global argmax of round t-2's curve: 2 after A (Theta_2 = 1.134), 0 after B
    assert np.array_equal(capacities[2:], np.where(x1_np[:-2] == A, 2, 0))
    # x_1 is admitted (l >= 1) independently of x_1 itself: a 2x2 contingency test does not reject
    admitted = lengths >= 1
    table = [[int((admitted & (x1_np == t)).sum()), int((~admitted & (x1_np == t)).sum())] for t in (A, B)]
    assert chi2_contingency(table).pvalue > ALPHA
    assert 0.4 < admitted.mean() < 0.6  # it does verify drafts (about half the rounds), not nothing
    first = first_output_tokens(x1, x2, lengths, seed=3)
    assert abs(float((first == A).float().mean()) - 0.7) < 0.01
    assert p_value_first_token_is_a(first, 0.7) > ALPHA
    assert p_value_first_token_is_a(first, 0.85) < 1e-12
