"""Sampling one block position for every request of a drafting call, exactly.

`plan_rows` groups the requests once per call (`RowPlan`): sparse rows (greedy: k = 1; a top_k
parameter or drafter-side truncation: k) draw from the renormalised top-k of their logits, dense
rows from the full draft vocabulary, each after the request's temperature, min_p and top_p
(`dspark.sampling.probs_from_logits`, the target's function) (returned sparse over it when it is reduced: its V_d target
ids are the support). `sample_block_position` then draws position k for all of
them from the uniforms `draft_uniforms` keys by each request's seed and anchor, and
`assemble_blocks` turns the positions into one `DraftBlock` per request.

Each token x_k is drawn from exactly the distribution returned for it (the draft distribution
p^d_k, see `dspark.models.draft_types`). With a reduced draft vocabulary, the logits and samples
here are in draft ids; `assemble_blocks` maps them to target ids, and tokens outside the draft
vocabulary have p^d = 0, so the distribution stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dspark.models.draft_types import DraftBlock, DraftRequest
from dspark.random_draws import (CounterGenerator, Purpose, gumbel_noise, keyed_uniforms,
                                 seed_tensor)
from dspark.sampling import (SamplingKinds, SamplingParams, SamplingTensors, argmax_first,
                             probs_from_logits, sample_from_probs)


@dataclass
class RowPlan:
    """How the requests of one drafting call sample, prepared once for all gamma positions.

    Sparse rows (greedy: k = 1; a top_k parameter or drafter-side truncation: k) draw from the
    renormalised top-k of their logits; dense rows from the full (draft) vocabulary.
    """

    num_rows: int
    sparse_rows: list[int]
    sparse_ks: list[int]
    dense_rows: list[int]
    all_greedy: bool
    sparse_index: torch.Tensor | None  # [n_sparse] row ids, None = all rows
    dense_index: torch.Tensor | None  # [n_dense] row ids, None = all rows
    sparse_params: SamplingTensors | None  # top_k off: the truncation is done by topk
    sparse_greedy: torch.Tensor | None  # [n_greedy] the greedy rows' places among the sparse rows
    beyond_k: torch.Tensor | None  # [n_sparse, k_max] bool: slots past each row's own k
    dense_params: SamplingTensors | None
    gumbel_rows: torch.Tensor | None = None
    """[R] bool: rows that draft by Gumbel-max with the target's position-keyed noise
    (CounterGenerator.shared_noise, the drafter-invariant rule); None = none does."""
    seeds: torch.Tensor | None = None  # [R] int64 each request's key, with gumbel_rows
    anchor_positions: torch.Tensor | None = None  # [R] int64, with gumbel_rows


def _select(index: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x if index is None else x[index]


def plan_rows(requests: Sequence[DraftRequest], vocab_size: int,
              sparse_top_k: int | None, device: torch.device) -> RowPlan:
    ks: list[int | None] = []
    for req in requests:
        s = req.sampling
        if s.is_greedy:
            ks.append(1)
            continue
        k = s.top_k if 0 < s.top_k < vocab_size else None
        if sparse_top_k is not None and sparse_top_k < vocab_size:
            k = sparse_top_k if k is None else min(k, sparse_top_k)
        ks.append(k)
    R = len(requests)
    sampling = SamplingTensors.from_params([r.sampling for r in requests], device=device)
    sparse_rows = [r for r in range(R) if ks[r] is not None]
    dense_rows = [r for r in range(R) if ks[r] is None]
    sparse_ks = [int(ks[r]) for r in sparse_rows]  # type: ignore[arg-type]

    def index(rows: list[int]) -> torch.Tensor | None:
        return None if len(rows) == R else torch.tensor(rows, dtype=torch.int64, device=device)

    sparse_index, dense_index = index(sparse_rows), index(dense_rows)
    plan = RowPlan(R, sparse_rows, sparse_ks, dense_rows,
                   all(r.sampling.is_greedy for r in requests), sparse_index, dense_index,
                   None, None, None, None)
    if sparse_rows:
        k_max = max(sparse_ks)
        k_tensor = torch.tensor(sparse_ks, device=device)
        plan.beyond_k = torch.arange(k_max, device=device).unsqueeze(0) >= k_tensor.unsqueeze(1)
        temperature = _select(sparse_index, sampling.temperature)
        # The rows' kinds, known here on the host, choose the transforms' branches: no device
        # read while sampling (top_k is off: the truncation is done by topk).
        plan.sparse_params = SamplingTensors(temperature, torch.zeros_like(k_tensor),
                                             _select(sparse_index, sampling.top_p),
                                             _kinds_without_top_k(requests, sparse_rows),
                                             _min_p(sampling, sparse_index, requests, sparse_rows))
        greedy = [i for i, r in enumerate(sparse_rows) if requests[r].sampling.is_greedy]
        if greedy:
            plan.sparse_greedy = torch.tensor(greedy, dtype=torch.int64).to(device,
                                                                             non_blocking=True)
    if dense_rows:
        plan.dense_params = SamplingTensors(_select(dense_index, sampling.temperature),
                                            _select(dense_index, sampling.top_k),
                                            _select(dense_index, sampling.top_p),
                                            _kinds_without_top_k(requests, dense_rows),
                                            _min_p(sampling, dense_index, requests, dense_rows))
    generators = [CounterGenerator.resolve(r.generator, r.sampling.seed) for r in requests]
    if any(g.shared_noise and not r.sampling.is_greedy for g, r in zip(generators, requests)):
        plan.gumbel_rows = torch.tensor([g.shared_noise for g in generators], device=device)
        plan.seeds = seed_tensor(generators, device)
        plan.anchor_positions = torch.tensor([r.anchor_position for r in requests],
                                             dtype=torch.int64, device=device)
    return plan


def _kinds_without_top_k(requests: Sequence[DraftRequest], rows: list[int]) -> SamplingKinds:
    """The kinds of these rows' sampling, known on the host, so that sampling them reads nothing
    from the device. No top-k: a sparse row's truncation is done by topk, and a dense row has
    none (top_k 0, or at least the vocabulary)."""
    return SamplingKinds.of([SamplingParams(requests[r].sampling.temperature, 0,
                                            requests[r].sampling.top_p,
                                            min_p=requests[r].sampling.min_p) for r in rows])


def _min_p(sampling: SamplingTensors, index: torch.Tensor | None,
           requests: Sequence[DraftRequest], rows: list[int]) -> torch.Tensor | None:
    """These rows' min_p [n] (None: none of them has one). A sparse row applies it to its top-k
    logits: min_p keeps the tokens whose probability is at least min_p times the largest, a
    most-probable prefix as the top-k is, and a probability's ratio to the largest is the same
    over the top-k as over the vocabulary; so the kept set is the one min_p, then top-k, keep
    over the whole row (vLLM's order, dspark.sampling)."""
    if sampling.min_p is None or not any(requests[r].sampling.min_p > 0.0 for r in rows):
        return None
    return _select(index, sampling.min_p)


def position_noise(plan: RowPlan, k: int, target_ids: torch.Tensor) -> torch.Tensor | None:
    """The Gumbel noise of block position k (1-based: output position anchor + k) at each draft
    vocabulary id's target id `target_ids` [V_d]: [R, V_d], or None when no row drafts by
    Gumbel-max (dspark.gumbel_verification)."""
    if plan.gumbel_rows is None:
        return None
    return gumbel_noise(plan.seeds, plan.anchor_positions + k,
                        target_ids.expand(plan.num_rows, -1))


def _gumbel_picks(pick: torch.Tensor, probs: torch.Tensor, noise: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
    """Where `rows` [n] is True, the Gumbel-max column of probs [n, k] under noise [n, k]
    instead of the inverse-CDF pick [n]."""
    gumbel = argmax_first(torch.log(probs) + noise, dim=1)  # log 0 = -inf: never chosen
    return torch.where(rows, gumbel, pick)


@dataclass
class PositionSample:
    """One block position sampled for every request of a call (rows grouped as in the plan)."""

    tokens: torch.Tensor  # [R] draft-vocabulary ids
    sparse_indices: torch.Tensor | None  # [n_sparse, k_max] draft-vocabulary ids
    sparse_probs: torch.Tensor | None  # [n_sparse, k_max] (0 past each row's k)
    dense_probs: torch.Tensor | None  # [n_dense, V_d]


def sample_block_position(logits: torch.Tensor, plan: RowPlan, uniforms: torch.Tensor | None,
                          noise: torch.Tensor | None = None) -> PositionSample:
    """Sample one position for every request: logits [R, V_d] float32, uniforms [R] in [0, 1)
    (None only when every request is greedy); noise [R, V_d] (`position_noise`) for the rows
    that draft by Gumbel-max, None when none does.

    Each token is drawn from exactly the distribution returned for its row.
    """
    R, _ = logits.shape
    if plan.all_greedy:  # argmax, lowest index on ties (as dspark.sampling)
        tokens = argmax_first(logits, dim=1)
        return PositionSample(tokens, tokens.unsqueeze(1), logits.new_ones(R, 1), None)
    tokens = torch.empty(R, dtype=torch.int64, device=logits.device)
    sparse_indices = sparse_probs = dense_probs = None
    if plan.sparse_rows:
        sub = _select(plan.sparse_index, logits)  # [n, V_d]
        values, sparse_indices = torch.topk(sub, plan.beyond_k.shape[1], dim=1)  # sorted desc
        greedy = plan.sparse_greedy
        if greedy is not None:  # argmax with the lowest index on ties
            sparse_indices[greedy, 0] = argmax_first(sub[greedy], dim=1)
        values = values.masked_fill(plan.beyond_k, float("-inf"))
        sparse_probs = probs_from_logits(values, plan.sparse_params)  # greedy: one-hot at slot 0
        pick = sample_from_probs(sparse_probs, _select(plan.sparse_index, uniforms))
        if noise is not None:
            pick = _gumbel_picks(pick, sparse_probs,
                                 _select(plan.sparse_index, noise).gather(1, sparse_indices),
                                 _select(plan.sparse_index, plan.gumbel_rows))
        picked = sparse_indices.gather(1, pick.unsqueeze(1)).squeeze(1)
        if plan.sparse_index is None:
            tokens = picked
        else:
            tokens[plan.sparse_index] = picked
    if plan.dense_rows:
        dense_probs = probs_from_logits(_select(plan.dense_index, logits), plan.dense_params)
        picked = sample_from_probs(dense_probs, _select(plan.dense_index, uniforms))
        if noise is not None:
            picked = _gumbel_picks(picked, dense_probs, _select(plan.dense_index, noise),
                                   _select(plan.dense_index, plan.gumbel_rows))
        if plan.dense_index is None:
            tokens = picked
        else:
            tokens[plan.dense_index] = picked
    return PositionSample(tokens, sparse_indices, sparse_probs, dense_probs)


def draft_uniforms(requests: Sequence[DraftRequest], count: int, device: torch.device) -> torch.Tensor:
    """[R, count] uniforms: request r's DRAFT (anchor position, k) for k = 1..count under its
    generator's seed (dspark.random_draws), the same whatever else is drafted with it."""
    R = len(requests)
    seeds = seed_tensor([CounterGenerator.resolve(r.generator, r.sampling.seed) for r in requests],
                        device)  # [R]
    anchors = torch.tensor([r.anchor_position for r in requests], dtype=torch.int64, device=device)
    k = torch.arange(1, count + 1, dtype=torch.int64, device=device)  # [count]
    u = keyed_uniforms(seeds.repeat_interleave(count), anchors.repeat_interleave(count),
                       k.repeat(R), Purpose.DRAFT)
    return u.reshape(R, count)


def assemble_blocks(plan: RowPlan, samples: Sequence[PositionSample], confidences: torch.Tensor,
                    draft_to_target: torch.Tensor | None) -> list[DraftBlock]:
    """Per-position samples (n of them, n <= gamma) and confidences [R, n] -> one DraftBlock each
    (`gamma` below is the n positions drafted)."""
    R, gamma = plan.num_rows, len(samples)
    tokens = torch.stack([s.tokens for s in samples], dim=1)  # [R, gamma]
    if draft_to_target is not None:
        tokens = draft_to_target[tokens]
    confidences = confidences.float()
    blocks: list[DraftBlock | None] = [None] * R
    if plan.sparse_rows:
        indices = torch.stack([s.sparse_indices for s in samples], dim=1)  # [n, gamma, k_max]
        if draft_to_target is not None:
            indices = draft_to_target[indices]
        probs = torch.stack([s.sparse_probs for s in samples], dim=1).float()
        for i, (r, k) in enumerate(zip(plan.sparse_rows, plan.sparse_ks)):
            blocks[r] = DraftBlock(tokens[r], probs[i, :, :k], confidences[r], indices[i, :, :k])
    if plan.dense_rows:
        probs = torch.stack([s.dense_probs for s in samples], dim=1).float()  # [n, gamma, V_d]
        # A reduced draft vocabulary is the support of every dense row: the block is returned
        # sparse over it ([gamma, V_d] target ids, shared), not written out over the target's V.
        support = None if draft_to_target is None else draft_to_target.expand(gamma, -1)
        for i, r in enumerate(plan.dense_rows):
            blocks[r] = DraftBlock(tokens[r], probs[i], confidences[r], support)
    return blocks  # type: ignore[return-value]

