"""The Markov head's bigram start: W1[a] W2^T reproduces log P_s(b | a) computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.training.markov_init import bigram_counts, markov_factors, pmi_matrix

SEQUENCES = [[0, 1, 2, 1, 2, 3], [1, 2, 0, 1], [4, 4, 1]]  # vocabulary of 6; token 5 never occurs
SMOOTHING = 2.0


def smoothed_conditional(a: int, b: int, vocab: int) -> float:
    """By hand: P(b) add-one smoothed over successors, P_s(b|a) = (c_ab + s P(b)) / (c_a + s)."""
    pairs = [(x, y) for seq in SEQUENCES for x, y in zip(seq, seq[1:])]
    successors = [y for _, y in pairs]
    p_b = (successors.count(b) + 1) / (len(successors) + vocab)
    c_ab = sum(1 for x, y in pairs if x == a and y == b)
    c_a = sum(1 for x, _ in pairs if x == a)
    return (c_ab + SMOOTHING * p_b) / (c_a + SMOOTHING), p_b


def test_counts():
    prev_ids, pairs, unigram = bigram_counts(SEQUENCES, torch.arange(6))
    assert prev_ids.tolist() == [0, 1, 2, 4]  # 3 and 5 never precede anything
    assert pairs[1].tolist() == [0, 0, 3, 0, 0, 0]  # 1 -> 2 three times
    assert pairs[3].tolist() == [0, 1, 0, 0, 1, 0]  # 4 -> 4, 4 -> 1
    assert unigram.tolist() == [1, 4, 3, 1, 1, 0]


def test_full_rank_factors_give_the_smoothed_bigram():
    vocab = 6
    w1, w2 = markov_factors(SEQUENCES, torch.arange(vocab), vocab, rank=vocab + 1,
                            smoothing=SMOOTHING)
    bias = w1 @ w2.T  # [V, V_d]
    for a in range(vocab):
        for b in range(vocab):
            cond, p_b = smoothed_conditional(a, b, vocab)
            seen = a in (0, 1, 2, 4)
            expected = math.log(cond) if seen else math.log(p_b)  # unseen: the unigram
            assert bias[a, b].item() == pytest.approx(expected, abs=1e-4), (a, b)


def test_reduced_draft_vocabulary_drops_outside_successors():
    t2d = torch.tensor([-1, 0, 1, -1, 2, -1])  # draft vocabulary = target ids 1, 2, 4
    prev_ids, pairs, unigram = bigram_counts(SEQUENCES, t2d)
    assert pairs.shape == (prev_ids.numel(), 3)
    assert unigram.tolist() == [4, 3, 1]
    w1, w2 = markov_factors(SEQUENCES, t2d, 6, rank=4)
    assert w1.shape == (6, 4) and w2.shape == (3, 4)
    m = pmi_matrix(pairs, unigram)
    assert torch.isfinite(m).all()
