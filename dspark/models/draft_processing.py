"""The request's logit processing applied to its drafts: logit_bias, min_tokens' stop-token ban,
the repetition / frequency / presence penalties and the grammar mask, on the draft logits before
they are sampled (min_p, like temperature, top-k and top-p, is applied by the sampling itself:
dspark.models.draft_sampling).

Why. The target's rows are processed (dspark.logits_processing, dspark.structured_output), so a
draft that the processing forbids has target probability 0 and is always rejected: under
min_tokens a drafted EOS, under a logit_bias of -100 the banned token, under a JSON grammar a
token the mask refuses. Each such draft ends its block; and a penalised target moves its mass
away from the tokens seen, which the raw drafter keeps proposing. Processing the drafts the same
way moves their mass to tokens the target can accept.

Exactness. Rejection sampling is exact for any draft distribution q as long as q is the one the
draft was drawn from. The processing here changes the logits before `sample_block_position`
turns them into q (temperature, top-k, top-p) and samples from q, so the reported q is exactly
the processed one; greedy drafts take the argmax of the processed logits.

What applies at block position k (1-based; draft x_k follows the anchor and x_1..x_{k-1}):
- logit_bias: bias[token] added to the draft id of each biased target id in the draft
  vocabulary (ids outside a reduced draft vocabulary have q = 0 anyway);
- min_tokens: the stop tokens (SamplingParams.stop_token_ids) at -inf while the output before
  x_k, `num_output + k - 1` tokens (num_output counts the anchor), is below min_tokens: the
  target's rule for the same row (dspark.logits_processing);
- the penalties, vLLM's order after the bias (dspark.logits_processing.apply_penalties, the
  function the target's rows go through): repetition over the tokens of prompt and output,
  frequency and presence over the output counts, where the output before x_k is the request's
  output (`DraftRequest.token_ids`: its last num_output tokens, anchor included) and
  x_1..x_{k-1}, as the target's row for x_k counts them if they are accepted; held per row as
  [V_d] seen flags and counts of the draft ids, the counts advanced by each sampled draft;
- the grammar: `DraftRequest.grammar`, the request's matcher after its committed output (anchor
  included), masks position k with the tokens allowed after x_1..x_{k-1}; the matcher is
  advanced through the sampled drafts and rolled back at the end of the call (`finish`).
The masks (-inf) and the penalties commute: a penalty keeps -inf at -inf.

A row whose processing leaves no finite logit (a reduced draft vocabulary without any token the
grammar allows) keeps its unprocessed logits: q stays a distribution, and its drafts are
rejected by the target as they would be without processing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dspark.logits_processing import PenaltyTensors, apply_penalties
from dspark.models.draft_types import DraftRequest


class DraftProcessing:
    """One drafting call's processing of the draft logits, per block position.

    Built once per call by `plan` (None when no request of the call has processing); then for
    each position k (0-based here) `apply(k, logits)` before sampling and `advance(tokens)` after,
    and `finish()` once the block is drawn."""

    def __init__(self, num_rows: int, draft_vocab_size: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.draft_vocab_size = draft_vocab_size
        self.device = device
        self.bias: torch.Tensor | None = None
        """[R, V_d] float32 added to every position (logit_bias), None = no row has one."""
        self.stop_rows: list[tuple[int, torch.Tensor, int]] = []
        """(row, stop draft ids [s], positions held): the first `held` positions ban the stops."""
        self.grammar_rows: list[tuple[int, object]] = []
        """(row, grammar state) of the constrained rows."""
        self.penalty_rows: torch.Tensor | None = None
        """[P] the rows with a penalty, None = no row has one."""
        self.seen: torch.Tensor | None = None
        """[P, V_d] bool: the draft id's token is in the row's prompt or output."""
        self.output_counts: torch.Tensor | None = None
        """[P, V_d] float32: the draft id's count in the row's output and the block's drafts so
        far (advanced by `advance`)."""
        self.penalties: PenaltyTensors | None = None
        """[P, 1] each penalised row's penalties."""
        self.target_ids: torch.Tensor | None = None
        """[V_d] the target id of each draft id (the grammar masks are over target ids)."""
        self._advanced: dict[int, int] = {}
        """Drafts each constrained row's matcher accepted in this call (rolled back by finish)."""
        self._live: set[int] = set()
        """Constrained rows whose matcher follows their drafts (a draft the grammar refuses, only
        possible from a row that fell back to its unprocessed logits, stops it)."""

    @staticmethod
    def plan(requests: Sequence[DraftRequest], target_to_draft: torch.Tensor | None,
             target_ids: torch.Tensor, device: torch.device) -> "DraftProcessing | None":
        """target_to_draft [V] (draft id of each target id, -1 outside; None: the draft
        vocabulary is the target's), target_ids [V_d] (target id of each draft id)."""
        R, V_d = len(requests), int(target_ids.shape[0])
        out = DraftProcessing(R, V_d, device)
        host = None if target_to_draft is None else target_to_draft.cpu()  # [V], read once

        def to_draft(ids: Sequence[int]) -> torch.Tensor:
            """The draft id of each target id [n] (-1 outside the draft vocabulary)."""
            ids_t = torch.tensor(list(ids), dtype=torch.int64)
            if host is None:
                return torch.where(ids_t < V_d, ids_t, -1)
            return torch.where(ids_t < host.shape[0], host[ids_t.clamp(max=host.shape[0] - 1)], -1)

        def draft_ids(ids: Sequence[int]) -> list[tuple[int, int]]:
            """(position in ids, draft id) of the target ids that are in the draft vocabulary."""
            return [(i, d) for i, d in enumerate(to_draft(ids).tolist()) if d >= 0]

        bias_rows: list[tuple[int, list[int], list[float]]] = []
        for r, req in enumerate(requests):
            s = req.sampling
            if s.logit_bias:
                kept = draft_ids([t for t, _ in s.logit_bias])
                if kept:
                    bias_rows.append((r, [d for _, d in kept], [s.logit_bias[i][1] for i, _ in kept]))
            held = s.min_tokens - req.num_output
            if held > 0 and s.stop_token_ids:
                stops = [d for _, d in draft_ids(s.stop_token_ids)]
                if stops:
                    out.stop_rows.append((r, torch.tensor(stops, dtype=torch.int64, device=device),
                                          held))
            if req.grammar is not None and not req.grammar.terminated:
                out.grammar_rows.append((r, req.grammar))
        if bias_rows:
            bias = torch.zeros(R, V_d, dtype=torch.float32)  # [R, V_d] built on the host
            for r, ids, values in bias_rows:
                bias[r, ids] = torch.tensor(values, dtype=torch.float32)
            out.bias = bias.to(device, non_blocking=True)
        penalised = [r for r, req in enumerate(requests) if req.sampling.has_penalties]
        if penalised:
            seen = torch.zeros(len(penalised), V_d, dtype=torch.bool)  # [P, V_d] on the host
            counts = torch.zeros(len(penalised), V_d, dtype=torch.float32)  # [P, V_d]
            for i, r in enumerate(penalised):
                req = requests[r]
                tokens = req.token_ids
                if tokens is None or len(tokens) != req.anchor_position + 1:
                    raise ValueError(f"request {req.request_id!r} has penalties: its draft "
                                     f"request needs its {req.anchor_position + 1} tokens up to "
                                     "the anchor (token_ids)")
                if not 0 <= req.num_output <= len(tokens):
                    raise ValueError(f"request {req.request_id!r}: num_output "
                                     f"{req.num_output} outside 0..{len(tokens)}")
                mapped = to_draft(tokens)  # [n]
                seen[i, mapped[mapped >= 0]] = True
                output = mapped[len(tokens) - req.num_output:]  # [num_output]
                counts[i] = torch.bincount(output[output >= 0], minlength=V_d).float()
            out.penalty_rows = torch.tensor(penalised, dtype=torch.int64).to(device,
                                                                              non_blocking=True)
            out.seen = seen.to(device, non_blocking=True)
            out.output_counts = counts.to(device, non_blocking=True)
            out.penalties = PenaltyTensors.from_params([requests[r].sampling for r in penalised],
                                                       device)
        if not (bias_rows or out.stop_rows or out.grammar_rows or penalised):
            return None
        if out.grammar_rows:
            out.target_ids = target_ids.cpu()
            out._live = {r for r, _ in out.grammar_rows}
            out._advanced = {r: 0 for r, _ in out.grammar_rows}
        return out

    @property
    def needs_tokens(self) -> bool:
        """`advance` reads the sampled tokens on the host (a constrained row is following)."""
        return bool(self._live)

    def apply(self, k: int, logits: torch.Tensor) -> torch.Tensor:
        """Position k (0-based: draft x_{k+1}) of every row: logits [R, V_d] float32 -> the
        processed logits [R, V_d] (a new tensor; rows without processing unchanged)."""
        assert logits.shape == (self.num_rows, self.draft_vocab_size), logits.shape
        out = logits if self.bias is None else logits + self.bias
        if self.penalty_rows is not None:
            rows = self.penalty_rows
            penalised = apply_penalties(out[rows], self.seen | (self.output_counts > 0),
                                        self.output_counts, self.penalties)  # [P, V_d]
            out = out.index_copy(0, rows, penalised)  # a new tensor
        banned = [(r, stops) for r, stops, held in self.stop_rows if k < held]
        grammar = [(r, state) for r, state in self.grammar_rows if r in self._live]
        if not banned and not grammar:
            return out
        allowed = torch.ones(self.num_rows, self.draft_vocab_size, dtype=torch.bool)  # host
        for r, state in grammar:
            mask = state.allowed_tokens()  # [V_grammar] over target ids
            inside = self.target_ids < mask.shape[0]  # [V_d]: beyond the tokenizer: refused
            allowed[r] = inside & mask[self.target_ids.clamp(max=mask.shape[0] - 1)]
        allowed = allowed.to(logits.device, non_blocking=True)
        for r, stops in banned:
            allowed[r, stops] = False
        masked = out.masked_fill(~allowed, float("-inf"))  # [R, V_d]
        # A row left with no finite logit keeps its unprocessed logits (module docstring).
        finite = torch.isfinite(masked).any(dim=1, keepdim=True)  # [R, 1]
        return torch.where(finite, masked, logits)

    def advance(self, draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> None:
        """The position's sampled drafts [R], as draft ids and as target ids: each penalised
        row counts its own as output (on the device), each constrained row's matcher accepts
        its own (one host read, only while some constrained row follows)."""
        if self.penalty_rows is not None:
            rows = self.penalty_rows
            self.output_counts.index_put_(
                (torch.arange(rows.shape[0], device=rows.device), draft_tokens[rows]),
                torch.ones(rows.shape[0], device=rows.device), accumulate=True)
        if not self._live:
            return
        tokens = target_tokens.tolist()
        for r, state in self.grammar_rows:
            if r not in self._live:
                continue
            if not state.try_accept(int(tokens[r])):
                self._live.discard(r)
                continue
            self._advanced[r] += 1
            if state.terminated:  # a stop token drafted: nothing after it is used
                self._live.discard(r)

    def finish(self) -> None:
        """Roll every matcher back to the committed output it had before the call."""
        for r, state in self.grammar_rows:
            if self._advanced.get(r):
                state.rollback(self._advanced[r])
                self._advanced[r] = 0
        self._live.clear()
