"""The drafter-invariant verification rule: Gumbel-max sampling with noise keyed by position
(Daliri, Musco and Suresh, "Coupling without communication and drafter-invariant speculative
decoding", 2024).

Glossary (as dspark.rejection)
- output position p: where a token lands in the request's sequence; a round whose anchor sits
  at n verifies drafts x_1..x_l at positions n + 1..n + l, and its last target row predicts
  position n + l + 1.
- shared noise G(seed, p, v): standard Gumbel noise of token v at position p
  (dspark.random_draws.gumbel_noise), the same for the drafter and the target.
- the target's sample at p: y_p = argmax_v log p^t_p(v) + G(seed, p, v) (Gumbel-max: exactly a
  draw from p^t_p, and the noise at p is independent of everything before p).
- the drafter's sample at p: x_p = argmax_v log p^d_p(v) + G(seed, p, v), the same noise.

Rule: accept x_k iff x_k = y_{n+k}; the round outputs the accepted drafts, then y at the first
mismatch (or the bonus y_{n+l+1} when every draft matched). Every output token is therefore y_p,
which is a function of the target's distribution at p and the noise at p only: the output is
target-only Gumbel-max decoding with the same seed, whatever the drafter drafted and however
many drafts each round verified (policy, batch, timing). It is exact for the same reason
target-only sampling is. The price is acceptance: with total variation distance d between
p^d_p and p^t_p, the Gumbel coupling matches with probability at least (1 - d) / (1 + d) (the
paper's bound; no communication-free coupling does better in the worst case), where the token
rule accepts with probability exactly 1 - d.

Target-only decoding under this rule (policy none, and the first token after a prompt) samples
by the same Gumbel-max, so that the identity holds (`sample_first_tokens`).
"""

from __future__ import annotations

import dataclasses

import torch

from dspark.random_draws import CounterGenerator, gumbel_noise
from dspark.sampling import SamplingParams, SamplingTensors, argmax_first, probs_from_logits


def request_generator(sampling: SamplingParams, rule) -> CounterGenerator:
    """A request's generator (dspark.random_draws) under the verifier's rule: under the
    drafter-invariant rule its drafts are Gumbel-max samples with the target's noise."""
    generator = sampling.generator()
    if getattr(rule, "value", rule) == "drafter-invariant":
        generator = dataclasses.replace(generator, shared_noise=True)
    return generator


def gumbel_argmax(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel-max samples: probs [n, k] over the columns `token_ids` [n, k] (None: the whole
    vocabulary, k = V), seeds and positions [n] int64 -> [n] column indices (int64)."""
    n, k = probs.shape
    if token_ids is None:
        token_ids = torch.arange(k, device=probs.device).expand(n, k)
    noise = gumbel_noise(seeds, positions, token_ids)  # [n, k]
    return argmax_first(torch.log(probs.float()) + noise, dim=1)  # log 0 = -inf: never chosen


def target_samples(logits: torch.Tensor, sampling: SamplingTensors, seeds: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """The target's sample y_p of each row: logits [n, V], sampling [n], seeds and positions [n]
    -> [n] token ids. Greedy rows take the argmax (the noise cannot move a one-hot's argmax).
    Every row is computed both ways a kind present needs and the row's own kept: which kinds
    are present comes from the host (`sampling.kinds`; unknown: both), nothing is read off
    the device."""
    kinds = sampling.kinds
    has_greedy = kinds is None or kinds.greedy
    has_sampled = kinds is None or kinds.sampled
    argmax = argmax_first(logits, dim=1) if has_greedy else None  # [n]
    if not has_sampled:
        return argmax
    probs = probs_from_logits(logits, sampling)  # [n, V] (greedy rows one-hot, replaced below)
    sample = gumbel_argmax(probs, seeds, positions)  # [n]
    if not has_greedy:
        return sample
    return torch.where(sampling.temperature == 0.0, argmax, sample)


def verify_invariant(batch, draws):
    """The rule over a flattened batch (dspark.rejection layout): batch a VerifyBatch, draws a
    RandomDraws carrying the requests' seeds and anchor positions -> VerifyResult."""
    from dspark.rejection import VerifyResult

    if draws.seeds is None or draws.anchor_positions is None:
        raise ValueError("the drafter-invariant rule needs keyed draws (seeds and anchor "
                         "positions: dspark.random_draws.draw_uniforms)")
    device = batch.target_logits.device
    num_requests = batch.num_requests
    num_drafts = sum(batch.draft_lens.tolist())  # draft_lens lives on the host
    num_rows = num_drafts + num_requests
    lens = batch.draft_lens.to(device)  # [R]
    request_ids = torch.arange(num_requests, device=device)
    rows_per_request = lens + 1
    req_of_row = torch.repeat_interleave(request_ids, rows_per_request,
                                         output_size=num_rows)  # [num_rows]
    first_row = torch.cumsum(rows_per_request, 0) - rows_per_request  # [R]
    j = torch.arange(req_of_row.shape[0], device=device) - first_row[req_of_row]  # 0..l_r
    seeds = draws.seeds.to(device)
    anchors = draws.anchor_positions.to(device)
    sampling = SamplingTensors.from_params(batch.sampling, device=device)
    y = target_samples(batch.target_logits, sampling.repeat(rows_per_request, num_rows),
                       seeds[req_of_row], anchors[req_of_row] + 1 + j)  # [num_rows]

    draft_start = torch.cumsum(lens, 0) - lens  # [R]
    req_of_draft = torch.repeat_interleave(request_ids, lens,
                                           output_size=num_drafts)  # [num_drafts]
    draft_rows = torch.arange(req_of_draft.shape[0], device=device)
    k0 = draft_rows - draft_start[req_of_draft]  # 0-based position in the block
    matched = batch.draft_tokens.to(device) == y[draft_rows + req_of_draft]  # [num_drafts]
    first_miss = torch.where(matched, lens[req_of_draft], k0)
    num_accepted = lens.clone().scatter_reduce_(0, req_of_draft, first_miss, reduce="amin")
    next_tokens = y[first_row + num_accepted]
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens)


def verify_invariant_reference(batch, draws):
    """The rule read literally, one request and one position at a time (slow)."""
    from dspark.rejection import VerifyResult

    num_accepted, next_tokens = [], []
    draft_row = 0
    for r, (n, params) in enumerate(zip(batch.draft_lens.tolist(), batch.sampling)):
        target_row = draft_row + r
        seed = draws.seeds[r:r + 1]
        anchor = int(draws.anchor_positions[r])
        accepted, token = 0, None
        for j in range(n + 1):
            row = SamplingTensors.from_params([params])
            p = probs_from_logits(batch.target_logits[target_row + j:target_row + j + 1], row)
            y = (int(argmax_first(batch.target_logits[target_row + j])) if params.is_greedy else
                 int(gumbel_argmax(p, seed, torch.tensor([anchor + 1 + j]))[0]))
            if j < n and int(batch.draft_tokens[draft_row + j]) == y:
                accepted += 1
                continue
            token = y
            break
        num_accepted.append(accepted)
        next_tokens.append(token)
        draft_row += n
    return VerifyResult(torch.tensor(num_accepted, dtype=torch.int64),
                        torch.tensor(next_tokens, dtype=torch.int64))


def sample_first_tokens(logits: torch.Tensor, sampling: SamplingTensors, seeds: torch.Tensor,
                        prompt_lengths: torch.Tensor) -> torch.Tensor:
    """Under this rule, the first token after each prompt (position P = its length): the same
    Gumbel-max as every later token. logits [F, V], sampling [F], seeds, prompt_lengths [F]."""
    return target_samples(logits, sampling, seeds, prompt_lengths)
