"""Block verification: the accepted prefix of a whole block decided at once (Sun et al., 2024,
"Block Verification Accelerates Speculative Decoding"), for sampled requests.

Token-by-token rejection sampling (`dspark.rejection`) stops at the first rejected draft, even when
the drafts after it would have been worth keeping together. Block verification keeps the output
distribution exactly the target's as well, and accepts at least as many drafts in expectation over
the drafted blocks (a given block may keep fewer than under the token rule); with one draft it is
the token rule. Measured on the shipped drafter: docs/results/block_verification.md.

For one request with drafts x_1..x_l (l >= 1), target distributions P_1..P_{l+1} and draft
distributions Q_1..Q_l (1-based positions, P_k and Q_k the distributions x_k sees):
- acceptance weight: w_0 = 1, w_i = min(1, w_{i-1} * P_i(x_i) / Q_i(x_i));
- residual mass: m_i = sum_x max(w_i P_{i+1}(x) - Q_{i+1}(x), 0) for 0 <= i < l;
- stop probability: h_i = m_i / (m_i + 1 - w_i) for 1 <= i < l (0 where both terms vanish),
  h_l = w_l;
- accepted prefix: tau = the largest i in 1..l with u_i < h_i, else 0 (u_i: the uniform of draft i,
  the same draw the token rule uses for it);
- next token: tau = l: the bonus, from P_{l+1}; otherwise from the residual at tau,
  normalise(max(w_tau P_{tau+1} - Q_{tau+1}, 0)) (at tau = 0 the token rule's residual).
The threshold test is written without the division: u_i (m_i + 1 - w_i) < m_i.

Greedy requests never come here: with one-hot P and Q the rule is the token rule (accept while
x_k = argmax), which `dspark.rejection.verify` computes without any distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.sampling import sample_from_probs


@dataclass
class BlockOutcome:
    """The verdict for the requests of one call."""

    num_accepted: torch.Tensor  # [m] int64, 0..l_r
    next_tokens: torch.Tensor  # [m] int64: residual sample at tau, or the bonus when tau = l_r


def acceptance_weights(ratio: torch.Tensor, draft_lens: torch.Tensor,
                       width: int | None = None) -> torch.Tensor:
    """w_i after each draft: ratio [n_d] = P_i(x_i) / Q_i(x_i) per draft row (requests in
    order, l_r rows each), draft_lens [m] -> [n_d] (row i of request r holds w_{i+1}).
    `width`: the largest l_r, when the caller knows it on the host (else read from the device).
    Static shapes otherwise: no device read."""
    m, num_drafts = draft_lens.shape[0], ratio.shape[0]
    if width is None:
        width = int(draft_lens.max()) if m else 0
    starts = torch.cumsum(draft_lens, 0) - draft_lens  # [m]
    position = torch.arange(width, device=ratio.device)
    valid = position.unsqueeze(0) < draft_lens.unsqueeze(1)  # [m, width]
    rows = (starts.unsqueeze(1) + position).clamp_max(max(num_drafts - 1, 0))  # [m, width]
    padded = torch.where(valid, ratio[rows], torch.ones((), dtype=ratio.dtype))  # [m, width]
    weights = torch.empty_like(padded)
    running = torch.ones(m, dtype=ratio.dtype, device=ratio.device)
    for i in range(width):  # width <= gamma
        running = torch.clamp_max(running * padded[:, i], 1.0)
        weights[:, i] = running
    # Back to the draft rows (the valid cells, row-major), by index rather than by mask.
    request_of_draft = torch.repeat_interleave(torch.arange(m, device=ratio.device), draft_lens,
                                               output_size=num_drafts)  # [n_d]
    position_of_draft = (torch.arange(num_drafts, device=ratio.device)
                         - starts[request_of_draft])  # [n_d]
    return weights[request_of_draft, position_of_draft]


def residual_masses(weights_before: torch.Tensor, target_probs: torch.Tensor,
                    draft_probs: torch.Tensor) -> torch.Tensor:
    """m = sum_x max(w P(x) - Q(x), 0) per draft row, written as w - sum_x min(w P(x), Q(x)):
    only the draft's support counts, so P and Q may be given on it alone.

    weights_before [n]; target_probs, draft_probs [n, k]: P and Q of each row at the same k
    columns (the whole vocabulary, or the draft's support; a repeated column with Q = 0, as
    padding leaves, adds nothing) -> [n]."""
    overlap = torch.minimum(weights_before.unsqueeze(1) * target_probs, draft_probs).sum(dim=1)
    return (weights_before - overlap).clamp_min(0.0)


def stop_probabilities(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                       draft_tokens: torch.Tensor) -> torch.Tensor:
    """h_1..h_l of one request: target_probs [l + 1, V], draft_probs [l, V], draft_tokens [l]
    -> [l]. P(tau = i) = h_i prod_{j > i} (1 - h_j): what the uniforms decide in
    accepted_lengths."""
    l = draft_tokens.shape[0]
    rows = torch.arange(l)
    ratio = target_probs[rows, draft_tokens] / draft_probs[rows, draft_tokens]  # [l]
    weights = acceptance_weights(ratio, torch.tensor([l]))  # [l]: w_1..w_l
    masses = residual_masses(weights[:-1], target_probs[1:l], draft_probs[1:])  # [l - 1]: m_1..
    denominator = masses + 1.0 - weights[:-1]
    h = torch.where(denominator > 0, masses / denominator.clamp_min(1e-30), 0.0)
    return torch.cat([h, weights[-1:]])


def accepted_lengths(weights: torch.Tensor, masses: torch.Tensor, draft_lens: torch.Tensor,
                     accept_uniform: torch.Tensor) -> torch.Tensor:
    """tau of every request: weights [n_d] (w_i after draft i), masses [n_d] (row i: m_{i-1},
    the residual mass with the weight before draft i), accept_uniform [n_d], draft_lens [m]
    -> [m] int64 in 0..l_r."""
    m = draft_lens.shape[0]
    device = weights.device
    request_of_draft = torch.repeat_interleave(torch.arange(m, device=device), draft_lens,
                                               output_size=weights.shape[0])  # [n_d]
    starts = torch.cumsum(draft_lens, 0) - draft_lens  # [m]
    position = torch.arange(weights.shape[0], device=device) - starts[request_of_draft]  # [n_d]
    last = position == draft_lens[request_of_draft] - 1  # [n_d]
    next_mass = masses.roll(-1)  # [n_d] m_i, read where draft i is not the last
    # u_i < h_i, without the division: u_i (m_i + 1 - w_i) < m_i; the last draft: u_l < w_l.
    stops = torch.where(last, accept_uniform < weights,
                        accept_uniform * (next_mass + 1.0 - weights) < next_mass)  # [n_d]
    return torch.zeros(m, dtype=torch.int64, device=device).scatter_reduce_(
        0, request_of_draft, torch.where(stops, position + 1, 0), reduce="amax")


def weights_before(weights: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """w before each draft row: 1 for a request's first draft, the previous row's w after it
    otherwise: weights [n_d], draft_lens [m] -> [n_d]."""
    num_drafts = weights.shape[0]
    starts = torch.cumsum(draft_lens, 0) - draft_lens  # [m]
    # A request without drafts starts where the next one does (whose first row it marks
    # again), or past the last row (the spare cell).
    first = torch.zeros(num_drafts + 1, dtype=torch.bool, device=weights.device)
    first[starts] = True
    return torch.where(first[:num_drafts], torch.ones_like(weights), weights.roll(1))


def block_residual(weight: torch.Tensor, target_probs: torch.Tensor,
                   draft_probs: torch.Tensor) -> torch.Tensor:
    """normalise(max(w P - Q, 0)) row-wise: weight [n], target_probs and draft_probs [n, V] ->
    [n, V]. A residual that vanishes in floating point is reached with probability zero; such a
    row falls back to P."""
    residual = (weight.unsqueeze(1) * target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs)


def block_verify_reference(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                           draft_tokens: torch.Tensor, draft_lens: torch.Tensor,
                           accept_uniform: torch.Tensor, sample_uniform: torch.Tensor
                           ) -> BlockOutcome:
    """The module docstring read literally, one request at a time: target_probs [n_d + m, V]
    (l_r + 1 rows per request), draft_probs [n_d, V] dense, draft_tokens and accept_uniform
    [n_d], draft_lens and sample_uniform [m]."""
    num_accepted, next_tokens = [], []
    draft_row = 0
    for r, l in enumerate(draft_lens.tolist()):
        P = target_probs[draft_row + r: draft_row + r + l + 1]  # [l + 1, V]
        Q = draft_probs[draft_row: draft_row + l]  # [l, V]
        x = draft_tokens[draft_row: draft_row + l].tolist()
        u = accept_uniform[draft_row: draft_row + l]
        w = [torch.ones((), dtype=P.dtype)]
        for i in range(1, l + 1):
            w.append(torch.clamp_max(w[i - 1] * (P[i - 1, x[i - 1]] / Q[i - 1, x[i - 1]]), 1.0))
        tau = 0
        for i in range(l, 0, -1):
            if i == l:
                keep = bool(u[i - 1] < w[l])
            else:
                mass = (w[i] * P[i] - Q[i]).clamp_min(0.0).sum()
                keep = bool(u[i - 1] * (mass + 1.0 - w[i]) < mass)
            if keep:
                tau = i
                break
        if tau == l:
            dist = P[l]
        else:
            residual = (w[tau] * P[tau] - Q[tau]).clamp_min(0.0)
            dist = residual / residual.sum() if float(residual.sum()) > 0 else P[tau]
        token = sample_from_probs(dist.unsqueeze(0), sample_uniform[r: r + 1])
        num_accepted.append(tau)
        next_tokens.append(int(token))
        draft_row += l
    return BlockOutcome(torch.tensor(num_accepted, dtype=torch.int64),
                        torch.tensor(next_tokens, dtype=torch.int64))
