"""The verifier component: the target model plus lossless verification (docs/design.md sections 5, 7).

It owns the target runner (and so every request's KV cache) and offers the engine three calls:
- `prefill`: run prompts, sample each request's first token from the target, and return the
  prompt tokens' hidden features (the drafter's first context);
- `verify`: one flattened target forward over every request's [anchor, admitted drafts],
  rejection sampling (dspark.rejection: token by token, or sampled requests block by block when
  the verifier is built with the block rule), KV cache truncated to the committed tokens, and the
  committed tokens' features for the drafter, with the step's statistics. It may also carry
  *prefill chunks* (`PrefillChunk`): pieces of joining requests' prompts read in the same
  forward (chunked prefill), the last piece of a prompt sampling its first token as `prefill`
  does;
- the requests' logits processing (dspark.logits_processing: logit_bias, min_tokens, penalties)
  is applied to the target's rows between the forward and rejection sampling, on a copy: the
  distributions verified against are the processed ones, the log-probabilities the raw ones;
- `take_features`: the features of items marked `hold_features`, kept here until the drafter
  needs them (dspark.feature_stash);
- `release`.
Requests with structured output (dspark.structured_output) have their target rows masked by
their grammar before verification; the verifier keeps each one's grammar state with its KV cache.
The engine calls these as plain methods; the services issue puts the same object behind gRPC.

Positions: a request whose KV cache holds n tokens has its anchor at position n. A round feeds
[x0, x1..x_l] at positions n..n+l and keeps x0 and the accepted drafts: n + 1 + accepted tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from dspark.feature_stash import FeaturePiece, FeatureStash
from dspark.logits_processing import LogitsProcessing
from dspark.logprobs import TokenLogprobs, grouped_token_logprobs
from dspark.models.draft_types import DraftBlock
from dspark.models.runner import ForwardItem, TargetRunner
from dspark.rejection import (SparseDraftProbs, VerificationRule, VerifyBatch, draw_uniforms,
                              verify)
from dspark.random_draws import CounterGenerator
from dspark.rejection import sample_first_tokens
from dspark.sampling import SamplingParams, SamplingTensors
from dspark.structured_output import GrammarCompiler, GrammarRequest, GrammarState, mask_logits


@dataclass
class PrefillOutput:
    first_tokens: list[int]
    """[num_requests] the first generated token of each request (sampled from the target)."""
    features: list[torch.Tensor | None]
    """Per request [prompt_len, num_layers * hidden_size] target features, or None without layers."""
    logprobs: list[TokenLogprobs | None] | None = None
    """Per request the first token's log-probability (dspark.logprobs), None where not asked."""


@dataclass
class VerifyRequest:
    request_id: Hashable
    anchor_token: int
    block: DraftBlock | None
    """The drafted block (None or num_drafts = 0: a plain decoding step)."""
    num_drafts: int
    """l_r: how many of the block's tokens the admission admitted."""
    sampling: SamplingParams
    generator: CounterGenerator | None = None
    """Its random numbers (None: keyed by sampling.seed, or a fresh seed)."""
    hold_features: bool = False
    """Keep the committed tokens' features with the verifier (`take_features`) instead of
    returning them (dspark.feature_stash)."""
    logprobs: int | None = None
    """Return the target's log-probabilities of the output tokens with this many top
    alternatives each (dspark.logprobs); None = none (nothing is computed)."""
    grammar: GrammarRequest | None = None
    """Structured output: the target's rows are masked by this grammar (None = unconstrained)."""


@dataclass
class PrefillChunk:
    """Prompt tokens of one request for the target to read (chunked prefill)."""

    request_id: Hashable
    token_ids: Sequence[int]
    """The next piece of the prompt (positions follow what the cache holds)."""
    final: bool
    """The prompt's last piece: the request's first token is sampled from its last logits."""
    sampling: SamplingParams
    generator: CounterGenerator | None = None
    continued: bool = False
    """The request's earlier pieces are already in the KV cache (else it is new here)."""
    hold_features: bool = False
    """Keep the chunk's features with the verifier instead of returning them."""
    logprobs: int | None = None
    """A final chunk: return the first token's log-probability with this many top alternatives
    (dspark.logprobs); None = none."""
    grammar: GrammarRequest | None = None
    """A final chunk with structured output: the first token is sampled under this grammar."""
    prompt_length: int | None = None
    """A preempted request re-reading its output (engine recomputation, a restore): its prompt's
    length; the tokens from that position on are output to its logits processing (penalties,
    min_tokens). None: the chunk is prompt."""


@dataclass
class ChunkOutput:
    """What the target made of the prefill chunks of one call, in their order."""

    first_tokens: list[int | None]
    """[num_chunks] the request's first token for a final chunk, None for the others."""
    features: list[torch.Tensor | None]
    """[num_chunks] features [len(token_ids), num_layers * hidden_size], or None without layers
    or when held."""
    logprobs: list[TokenLogprobs | None] | None = None
    """[num_chunks] the first token's log-probability (one row) for a final chunk that asked
    (PrefillChunk.logprobs), None for the others; None when no chunk asked."""


@dataclass
class VerifyOutput:
    num_accepted: list[int]
    """[num_requests] accepted drafts."""
    output_tokens: list[list[int]]
    """[num_requests] accepted drafts then the recovered or bonus token."""
    features: list[torch.Tensor | None]
    """[num_requests] features [1 + accepted, num_layers * hidden_size] of the committed tokens
    (anchor and accepted drafts), or None without hidden layers or when held."""
    batch_tokens: int
    """B = sum_r (1 + l_r): tokens the target processed."""
    step_seconds: float
    """Wall time of the target forward (what SPS(B) measures when no prefill rode along)."""
    prefill: ChunkOutput | None = None
    """The prefill chunks' results (None when the call had none)."""
    prefill_tokens: int = 0
    """Prompt tokens the same forward read for the prefill chunks."""
    logprobs: list[TokenLogprobs | None] | None = None
    """[num_requests] the target's log-probabilities of output_tokens (one row per token) for
    requests that asked (VerifyRequest.logprobs), None for the others; None when none asked."""


class TargetVerifier:
    """Target runner + rejection sampler, with no scheduling logic of its own."""

    def __init__(self, runner: TargetRunner,
                 rule: VerificationRule = VerificationRule.TOKEN,
                 grammars: GrammarCompiler | None = None) -> None:
        self.runner = runner
        self.grammars = grammars
        """Compiles structured-output grammars over the target's tokenizer (None: requests with
        a grammar are refused)."""
        self.grammar_states: dict[Hashable, GrammarState] = {}
        """Each constrained request's grammar state, advanced by its committed tokens."""
        self.rule = VerificationRule(rule)
        """How sampled requests' drafts are accepted; greedy ones follow the token rule always."""
        self.batch_observer: Callable[[VerifyBatch], None] | None = None
        """Called with every verification's batch before its verdict (benchmarks)."""
        self.stash = FeatureStash()
        """Features of items marked hold_features, until `take_features`."""
        self.processing = LogitsProcessing(runner.vocab_size, runner.device)
        """Each request's logits processing (dspark.logits_processing), from its first chunk."""

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the target's KV cache blocks in use (0..1)."""
        return self.runner.cache.manager.usage

    def _flat_features(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        # [n, num_layers, hidden_size] -> [n, num_layers * hidden_size]
        return None if hidden is None else hidden.reshape(hidden.shape[0], -1)

    def prefill(self, request_ids: Sequence[Hashable], prompts: Sequence[Sequence[int]],
                sampling: Sequence[SamplingParams],
                generators: Sequence[CounterGenerator | None],
                logprobs: Sequence[int | None] | None = None,
                grammars: Sequence[GrammarRequest | None] | None = None) -> PrefillOutput:
        """`logprobs`: per request as PrefillChunk.logprobs (None: no request asks); `grammars`:
        per request as PrefillChunk.grammar (None: none is constrained)."""
        logprobs = [None] * len(request_ids) if logprobs is None else logprobs
        grammars = [None] * len(request_ids) if grammars is None else grammars
        chunks = [PrefillChunk(rid, list(p), True, s, g, logprobs=k, grammar=gr)
                  for rid, p, s, g, k, gr in zip(request_ids, prompts, sampling, generators,
                                                 logprobs, grammars)]
        out = self.verify([], chunks).prefill
        return PrefillOutput([int(t) for t in out.first_tokens], out.features, out.logprobs)

    def verify(self, requests: Sequence[VerifyRequest],
               prefill: Sequence[PrefillChunk] = ()) -> VerifyOutput:
        """Verify `requests` and read the `prefill` chunks, all in one target forward."""
        for chunk in prefill:
            if chunk.continued != self.runner.has_request(chunk.request_id):
                state = "unknown" if chunk.continued else "already held"
                raise ValueError(f"prefill chunk of {chunk.request_id!r}: request {state}")
        new = [c for c in prefill if not c.continued]
        for chunk in new:
            self.runner.add_request(chunk.request_id)
        try:
            for chunk in new:
                self.processing.start(chunk.request_id, chunk.sampling)
            return self._verify(requests, prefill)
        except BaseException:
            for chunk in new:
                self.runner.free(chunk.request_id)
                self.processing.release(chunk.request_id)
            raise

    def _verify(self, requests: Sequence[VerifyRequest],
                prefill: Sequence[PrefillChunk]) -> VerifyOutput:
        items, tokens, probs, indices = [], [], [], []
        lens, drafted = [], []  # [R] l_r and the admitted drafts as host ints
        # The drafter may return some blocks sparse (greedy: k = 1) and others dense (plain
        # sampling); a mixed batch is verified dense: the same distributions, written out.
        device = self.runner.device
        admitted = [_on_device(r.block, device) for r in requests if r.block is not None and r.num_drafts > 0]
        mixed = len({b.is_sparse for b in admitted}) > 1
        blocks = iter(admitted)
        host_drafts = iter(_host_tokens(requests, admitted))
        for req in requests:
            n = req.num_drafts if req.block is not None else 0
            block = next(blocks) if n else None  # the admitted block, on the device
            drafts = next(host_drafts) if n else []
            drafted.append(drafts)
            if n:
                tokens.append(block.tokens[:n])
                if mixed and block.is_sparse:
                    probs.append(block.dense(self.vocab_size)[:n])
                else:
                    probs.append(block.probs[:n])
                    if block.indices is not None:
                        indices.append(block.indices[:n])
            lens.append(n)
            items.append(ForwardItem(req.request_id, [req.anchor_token] + drafts, logits_from=0))
        states = [self._grammar_state(r.request_id, r.grammar) for r in requests]  # [R]
        chunk_states = [self._grammar_state(c.request_id, c.grammar) if c.final else None
                        for c in prefill]
        # A chunk needs logits only for its last token, and only if the prompt ends there.
        items += [ForwardItem(c.request_id, list(c.token_ids),
                              logits_from=None if c.final else len(c.token_ids)) for c in prefill]
        old_lengths = [self.runner.length(r.request_id) for r in requests]
        chunk_starts = [self.runner.length(c.request_id) for c in prefill]
        start = time.perf_counter()
        out = self.runner.forward(items)  # logits: l_r + 1 rows per request, then 1 per final chunk
        step_seconds = time.perf_counter() - start
        verify_rows = sum(lens) + len(requests)
        logits = self._processed_logits(out.logits, requests, prefill, drafted)

        num_accepted, output_tokens, features, logprobs = [], [], [], None
        if requests:
            draft_lens = torch.tensor(lens, dtype=torch.int64)  # [R] on the host: verify moves it
            if indices and len(indices) != len(tokens):
                raise ValueError("a batch mixes sparse and dense draft distributions")
            if indices and (shared := _shared_support(indices)) is not None:
                # Every block over the drafter's reduced vocabulary: one row of ids for all.
                draft_probs = SparseDraftProbs(shared.expand(sum(lens), -1),
                                               torch.cat(probs))
            elif indices:
                # Supports of different widths (greedy k = 1 beside a top_k request's k) are
                # padded to the widest with probability 0, which adds nothing to any row.
                width = max(i.shape[1] for i in indices)
                draft_probs = SparseDraftProbs(
                    torch.cat([_pad_columns(i, width) for i in indices]),  # [num_drafts, width]
                    torch.cat([_pad_columns(p, width) for p in probs]))
            else:
                draft_probs = (torch.cat(probs) if probs
                               else torch.zeros(0, self.vocab_size, device=device))
            batch = VerifyBatch(
                draft_tokens=(torch.cat(tokens) if tokens
                              else torch.zeros(0, dtype=torch.int64, device=device)),
                draft_lens=draft_lens, draft_probs=draft_probs,
                target_logits=_constrained(logits[:verify_rows], states, drafted),
                sampling=[r.sampling for r in requests])
            if self.batch_observer is not None:
                self.batch_observer(batch)
            generators = [CounterGenerator.resolve(r.generator, r.sampling.seed) for r in requests]
            draws = draw_uniforms(draft_lens, generators, old_lengths)
            result = verify(batch, draws.to(device), self.rule)
            num_accepted, output_tokens = result.to_host(batch)  # one device-to-host copy
            for state, tokens_out in zip(states, output_tokens):
                if state is not None:
                    state.observe(tokens_out)
            # The raw target's log-probabilities (dspark.logprobs), before any grammar mask.
            logprobs = _output_logprobs(requests, lens, output_tokens, out.logits[:verify_rows])
            for i, (req, old, accepted) in enumerate(zip(requests, old_lengths, num_accepted)):
                self.runner.truncate(req.request_id, old + 1 + accepted)  # drop rejected drafts
                self.processing.observe_output(req.request_id, output_tokens[i][:accepted])
                hidden = out.hidden_of(i)[:1 + accepted] if out.hidden is not None else None
                flat = self._flat_features(hidden)
                # Once a request holds features, later ones are held too: its context stays in
                # order.
                if (req.hold_features or req.request_id in self.stash) and flat is not None:
                    committed = [req.anchor_token] + output_tokens[i][:accepted]
                    self.stash.hold(req.request_id, FeaturePiece(
                        flat, torch.arange(old, old + 1 + accepted),
                        torch.tensor(committed, dtype=torch.int64)))
                    flat = None
                features.append(flat)
        chunks = self._chunk_outputs(prefill, out, len(requests), logits[verify_rows:],
                                     out.logits[verify_rows:], chunk_starts, chunk_states)
        if chunks is not None:
            for i, (chunk, start) in enumerate(zip(prefill, chunk_starts)):
                held = chunk.hold_features or chunk.request_id in self.stash
                if held and chunks.features[i] is not None:
                    self.stash.hold(chunk.request_id, FeaturePiece(
                        chunks.features[i], torch.arange(start, start + len(chunk.token_ids)),
                        torch.tensor(list(chunk.token_ids), dtype=torch.int64)))
                    chunks.features[i] = None
        return VerifyOutput(num_accepted, output_tokens, features,
                            batch_tokens=len(requests) + sum(lens), step_seconds=step_seconds,
                            prefill=chunks,
                            prefill_tokens=sum(len(c.token_ids) for c in prefill),
                            logprobs=logprobs)

    def _processed_logits(self, logits: torch.Tensor, requests: Sequence[VerifyRequest],
                          prefill: Sequence[PrefillChunk], drafts: Sequence[Sequence[int]]
                          ) -> torch.Tensor:
        """The target distribution's logits (dspark.logits_processing): the forward's logits
        [verify rows + final chunks, V] with each processed request's rows processed, after its
        processing observed what this forward read (chunk tokens; a round's anchor). The raw
        logits themselves when no request is processed."""
        if not any(r.request_id in self.processing for r in requests) and not any(
                c.request_id in self.processing for c in prefill):
            return logits
        rows, start = [], 0
        for req, d in zip(requests, drafts):
            self.processing.observe_output(req.request_id, [req.anchor_token])
            rows.append((req.request_id, start, d))
            start += len(d) + 1
        for chunk in prefill:
            self.processing.observe(chunk.request_id, list(chunk.token_ids), chunk.prompt_length)
            if chunk.final:
                rows.append((chunk.request_id, start, []))
                start += 1
        return self.processing.apply(logits, rows)

    def _chunk_outputs(self, prefill: Sequence[PrefillChunk], out, first_item: int,
                       logits: torch.Tensor, raw_logits: torch.Tensor,
                       chunk_starts: Sequence[int],
                       states: Sequence[GrammarState | None]) -> ChunkOutput | None:
        """First tokens of the final chunks (from `logits` [num_final, V], in order, processed;
        their log-probabilities from `raw_logits`, the same rows unprocessed) and every chunk's
        features; chunk_starts [num_chunks]: where each chunk begins in its prompt; states
        [num_chunks]: a final chunk's grammar state (None: unconstrained)."""
        if not prefill:
            return None
        final = [c for c in prefill if c.final]
        first: list[int | None] = [None] * len(prefill)
        logprobs: list[TokenLogprobs | None] | None = None
        if final:
            final_states = [s for c, s in zip(prefill, states) if c.final]  # [F]
            first_tokens = sample_first_tokens(  # [F]
                _constrained(logits, final_states, [[] for _ in final]),
                SamplingTensors.from_params([c.sampling for c in final],
                                                    device=logits.device),
                [CounterGenerator.resolve(c.generator, c.sampling.seed) for c in final],
                [s + len(c.token_ids) for c, s in zip(prefill, chunk_starts) if c.final],
                self.rule)
            sampled = iter(first_tokens.tolist())
            first = [next(sampled) if c.final else None for c in prefill]
            for state, token in zip(states, first):
                if state is not None:
                    state.observe([token])
            asked = [c.logprobs for c in final]
            if any(k is not None for k in asked):
                rows = iter(_rows_logprobs(raw_logits, first_tokens, asked))
                logprobs = [next(rows) if c.final else None for c in prefill]
        features = [self._flat_features(out.hidden_of(first_item + i)) if out.hidden is not None
                    else None for i in range(len(prefill))]
        return ChunkOutput(first, features, logprobs)

    def take_features(self, request_ids: Sequence[Hashable]) -> list[list[FeaturePiece]]:
        """[num_requests] the held feature pieces of each request, in order (empty lists where
        nothing is held); they are forgotten here."""
        return [self.stash.take(rid) for rid in request_ids]

    def _grammar_state(self, request_id: Hashable, grammar: GrammarRequest | None
                       ) -> GrammarState | None:
        """The request's grammar state: the one held, or (grammar.replay given) a new one."""
        if grammar is None:
            return None
        if grammar.replay is None:
            if request_id not in self.grammar_states:
                raise ValueError(f"request {request_id!r} has a grammar but no state here and "
                                 "no replay to rebuild it")
            return self.grammar_states[request_id]
        if self.grammars is None:
            raise ValueError("this verifier has no tokenizer to compile structured-output "
                             "grammars with")
        state = self.grammars.state_for(grammar)
        self.grammar_states[request_id] = state
        return state

    def release(self, request_id: Hashable) -> None:
        self.grammar_states.pop(request_id, None)
        self.stash.drop(request_id)
        self.processing.release(request_id)
        if self.runner.has_request(request_id):
            self.runner.free(request_id)


def _constrained(logits: torch.Tensor, states: Sequence[GrammarState | None],
                 drafts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The target rows of a batch with each constrained request's grammar mask applied:
    logits [sum_r (l_r + 1), V], request r's rows in order (its drafts [l_r] as host ints);
    states [R] (None: that request's rows stay as they are). The same tensor when no request
    is constrained."""
    if all(s is None for s in states):
        return logits
    vocab_size = logits.shape[1]
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # [rows, V] on the host
    row = 0
    for state, request_drafts in zip(states, drafts):
        if state is not None:
            mask = state.row_masks(request_drafts)  # [l_r + 1, V_grammar]
            width = min(vocab_size, mask.shape[1])
            allowed[row:row + mask.shape[0], :width] = mask[:, :width]
            allowed[row:row + mask.shape[0], width:] = False  # beyond the tokenizer
        row += len(request_drafts) + 1
    return mask_logits(logits, allowed)


def _rows_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """One row each: logits [n, V], tokens [n], num_top [n] (None = not asked) -> [n]."""
    asked = [i for i, k in enumerate(num_top) if k is not None]
    index = torch.tensor(asked, dtype=torch.int64)
    computed = iter(grouped_token_logprobs(logits[index.to(logits.device)], tokens.cpu()[index],
                                           [(1, num_top[i]) for i in asked]))
    return [None if k is None else next(computed) for k in num_top]


def _output_logprobs(requests: Sequence[VerifyRequest], draft_lens: Sequence[int],
                     output_tokens: list[list[int]], target_logits: torch.Tensor
                     ) -> list[TokenLogprobs | None] | None:
    """The target's log-probabilities of each asking request's output tokens: token j of request
    r (accepted drafts, then the recovered or bonus token) was produced at r's target row j (the
    rows follow rejection.py's flattened layout), one log_softmax for all asking requests."""
    asked = [i for i, r in enumerate(requests) if r.logprobs is not None]
    if not asked:
        return None
    starts = [sum(draft_lens[:i]) + i for i in range(len(requests))]  # r's first target row
    rows = torch.cat([torch.arange(starts[i], starts[i] + len(output_tokens[i])) for i in asked])
    tokens = torch.tensor([t for i in asked for t in output_tokens[i]], dtype=torch.int64)
    computed = iter(grouped_token_logprobs(
        target_logits[rows.to(target_logits.device)], tokens,
        [(len(output_tokens[i]), requests[i].logprobs) for i in asked]))
    return [None if r.logprobs is None else next(computed) for r in requests]


def _shared_support(indices: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one support row [k] when every block's ids [n, k] are views of it repeated (the
    drafter's reduced vocabulary, DraftBlock's dense rows over it), else None."""
    first = indices[0]
    if first.dim() != 2 or first.stride(0) != 0:
        return None
    if any(i.stride(0) != 0 or i.shape[1] != first.shape[1] or i.data_ptr() != first.data_ptr()
           for i in indices[1:]):
        return None
    return first[0]


def _host_tokens(requests: Sequence[VerifyRequest], admitted: Sequence[DraftBlock]
                 ) -> list[list[int]]:
    """The admitted drafts of each request that has some, as host ints, in one transfer (the
    blocks as they came when every one is on the host already, else their device copies)."""
    given = [r.block.tokens[:r.num_drafts] for r in requests
             if r.block is not None and r.num_drafts > 0]
    if not given:
        return []
    if any(t.device.type != "cpu" for t in given):
        given = [b.tokens[:t.shape[0]] for b, t in zip(admitted, given)]
    flat = torch.cat(given).tolist()  # [sum l_r]: one device-to-host copy
    out, start = [], 0
    for t in given:
        out.append(flat[start:start + t.shape[0]])
        start += t.shape[0]
    return out


def _on_device(block: DraftBlock, device: torch.device) -> DraftBlock:
    """The block with its tensors on `device` (a remote drafter's blocks arrive on the host);
    the block itself when they are there already."""
    if block.tokens.device == device and block.probs.device == device:
        return block
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return DraftBlock(move(block.tokens), move(block.probs), move(block.confidences),
                      move(block.indices))


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """[n, k] -> [n, width], zeros appended (index 0 with probability 0 for sparse supports)."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))
