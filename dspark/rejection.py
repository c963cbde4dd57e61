"""Lossless verification: batched rejection sampling with a bonus token (docs/design.md section 5).

Glossary
- anchor token x0: the last token already produced; the target sees it first in every round.
- draft tokens x_1..x_l: the l_r tokens admitted for verification for request r (l_r = 0 allowed:
  an ordinary decoding step).
- draft distribution p^d_k: exactly the distribution x_k was sampled from (after temperature,
  top-k, truncation), dense [V] or sparse (indices, probabilities).
- target distribution p^t_k: the target's distribution at draft position k after the request's
  sampling transform (dspark.sampling.probs_from_logits); row k of the l_r + 1 target rows.
- accepted tokens: x_k is accepted with probability min(1, p^t_k(x_k) / p^d_k(x_k)), in order,
  until the first rejection.
- recovered token: at the first rejected position k, a token drawn from
  normalise(max(p^t_k - p^d_k, 0)); the round ends there.
- bonus token: when all l_r drafts are accepted, a token drawn from p^t_{l_r + 1}.
Output of a round for request r: the accepted drafts, then the recovered or bonus token, so every
round produces between 1 and l_r + 1 tokens, distributed exactly as the target would produce them.
Greedy requests (temperature 0) have one-hot target rows, for which the same rule reduces to
"accept iff x_k = argmax, next token = argmax", independent of the random draws.

Flattened batch layout (no padding): request r owns draft rows
[draft_start[r], draft_start[r] + l_r) of `draft_tokens`/`draft_probs`, and target rows
[draft_start[r] + r, draft_start[r] + r + l_r + 1) of `target_logits`.

Randomness is explicit (`RandomDraws`): one uniform per draft for the accept test and one per
request for the recovered/bonus sample, so the batched `verify` and the per-request
`verify_reference` can be held equal on the same draws. `dspark.random_draws.draw_uniforms` keys
them by the request's seed and its anchor's position, so they never depend on the batch or on
earlier rounds.

Draft distributions, dense or sparse, and their packing into one flattened batch:
dspark.draft_packing. This module is the maths only.

`VerificationRule.BLOCK` verifies the sampled requests' blocks as a whole instead
(`dspark.block_verification`): the same draws, the same output distribution, at least as many
accepted drafts in expectation. Greedy requests follow the token rule under both.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import torch

from dspark.block_verification import (
    BlockOutcome,
    acceptance_weights,
    accepted_lengths,
    block_residual,
    block_verify_reference,
    residual_masses,
    weights_before,
)
from dspark.draft_packing import (
    DraftProbs,
    SparseDraftProbs,
    dense_draft_rows,
    draft_prob_of_tokens,
    draft_support,
)
from dspark.random_draws import (
    CounterGenerator,
    Purpose,
    RandomDraws,
    draw_uniforms,  # noqa: F401 (verify's callers draw with it; it lives in random_draws)
    keyed_uniforms,
    seed_tensor,
)
from dspark.sampling import (
    SamplingParams,
    SamplingTensors,
    argmax_first,
    probs_at_columns,
    probs_from_logits,
    sample_from_probs,
    token_probs_from_logits,
)


class VerificationRule(str, Enum):
    """How a sampled request's drafts are accepted (greedy requests: the token rule always)."""

    TOKEN = "token"
    """Token by token, stopping at the first rejection (docs/design.md section 5)."""
    BLOCK = "block"
    """The accepted prefix of the whole block at once (dspark.block_verification)."""
    DRAFTER_INVARIANT = "drafter-invariant"
    """Gumbel-max with position-keyed noise shared by drafter and target, a draft accepted iff it
    equals the target's sample (dspark.gumbel_verification): a seeded request's output equals
    target-only decoding with the same seed, whatever the drafter and policy. Opt-in: it
    accepts fewer drafts than the token rule."""


@dataclass
class VerifyBatch:
    """Everything one verification step needs, for all requests at once."""

    draft_tokens: torch.Tensor  # [num_drafts] int64, requests in order
    draft_lens: torch.Tensor  # [num_requests] int64, l_r >= 0, on the host (verify copies it)
    draft_probs: DraftProbs  # [num_drafts, vocab_size] dense, or SparseDraftProbs
    target_logits: torch.Tensor  # [num_drafts + num_requests, vocab_size]
    sampling: Sequence[SamplingParams]  # [num_requests]

    def __post_init__(self) -> None:
        num_requests = self.draft_lens.shape[0]
        num_drafts = int(self.draft_lens.sum())
        if self.draft_tokens.shape != (num_drafts,):
            raise ValueError(f"draft_tokens has shape {tuple(self.draft_tokens.shape)}, "
                             f"expected ({num_drafts},) = sum of draft_lens")
        if bool((self.draft_lens < 0).any()):
            raise ValueError("draft_lens must be >= 0")
        if self.target_logits.shape[0] != num_drafts + num_requests:
            raise ValueError(f"target_logits has {self.target_logits.shape[0]} rows, expected "
                             f"{num_drafts + num_requests} (l_r + 1 per request)")
        rows = (self.draft_probs.indices.shape[0] if isinstance(self.draft_probs, SparseDraftProbs)
                else self.draft_probs.shape[0])
        if rows != num_drafts:
            raise ValueError(f"draft_probs has {rows} rows, expected {num_drafts}")
        if len(self.sampling) != num_requests:
            raise ValueError(f"{len(self.sampling)} sampling params for {num_requests} requests")

    @property
    def num_requests(self) -> int:
        return self.draft_lens.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[1]

    def draft_start(self) -> torch.Tensor:
        """[num_requests]: index of each request's first draft row."""
        return torch.cumsum(self.draft_lens, 0) - self.draft_lens


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [num_requests] int64, 0..l_r
    next_tokens: torch.Tensor  # [num_requests] int64: recovered token, or bonus when all accepted
    drafts_invalid: torch.Tensor | None = None
    """[] bool on an accelerator: some draft token has probability 0 under its draft
    distribution (`to_host` raises); None when checked already (on the CPU, by `verify`)."""

    def output_tokens(self, batch: VerifyBatch) -> list[list[int]]:
        """Per request: the accepted drafts, then the recovered or bonus token."""
        return self.to_host(batch)[1]

    def to_host(self, batch: VerifyBatch) -> tuple[list[int], list[list[int]]]:
        """(num_accepted [R], output tokens per request: the accepted drafts, then the recovered
        or bonus token), read from the device in one copy."""
        r = batch.num_requests
        lens = batch.draft_lens.tolist()
        device = self.num_accepted.device
        check = ([] if self.drafts_invalid is None
                 else [self.drafts_invalid.to(torch.int64).view(1)])
        flat = torch.cat([self.num_accepted, self.next_tokens,
                          batch.draft_tokens.to(device), *check]).tolist()
        if check:
            _check_drafts(bool(flat.pop()))
        accepted, nexts, drafts = flat[:r], flat[r:2 * r], flat[2 * r:]
        out, start = [], 0
        for n, length, t in zip(accepted, lens, nexts):
            out.append(drafts[start:start + n] + [t])
            start += length
        return accepted, out


def sample_first_tokens(logits: torch.Tensor, sampling: SamplingTensors,
                        generators: Sequence[CounterGenerator], prompt_lengths: Sequence[int],
                        rule: VerificationRule = VerificationRule.TOKEN) -> torch.Tensor:
    """The first token after each prompt, from its last logits: logits [F, V], sampling [F],
    generators [F], prompt_lengths [F] (P: the token lands at position P) -> [F] token ids.

    Token and block rules: the NEXT uniform of "anchor" P - 1 (the prompt's last token). The
    drafter-invariant rule: Gumbel-max at position P, as every later token of that rule.
    """
    device = logits.device
    seeds = seed_tensor(generators, device)  # [F]
    lengths = torch.as_tensor(list(prompt_lengths), dtype=torch.int64, device=device)  # [F]
    if rule is VerificationRule.DRAFTER_INVARIANT:
        from dspark.gumbel_verification import sample_first_tokens as gumbel_first_tokens
        return gumbel_first_tokens(logits, sampling, seeds, lengths)
    uniforms = keyed_uniforms(seeds, lengths - 1, torch.zeros_like(lengths), Purpose.NEXT)
    return sample_from_probs(probs_from_logits(logits, sampling), uniforms)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalise(max(p^t - p^d, 0)) row-wise: [n, V], [n, V] -> [n, V].

    A rejection can only happen where p^t(x) < p^d(x), which makes the residual mass positive; a
    row whose residual vanishes in floating point falls back to p^t (it is reached with
    probability zero).
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)  # [n, V]
    mass = residual.sum(dim=1, keepdim=True)  # [n, 1]
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs)


def verify(batch: VerifyBatch, draws: RandomDraws,
           rule: VerificationRule = VerificationRule.TOKEN) -> VerifyResult:
    """Batched lossless rejection sampling over a flattened batch (the fast path).

    Branches, row selections and shapes are chosen from what the host knows (draft lengths,
    sampling params), not by reading the device: under every rule nothing is read off the CPU
    (top-k and top-p rows included: `dspark.sampling`; tests/test_host_syncs.py counts it). The
    check that every draft has probability > 0 is read here on the CPU and with the results
    (`VerifyResult.to_host`) on an accelerator."""
    if rule is VerificationRule.DRAFTER_INVARIANT:
        from dspark.gumbel_verification import verify_invariant
        return verify_invariant(batch, draws)
    lens = batch.draft_lens.tolist()  # [R] host ints (draft_lens lives on the host)
    num_requests, vocab_size = batch.num_requests, batch.vocab_size
    num_drafts = sum(lens)
    if num_drafts == 0 and (rule is VerificationRule.TOKEN or all(p.is_greedy for p in batch.sampling)):
        return _decode_steps(batch, draws)
    device = batch.target_logits.device
    draft_lens = batch.draft_lens.to(device, non_blocking=True)  # [num_requests]
    request_ids = torch.arange(num_requests, device=device)
    draft_start = torch.cumsum(draft_lens, 0) - draft_lens  # [num_requests]
    req_of_draft = torch.repeat_interleave(request_ids, draft_lens,
                                           output_size=num_drafts)  # [num_drafts]
    draft_rows = torch.arange(num_drafts, device=device)  # [num_drafts]
    pos_in_request = draft_rows - draft_start[req_of_draft]  # [num_drafts], 0-based k-1
    target_row_of_draft = draft_rows + req_of_draft  # [num_drafts]

    # p^t_k(x_k) for every draft the token rule tests, without building the full distributions
    # of accepted rows (under the block rule: the greedy requests' drafts only).
    request_sampling = SamplingTensors.from_params(batch.sampling, device=device)
    is_greedy = [p.is_greedy for p in batch.sampling]  # [R] host
    sampled_ids = [r for r, g in enumerate(is_greedy) if not g]
    by_blocks = rule is VerificationRule.BLOCK and bool(sampled_ids)
    # Every row's argmax, once, when a request is greedy: its drafts' test and its next token.
    row_argmax = argmax_first(batch.target_logits, dim=1) if any(is_greedy) else None
    draft_sampling = request_sampling.repeat(draft_lens, num_drafts)  # [num_drafts]
    p_draft = draft_prob_of_tokens(batch.draft_probs, batch.draft_tokens)  # [num_drafts]
    drafts_invalid = (p_draft <= 0).any()  # [] bool
    if device.type == "cpu":  # reading it costs nothing here; on a device it rides in to_host
        _check_drafts(bool(drafts_invalid))
        drafts_invalid = None
    accepted = torch.ones_like(p_draft, dtype=torch.bool)  # [num_drafts]
    if by_blocks:  # the token rule tests the greedy requests' drafts only
        starts = [0, *itertools.accumulate(lens)]
        tested = _host_index([i for r, n in enumerate(lens) if is_greedy[r]
                              for i in range(starts[r], starts[r] + n)], device)
    else:
        tested = None
    if num_drafts and (tested is None or tested.shape[0]):
        sel = slice(None) if tested is None else tested
        p_target = token_probs_from_logits(
            batch.target_logits, batch.draft_tokens[sel],
            draft_sampling if tested is None else draft_sampling.select(tested),
            rows=target_row_of_draft[sel], row_argmax=row_argmax)  # [tested drafts]
        # Accept x_k iff u_k < p^t_k(x_k) / p^d_k(x_k), written without the division.
        accepted[sel] = draws.accept_uniform.to(device)[sel] * p_draft[sel] < p_target

    # Accepted prefix length = position of the first rejection (l_r when none).
    reject_pos = torch.where(accepted, draft_lens[req_of_draft], pos_in_request)  # [num_drafts]
    num_accepted = draft_lens.clone().scatter_reduce_(0, req_of_draft, reject_pos, reduce="amin")

    # The next token comes from the residual at the first rejection, or from p^t_{l+1} (bonus).
    # Greedy requests: the argmax either way (a rejected greedy draft is never the argmax).
    next_rows = draft_start + num_accepted + request_ids  # [num_requests] target rows
    next_tokens = (row_argmax[next_rows] if row_argmax is not None
                   else torch.zeros(num_requests, dtype=torch.int64, device=device))
    if by_blocks:
        which = _host_index(sampled_ids, device)  # [m]
        outcome = _verify_sampled_blocks(batch, draws, sampled_ids, which, lens, p_draft,
                                         request_sampling, req_of_draft, draft_lens, draft_start)
        num_accepted[which] = outcome.num_accepted
        next_tokens[which] = outcome.next_tokens
    elif sampled_ids:
        which = _host_index(sampled_ids, device)  # [m]
        sub = request_sampling.select(which)
        next_dist = probs_from_logits(batch.target_logits[next_rows[which]], sub)  # [m, V]
        if any(lens[r] for r in sampled_ids):
            # The residual at the first rejection, for every sampled request, kept where one
            # was rejected (no device read of which ones were).
            rejected = (num_accepted < draft_lens)[which]  # [m]
            draft_row = (draft_start + num_accepted)[which].clamp_max(num_drafts - 1)  # [m]
            residual = residual_distribution(
                next_dist, dense_draft_rows(batch.draft_probs, draft_row, vocab_size))
            next_dist = torch.where(rejected.unsqueeze(1), residual, next_dist)
        next_tokens[which] = sample_from_probs(next_dist, draws.sample_uniform.to(device)[which])
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens,
                        drafts_invalid=drafts_invalid)


def _decode_steps(batch: VerifyBatch, draws: RandomDraws) -> VerifyResult:
    """`verify` of a round without drafts (target-only decoding, or no draft admitted), as its
    general path computes it without the draft bookkeeping (~25 operators): one logits row per
    request, a greedy request's next token its row's argmax, a sampled request's drawn from its
    row's distribution with its next-token uniform; nothing accepted."""
    logits = batch.target_logits  # [R, V]
    device = logits.device
    is_greedy = [p.is_greedy for p in batch.sampling]  # [R] host
    next_tokens = (argmax_first(logits, dim=1) if any(is_greedy)
                   else torch.zeros(batch.num_requests, dtype=torch.int64, device=device))  # [R]
    sampled_ids = [r for r, g in enumerate(is_greedy) if not g]
    if sampled_ids:
        which = _host_index(sampled_ids, device)  # [m]
        sub = SamplingTensors.from_params(batch.sampling, device=device).select(which)
        next_tokens[which] = sample_from_probs(probs_from_logits(logits[which], sub),
                                               draws.sample_uniform.to(device)[which])
    return VerifyResult(num_accepted=torch.zeros(batch.num_requests, dtype=torch.int64, device=device),
                        next_tokens=next_tokens)


def _check_drafts(invalid: bool) -> None:
    if invalid:
        raise ValueError("a draft token has zero probability under its draft distribution: "
                         "draft_probs must be the distribution the token was sampled from")


def _host_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """An index tensor built on the host and copied to `device` (no device read)."""
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def _at_token_columns(values: torch.Tensor, support: torch.Tensor, q_support: torch.Tensor,
                      tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """values [n, k] on the support [n, k] read at each row's token [n]: the token's one column
    with Q > 0 (padding repeats token 0 with Q = 0) -> [n]."""
    if support.shape[0] > 0 and support.stride(0) == 0:  # one support row for all
        column_of = torch.full((vocab_size,), 0, dtype=torch.int64, device=support.device)
        column_of[support[0]] = torch.arange(support.shape[1], device=support.device)
        return values.gather(1, column_of[tokens].unsqueeze(1)).squeeze(1)
    hit = (support == tokens.unsqueeze(1)) & (q_support > 0)  # [n, k]
    return (values * hit).sum(dim=1)


def _verify_sampled_blocks(batch: VerifyBatch, draws: RandomDraws, sampled_ids: Sequence[int],
                           which: torch.Tensor, lens: Sequence[int], p_draft: torch.Tensor,
                           request_sampling: SamplingTensors, req_of_draft: torch.Tensor,
                           draft_lens: torch.Tensor, draft_start: torch.Tensor) -> BlockOutcome:
    """Block verification (dspark.block_verification) of the sampled requests `sampled_ids`
    [m] (host; `which`: the same on the device); lens [num_requests]: draft_lens on the host;
    p_draft [num_drafts]: p^d_k(x_k) of every draft; request_sampling [num_requests];
    req_of_draft [num_drafts]: each draft's request; draft_lens, draft_start [num_requests] on
    the logits' device. The residual masses read the target's distribution on each draft's
    support only. Rows and branches come from the host's lengths: nothing is read off the
    device, every shape is known before the device computes it."""
    device = batch.target_logits.device
    starts_host = [0, *itertools.accumulate(lens)]
    sampled_lens = [lens[r] for r in sampled_ids]  # [m] host
    num_sampled_drafts = sum(sampled_lens)
    rows = _host_index([i for r in sampled_ids
                        for i in range(starts_host[r], starts_host[r + 1])], device)  # [n_d]
    block_lens = draft_lens[which]  # [m]
    target_rows = rows + req_of_draft[rows]  # [n_d] P_i of each draft
    sampling = request_sampling.select(which)  # [m]
    draft_sampling = sampling.repeat(block_lens, num_sampled_drafts)  # [n_d]
    support, q_support = draft_support(batch.draft_probs, rows, batch.vocab_size)  # [n_d, k]
    tokens = batch.draft_tokens[rows]  # [n_d]
    p_support = probs_at_columns(batch.target_logits, support, draft_sampling,
                                 target_rows)  # [n_d, k]
    p_token = _at_token_columns(p_support, support, q_support, tokens, batch.vocab_size)
    weights = acceptance_weights(p_token / p_draft[rows], block_lens,
                                 max(sampled_lens, default=0))  # [n_d] w_i
    before = weights_before(weights, block_lens)  # [n_d] w_{i-1}
    masses = residual_masses(before, p_support, q_support)  # [n_d] m_{i-1}
    num_accepted = accepted_lengths(weights, masses, block_lens,
                                    draws.accept_uniform.to(device)[rows])  # [m]

    # The next token: the bonus row when every draft is kept, else the residual at tau.
    starts = draft_start[which]  # [m] first draft row of each
    next_rows = starts + num_accepted + which  # [m] target row P_{tau + 1}
    dist = probs_from_logits(batch.target_logits[next_rows], sampling)  # [m, V]
    if num_sampled_drafts:
        # The residual at tau of every request, kept where its block was cut (no device read
        # of which ones were); a request kept whole reads some row in range, then drops it.
        cut = num_accepted < block_lens  # [m]
        num_drafts = batch.draft_tokens.shape[0]
        cut_rows = (starts + num_accepted).clamp_max(num_drafts - 1)  # [m] Q_{tau + 1}'s row
        local = torch.searchsorted(rows, cut_rows).clamp_max(num_sampled_drafts - 1)  # [m]
        residual = block_residual(before[local], dist,
                                  dense_draft_rows(batch.draft_probs, cut_rows, batch.vocab_size))
        dist = torch.where(cut.unsqueeze(1), residual, dist)
    next_tokens = sample_from_probs(dist, draws.sample_uniform.to(device)[which])
    return BlockOutcome(num_accepted, next_tokens)


def verify_reference(batch: VerifyBatch, draws: RandomDraws,
                     rule: VerificationRule = VerificationRule.TOKEN) -> VerifyResult:
    """Slow, obviously-correct per-request loop: docs/design.md section 5 read literally (a sampled
    request under the block rule: `block_verify_reference` on that request alone)."""
    if rule is VerificationRule.DRAFTER_INVARIANT:
        from dspark.gumbel_verification import verify_invariant_reference
        return verify_invariant_reference(batch, draws)
    vocab_size = batch.vocab_size
    num_accepted, next_tokens = [], []
    draft_row = 0
    for r, (n, params) in enumerate(zip(batch.draft_lens.tolist(), batch.sampling)):
        target_row = draft_row + r
        rows = SamplingTensors.from_params([params] * (n + 1))
        p_t = probs_from_logits(batch.target_logits[target_row:target_row + n + 1], rows)  # [n+1, V]
        if rule is VerificationRule.BLOCK and not params.is_greedy:
            outcome = block_verify_reference(
                p_t, dense_draft_rows(batch.draft_probs, torch.arange(draft_row, draft_row + n),
                                      vocab_size),
                batch.draft_tokens[draft_row:draft_row + n], torch.tensor([n]),
                draws.accept_uniform[draft_row:draft_row + n], draws.sample_uniform[r:r + 1])
            num_accepted.append(int(outcome.num_accepted[0]))
            next_tokens.append(int(outcome.next_tokens[0]))
            draft_row += n
            continue
        accepted = 0
        next_dist = p_t[n]  # bonus, unless a rejection happens first
        for k in range(n):
            x = int(batch.draft_tokens[draft_row + k])
            p_d = dense_draft_rows(batch.draft_probs, torch.tensor([draft_row + k]), vocab_size)[0]
            # float32, like the fast path: u * p^d(x) < p^t(x)  <=>  u < p^t(x) / p^d(x)
            if bool(draws.accept_uniform[draft_row + k].float() * p_d[x] < p_t[k, x]):
                accepted += 1
                continue
            next_dist = residual_distribution(p_t[k:k + 1], p_d.unsqueeze(0))[0]
            break
        token = sample_from_probs(next_dist.unsqueeze(0), draws.sample_uniform[r:r + 1])
        num_accepted.append(accepted)
        next_tokens.append(int(token))
        draft_row += n
    return VerifyResult(torch.tensor(num_accepted, dtype=torch.int64),
                        torch.tensor(next_tokens, dtype=torch.int64))
