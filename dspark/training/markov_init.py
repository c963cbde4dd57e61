"""Start the Markov head from the training data's bigram statistics instead of from zero.

The Markov head adds B(x_{k-1}, .) = W1[x_{k-1}] W2^T to the backbone's logits U_k. A bigram
model of the answers gives that bias directly: with U_k close to log-unigram frequencies (the first
thing the backbone learns), the right bias is the pointwise mutual information

    M[a, b] = log P(b | a) - log P(b),   b in the draft vocabulary,

plus log P(b) itself. The best rank-(r-1) approximation of M (truncated SVD, M ~ U S V^T) splits
into W1 = U S^1/2 (rows of the tokens seen as predecessors; all other rows 0) and W2 = V S^1/2,
and the last rank dimension carries the unigram: W1[:, r-1] = 1, W2[:, r-1] = log P(b). So
W1[a] W2^T ~ log P(b | a), and with the backbone's logits U_k near 0 at first (the trainer
scales the drafter's final-norm weight down, `trainer.BIGRAM_START_BACKBONE_SCALE`) the drafter
starts close to the smoothed bigram model of the answers, and the backbone then learns what the
context adds. Zero-initialised, W1 W2^T
is a saddle that gradient descent leaves slowly; on this CPU a training run is only a few hundred
steps, and a count-based bigram alone already reaches ~21% acceptance against the target's T=1
distribution on our data (about twice what the zero-initialised head had reached after 60 steps).

P(b | a) is smoothed towards P(b) with `smoothing` pseudo-counts, so rare predecessors get a bias
near 0 rather than a spike.
"""

from __future__ import annotations

from typing import Sequence

import torch


def bigram_counts(sequences: Sequence[Sequence[int]], target_to_draft: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prev, next) pairs whose next token is in the draft vocabulary.

    sequences: token ids, each predecessor followed by its successor; target_to_draft [V] int64
    (-1 outside the draft vocabulary). Returns prev_ids [P] (distinct predecessors, ascending),
    pair_counts [P, V_d] float32 and unigram counts [V_d] float32 of the successors.
    """
    prev_all, next_all = [], []
    for seq in sequences:
        s = torch.as_tensor(list(seq), dtype=torch.int64)
        if s.numel() < 2:
            continue
        prev_all.append(s[:-1])
        next_all.append(target_to_draft[s[1:]])
    prev = torch.cat(prev_all)
    nxt = torch.cat(next_all)
    inside = nxt >= 0
    prev, nxt = prev[inside], nxt[inside]
    draft_size = int(target_to_draft.max()) + 1
    prev_ids, row = torch.unique(prev, return_inverse=True)
    pairs = torch.zeros(prev_ids.numel(), draft_size)
    pairs.index_put_((row, nxt), torch.ones(nxt.numel()), accumulate=True)
    unigram = torch.bincount(nxt, minlength=draft_size).float()
    return prev_ids, pairs, unigram


def pmi_matrix(pairs: torch.Tensor, unigram: torch.Tensor, smoothing: float = 2.0) -> torch.Tensor:
    """M[a, b] = log P_s(b | a) - log P(b): pairs [P, V_d], unigram [V_d] -> [P, V_d].
    P(b) is add-one smoothed; P_s(b | a) = (c_ab + smoothing * P(b)) / (c_a + smoothing)."""
    p_b = (unigram + 1.0) / (unigram.sum() + unigram.numel())  # [V_d]
    cond = (pairs + smoothing * p_b) / (pairs.sum(dim=1, keepdim=True) + smoothing)  # [P, V_d]
    return cond.log() - p_b.log()


def markov_factors(sequences: Sequence[Sequence[int]], target_to_draft: torch.Tensor,
                   vocab_size: int, rank: int, smoothing: float = 2.0, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """W1 [vocab_size, rank] and W2 [V_d, rank] with W1[a] W2^T ~ log P(b | a): rank-(r-1) PMI
    factors plus one unigram dimension (rank >= 2)."""
    if rank < 2:
        raise ValueError("the bigram initialisation needs markov_rank >= 2")
    prev_ids, pairs, unigram = bigram_counts(sequences, target_to_draft)
    m = pmi_matrix(pairs, unigram, smoothing)  # [P, V_d]
    q = min(rank - 1, *m.shape)
    torch.manual_seed(seed)  # svd_lowrank draws a random projection
    u, s, v = torch.svd_lowrank(m, q=q, niter=4)  # u [P, q], s [q], v [V_d, q]
    root = s.sqrt()
    w1 = torch.zeros(vocab_size, rank)
    w2 = torch.zeros(m.shape[1], rank)
    w1[prev_ids, :q] = u * root
    w2[:, :q] = v * root
    w1[:, rank - 1] = 1.0
    w2[:, rank - 1] = ((unigram + 1.0) / (unigram.sum() + unigram.numel())).log()
    return w1, w2


@torch.no_grad()
def init_markov_head_from_bigrams(head: torch.nn.Module, sequences: Sequence[Sequence[int]],
                                  target_to_draft: torch.Tensor, smoothing: float = 2.0) -> None:
    """Overwrite a MarkovHead's markov_w1 / markov_w2 with the bigram PMI factors."""
    vocab_size, rank = head.markov_w1.weight.shape
    w1, w2 = markov_factors(sequences, target_to_draft.cpu(), vocab_size, rank, smoothing)
    assert w2.shape == head.markov_w2.weight.shape, (w2.shape, head.markov_w2.weight.shape)
    head.markov_w1.weight.copy_(w1.to(head.markov_w1.weight))
    head.markov_w2.weight.copy_(w2.to(head.markov_w2.weight))
