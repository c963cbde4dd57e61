"""Per-request processing of the target's logits: vLLM's logit_bias, min_tokens and repetition,
frequency and presence penalties, applied inside verification so that the output stays exact.

Exactness. Rejection sampling (and the greedy rule) is exact for any draft distribution q as long
as the target distribution p at each verified row is the one the request's parameters define for
that row's prefix. Verify-row j of request r follows prompt + output + anchor + drafts[:j], so
its processed logits count those tokens: the penalties count the drafts before row j, and
min_tokens counts them as output. Any q is exact; the drafts are processed too (logit_bias,
min_tokens' ban and the penalties through `apply_penalties`: dspark.models.draft_processing)
only so that fewer are rejected. The prefill's
first token and target-only decoding (`--policy none`, rows with no drafts) go through the same
code.

Order (vLLM's v1 Sampler; logits in float32):
1. min_tokens: EOS and the stop tokens (SamplingParams.stop_token_ids) at -inf while the output
   has fewer than min_tokens tokens;
2. logit_bias: bias[token] added to the token's logit;
3. repetition_penalty p over the tokens of prompt and output: logit / p where logit > 0, else
   logit * p;
4. frequency_penalty f and presence_penalty a over the output tokens:
   logit -= f * count(token) + a * (count(token) > 0);
then dspark.sampling: greedy rows take the argmax here; sampled rows temperature, min_p, top-k,
top-p. The target's log-probabilities (dspark.logprobs) stay those of the raw logits, as vLLM's
default `raw_logprobs`.

The plug-in interface (`RowProcessor`), for any per-request processing of target rows (a
grammar's token mask, for instance):
- `observe(tokens, output)`: the target has read `tokens` of the request, in order (its KV cache
  holds them now): prompt tokens (`output` False), or output tokens (`output` True). Called with
  prompt chunks, with a preempted request's re-read output, with each round's anchor before
  its rows are processed, and with the accepted drafts after the round. The recovered or bonus
  token is observed as the next round's anchor.
- `apply(drafts, logits)`: logits [len(drafts) + 1, vocab_size] float32, the request's rows of
  one verification, changed in place: row j is the distribution of the token after the observed
  tokens + drafts[:j]. A row after a draft the processing forbids is never used (that draft has
  target probability 0 and is rejected first), so it may hold anything; every other row must
  keep at least one finite logit.
- a factory `make(params, vocab_size, device) -> RowProcessor | None` added to
  `LogitsProcessing.factories` decides per request whether it has one (None: nothing to do).

`LogitsProcessing` is what the verifier keeps: the requests' processors by id, `start` on a
request's first prompt chunk, `observe`, `apply` to a verification's logits, `release`. A
request without processing has no entry and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence

import torch

from dspark.sampling import SamplingParams


class RowProcessor(Protocol):
    """One request's processing of its target rows (see the module docstring)."""

    def observe(self, tokens: Sequence[int], output: bool) -> None: ...

    def apply(self, drafts: Sequence[int], logits: torch.Tensor) -> None: ...


ProcessorFactory = Callable[[SamplingParams, int, torch.device], "RowProcessor | None"]


class PenaltyProcessor:
    """vLLM's min_tokens, logit_bias and repetition / frequency / presence penalties of one
    request, from the tokens it has observed (kept on the device: seen [V] bool, output counts
    [V] float32 and the ids seen so far [num_seen]; the number of output tokens on the host).
    On the CPU the penalties touch only the columns of tokens seen (prompt, output, the
    round's drafts): [rows, num_seen] work instead of [rows, V], for a read of their ids that
    costs nothing there. On an accelerator they run over every column, which a penalty leaves
    as it is where a token was neither seen nor counted: the same logits, bit for bit, without
    a device read or a shape that depends on the device's values."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        bad = [t for t, _ in params.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids outside the vocabulary 0..{vocab_size - 1}: "
                             f"{bad[:5]}")
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64,
                                     device=self.device)  # [num_biased]
        self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32,
                                        device=self.device)  # [num_biased]
        stops = [t for t in params.stop_token_ids if t < vocab_size] if params.min_tokens else []
        self.stop_ids = torch.tensor(stops, dtype=torch.int64, device=self.device)  # [num_stop]
        self.penalised = params.has_penalties
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)  # [V]
        self.seen_ids = torch.zeros(0, dtype=torch.int64, device=self.device)  # [num_seen] sorted
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32,
                                         device=self.device)  # [V]
        self.num_output = 0

    @staticmethod
    def make(params: SamplingParams, vocab_size: int, device: torch.device
             ) -> "PenaltyProcessor | None":
        return PenaltyProcessor(params, vocab_size, device) if params.processes_logits else None

    def observe(self, tokens: Sequence[int], output: bool) -> None:
        if output:
            self.num_output += len(tokens)
        if not self.penalised or not tokens:
            return
        ids = torch.tensor(list(tokens), dtype=torch.int64).to(self.device, non_blocking=True)
        self.seen[ids] = True
        if self.device.type == "cpu":  # the seen columns' ids (apply on the CPU)
            self.seen_ids = self.seen.nonzero().squeeze(1)  # [num_seen] ascending
        if output:
            self.output_counts.index_add_(0, ids, torch.ones(ids.shape[0], device=self.device))

    def apply(self, drafts: Sequence[int], logits: torch.Tensor) -> None:
        num_rows = len(drafts) + 1
        assert logits.shape == (num_rows, self.vocab_size), (logits.shape, num_rows)
        # 1. min_tokens: row j follows num_output + j output tokens.
        held = min(num_rows, max(0, self.params.min_tokens - self.num_output))
        if held and self.stop_ids.numel():
            logits[:held, self.stop_ids] = float("-inf")
        # 2. logit_bias.
        if self.bias_ids.numel():
            logits.index_add_(1, self.bias_ids, self.bias_values.expand(num_rows, -1))
        if not self.penalised:
            return
        draft_ids = (torch.tensor(list(drafts), dtype=torch.int64).to(self.device,
                                                                      non_blocking=True)
                     if drafts else None)  # [num_drafts]
        if self.device.type == "cpu":
            ids = self.seen_ids  # [K] the columns a penalty can touch, ascending
            if draft_ids is not None:
                ids = torch.cat([ids, draft_ids]).unique()  # [K] ascending
        else:
            ids = None  # every column, [K] = [V]
        counts = (self.output_counts if ids is None
                  else self.output_counts[ids]).expand(num_rows, -1)  # [R, K]
        if drafts:  # row j also counts drafts[:j]: (row, draft) pairs j > k for draft k
            rows = [j for k in range(len(drafts)) for j in range(k + 1, num_rows)]
            which = [k for k in range(len(drafts)) for _ in range(k + 1, num_rows)]
            which_t = torch.tensor(which).to(self.device, non_blocking=True)
            columns = (draft_ids[which_t] if ids is None
                       else torch.searchsorted(ids, draft_ids)[which_t])
            counts = counts.clone().index_put_(
                (torch.tensor(rows).to(self.device, non_blocking=True), columns),
                torch.ones(len(rows), device=self.device), accumulate=True)
        columns_logits = logits if ids is None else logits[:, ids]  # [R, K]
        seen = self.seen if ids is None else self.seen[ids]  # [K]
        # 3. repetition over prompt and output (drafts included), 4. frequency and presence.
        columns_logits = apply_penalties(columns_logits, seen | (counts > 0), counts, self.params)
        if ids is None:
            logits.copy_(columns_logits)
        else:
            logits[:, ids] = columns_logits


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                    params: SamplingParams | PenaltyTensors) -> torch.Tensor:
    """Steps 3 and 4 of the module docstring on some columns of some rows: logits [R, K]
    float32, seen [R, K] bool (the column's token is in the prompt or the output), counts
    [R, K] float32 (its count in the output) -> the penalised logits [R, K] (a new tensor).
    `params`: one request's (every row alike), or per row (`PenaltyTensors`). The target's rows
    (PenaltyProcessor) and the drafts (dspark.models.draft_processing) both go through here."""
    assert seen.shape == counts.shape == logits.shape, (logits.shape, seen.shape, counts.shape)
    p, f, a = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if isinstance(p, torch.Tensor) or p != 1.0:
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if isinstance(f, torch.Tensor) or f:
        logits = logits - f * counts
    if isinstance(a, torch.Tensor) or a:
        logits = logits - a * (counts > 0).float()
    return logits


@dataclass
class PenaltyTensors:
    """Several requests' penalties, one row each: [R, 1] float32 (broadcast over the columns)."""

    repetition_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor

    @staticmethod
    def from_params(params: Sequence[SamplingParams], device: torch.device) -> "PenaltyTensors":
        column = lambda values: torch.tensor(values, dtype=torch.float32).unsqueeze(1).to(  # noqa: E731
            device, non_blocking=True)
        return PenaltyTensors(column([p.repetition_penalty for p in params]),
                              column([p.frequency_penalty for p in params]),
                              column([p.presence_penalty for p in params]))


class LogitsProcessing:
    """The processors of every request a verifier holds, and their batched application."""

    def __init__(self, vocab_size: int, device: torch.device | str,
                 factories: Sequence[ProcessorFactory] = (PenaltyProcessor.make,)) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.factories = list(factories)
        """Called in order with each new request's params; each may add a processor."""
        self._processors: dict[Hashable, list[RowProcessor]] = {}
        self._lengths: dict[Hashable, int] = {}
        """Tokens each processed request has observed."""

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._processors

    def __len__(self) -> int:
        """Requests with processing (0: the verifier skips every step of it)."""
        return len(self._processors)

    def start(self, request_id: Hashable, params: SamplingParams) -> None:
        """A request's first prompt chunk: its processors (none: no entry), replacing any."""
        self.release(request_id)
        made = [p for make in self.factories
                if (p := make(params, self.vocab_size, self.device)) is not None]
        if made:
            self._processors[request_id] = made
            self._lengths[request_id] = 0

    def length(self, request_id: Hashable) -> int:
        """Tokens the request's processors observed (0 without processors)."""
        return self._lengths.get(request_id, 0)

    def observe(self, request_id: Hashable, tokens: Sequence[int],
                prompt_length: int | None = None) -> None:
        """The target read `tokens` of the request, following those observed before: the ones
        at positions below `prompt_length` are prompt, the rest output (None: all prompt)."""
        processors = self._processors.get(request_id)
        if processors is None or not tokens:
            return
        tokens = list(tokens)
        start = self._lengths[request_id]
        split = len(tokens) if prompt_length is None else min(len(tokens),
                                                               max(0, prompt_length - start))
        for p in processors:
            if split:
                p.observe(tokens[:split], False)
            if split < len(tokens):
                p.observe(tokens[split:], True)
        self._lengths[request_id] = start + len(tokens)

    def observe_output(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """Output tokens the target read (an anchor, accepted drafts)."""
        self.observe(request_id, tokens, prompt_length=0)

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[Hashable, int, Sequence[int]]]
              ) -> torch.Tensor:
        """The logits with every processed request's rows processed: logits [n, V];
        rows: (request id, its first row, its drafts) for the requests whose rows are
        len(drafts) + 1 from that first row. The input itself when no request is processed
        (nothing is copied), else a float32 copy (the input stays the raw logits)."""
        todo = [(self._processors[rid], start, drafts) for rid, start, drafts in rows
                if rid in self._processors]
        if not todo:
            return logits
        out = logits.to(torch.float32, copy=True)  # [n, V]
        for processors, start, drafts in todo:
            block = out[start:start + len(drafts) + 1]  # a view: processed in place
            for p in processors:
                p.apply(drafts, block)
        return out

    def release(self, request_id: Hashable) -> None:
        self._processors.pop(request_id, None)
        self._lengths.pop(request_id, None)
