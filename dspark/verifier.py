"""The verifier component: the target model plus lossless verification (docs/design.md sections 5, 7).

It owns the target runner (and so every request's KV cache) and offers the engine four calls:
- `prefill`: run prompts, sample each request's first token from the target, and return the
  prompt tokens' hidden features (the drafter's first context);
- `verify`: one flattened target forward over every request's [anchor, admitted drafts],
  rejection sampling (dspark.rejection: token by token, or sampled requests block by block when
  the verifier is built with the block rule), KV cache truncated to the committed tokens, and the
  committed tokens' features for the drafter, with the step's statistics. It may also carry
  *prefill chunks* (`PrefillChunk`): pieces of joining requests' prompts read in the same
  forward (chunked prefill), the last piece of a prompt sampling its first token as `prefill`
  does;
- `take_features`: the features of items marked `hold_features`, kept here until the drafter
  needs them (dspark.feature_stash);
- `fork`: a new request that starts from another's prompt: a copy of the prompt's KV cache and
  logits-processing state, so that the n samples of one prompt read it once (dspark/forks.py);
- `release`: forget a request (its KV cache and held features).
The engine calls these as plain methods; the services put the same object behind gRPC.

A `verify` call is three steps around the target forward:
1. pack (`pack_round`, pure): the host's requests and chunks become the forward's flattened
   items and one `PackedRound`: the admitted drafts' tokens and distributions on the device
   (dspark.draft_packing), the draft lengths, and the round's keyed uniforms
   (dspark.random_draws.draw_uniforms);
   then `TargetRunner.forward` reads every item in one pass;
2. verify (`verify_round`, pure and batched): the forward's logits and the packed drafts and
   draws -> each request's accepted count and output tokens, and each final chunk's first
   token; it touches no runner state;
3. commit (`TargetVerifier.commit`): the KV cache truncated to the committed tokens, features
   returned or held, log-probabilities and the chunks' outputs gathered into a `VerifyOutput`.

Where the target's logits become its distributions: `target_rows`, one step between the forward
and rejection sampling. It takes the forward's logit rows [num_verify_rows + num_final_chunks,
vocab_size] and the `PackedRound` (per request: its id, sampling parameters, anchor position and
admitted drafts; per final chunk: its request and prompt length) and returns the rows that
rejection sampling and first-token sampling turn into p^t through each request's sampling
transform (dspark.sampling.probs_from_logits). Per-request logits processing
(dspark.logits_processing: vLLM's logit_bias, min_tokens and penalties, and any RowProcessor
plugged in) is applied there, on a copy: row j of request r is the target's prediction after
r's tokens, its anchor and its drafts x_1..x_j. Its state follows the KV cache: `observe_forward`
feeds it what the forward read (chunk tokens, each anchor) before `target_rows`, and `commit`
the accepted drafts (the recovered or bonus token is the next round's anchor).
Structured output (dspark.structured_output) masks the processed rows in `target_rows` too: each
constrained request's grammar state (kept with its KV cache) is gathered when the round is
packed, gives the rows the tokens its grammar allows after r's output and drafts x_1..x_j
(-inf elsewhere), and `commit` advances it by the committed tokens (a final chunk's by its first
token). The mask follows the processing; they commute, -inf stays -inf.
Log-probabilities (dspark.logprobs) read the forward's logits as they came.

Positions: a request whose KV cache holds n tokens has its anchor at position n. A round feeds
[x0, x1..x_l] at positions n..n+l and keeps x0 and the accepted drafts: n + 1 + accepted tokens.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from dspark.draft_packing import DraftProbs, pack_draft_probs
from dspark.feature_stash import FeaturePiece, FeatureStash
from dspark.logits_processing import LogitsProcessing
from dspark.logprobs import TokenLogprobs, grouped_token_logprobs
from dspark.models.draft_types import DraftBlock
from dspark.models.runner import ForwardItem, ForwardOutput, TargetRunner
from dspark.random_draws import CounterGenerator, RandomDraws, draw_uniforms
from dspark.rejection import VerificationRule, VerifyBatch, sample_first_tokens, verify
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


@dataclass
class PackedRound:
    """One `verify` call's inputs, packed for the forward and for rejection sampling."""

    requests: Sequence[VerifyRequest]
    """[num_requests] what is verified, in order."""
    chunks: Sequence[PrefillChunk]
    """[num_chunks] the prefill chunks read in the same forward, in order."""
    items: list[ForwardItem]
    """[num_requests + num_chunks] the flattened forward: each request's [anchor, admitted
    drafts] (logits at every position), then each chunk's tokens (logits at its last position,
    for a final chunk only)."""
    drafts: list[list[int]]
    """[num_requests] each request's admitted drafts x_1..x_l as host ints."""
    draft_lens: torch.Tensor
    """[num_requests] int64 l_r on the host (VerifyBatch's layout)."""
    draft_tokens: torch.Tensor
    """[num_drafts] int64 on the device, requests in order."""
    draft_probs: DraftProbs
    """[num_drafts, ...] their draft distributions on the device (dspark.draft_packing)."""
    draws: RandomDraws
    """The round's uniforms on the host, keyed by each request's seed and anchor position."""
    anchor_positions: list[int]
    """[num_requests] n_r: the tokens request r's KV cache holds before the round."""
    chunk_starts: list[int]
    """[num_chunks] where each chunk begins in its prompt (the tokens its cache holds)."""
    first_generators: list[CounterGenerator]
    """[num_final_chunks] the random numbers of each final chunk's first token."""
    grammar_states: list[GrammarState | None]
    """[num_requests + num_final_chunks] each request's, then each final chunk's grammar state
    (dspark.structured_output; None: unconstrained), as it stands before the round."""

    @property
    def num_verify_rows(self) -> int:
        """sum_r (l_r + 1): the forward's logit rows of the verified requests (they come first)."""
        return sum(len(d) for d in self.drafts) + len(self.requests)

    @property
    def final_chunks(self) -> list[PrefillChunk]:
        return [c for c in self.chunks if c.final]


@dataclass
class TargetRows:
    """The logit rows the target's distributions are made of (`target_rows`)."""

    verify: torch.Tensor
    """[num_verify_rows, vocab_size] request r's l_r + 1 rows, requests in order."""
    first: torch.Tensor
    """[num_final_chunks, vocab_size] each final chunk's last row (its first token's)."""


@dataclass
class RoundVerdict:
    """What rejection sampling and first-token sampling decided (`verify_round`)."""

    batch: VerifyBatch | None
    """The verified batch (None when the call verified no request)."""
    num_accepted: list[int]
    """[num_requests] accepted drafts."""
    output_tokens: list[list[int]]
    """[num_requests] accepted drafts, then the recovered or bonus token."""
    first_tokens: torch.Tensor | None
    """[num_final_chunks] int64 each final chunk's first token (None without final chunks)."""


def pack_round(requests: Sequence[VerifyRequest], prefill: Sequence[PrefillChunk],
               anchor_positions: Sequence[int], chunk_starts: Sequence[int], vocab_size: int,
               device: torch.device,
               grammar_states: Sequence[GrammarState | None] | None = None) -> PackedRound:
    """Step 1: host lists -> the forward's items and the drafts on `device`.
    anchor_positions [num_requests], chunk_starts [num_chunks]: what each request's KV cache
    holds before the call; grammar_states [num_requests + num_final_chunks] as
    PackedRound.grammar_states (None: no item is constrained)."""
    admitted = [_on_device(r.block, device) for r in requests
                if r.block is not None and r.num_drafts > 0]
    lens = [r.num_drafts if r.block is not None else 0 for r in requests]  # [R] l_r
    host_drafts = iter(_host_tokens(requests, admitted))
    drafts = [next(host_drafts) if n else [] for n in lens]
    items = [ForwardItem(r.request_id, [r.anchor_token] + d, logits_from=0)
             for r, d in zip(requests, drafts)]
    # A chunk needs logits only for its last token, and only if the prompt ends there.
    items += [ForwardItem(c.request_id, list(c.token_ids),
                          logits_from=None if c.final else len(c.token_ids)) for c in prefill]
    counts = [n for n in lens if n]
    draft_tokens = (torch.cat([b.tokens[:n] for b, n in zip(admitted, counts)]) if admitted
                    else torch.zeros(0, dtype=torch.int64, device=device))  # [num_drafts]
    draft_lens = torch.tensor(lens, dtype=torch.int64)  # [R] on the host: verify moves it
    generators = [CounterGenerator.resolve(r.generator, r.sampling.seed) for r in requests]
    num_final = sum(1 for c in prefill if c.final)
    grammar_states = ([None] * (len(requests) + num_final) if grammar_states is None
                      else list(grammar_states))
    assert len(grammar_states) == len(requests) + num_final, (len(grammar_states), num_final)
    return PackedRound(
        requests=requests, chunks=prefill, items=items, drafts=drafts, draft_lens=draft_lens,
        draft_tokens=draft_tokens,
        draft_probs=pack_draft_probs(admitted, counts, vocab_size, device),
        draws=draw_uniforms(draft_lens, generators, list(anchor_positions),
                            greedy=all(r.sampling.is_greedy for r in requests)),
        anchor_positions=list(anchor_positions), chunk_starts=list(chunk_starts),
        first_generators=[CounterGenerator.resolve(c.generator, c.sampling.seed)
                          for c in prefill if c.final],
        grammar_states=grammar_states)


def target_rows(logits: torch.Tensor, packed: PackedRound,
                processing: LogitsProcessing | None = None) -> TargetRows:
    """The one step where the forward's logits become the rows of the target's distributions:
    logits [num_verify_rows + num_final_chunks, vocab_size] -> TargetRows. `processing`: the
    requests' logits processing (dspark.logits_processing), having observed what the forward
    read (TargetVerifier.observe_forward); request r's row j is processed after its tokens and
    drafts x_1..x_j, a final chunk's row after its prompt. Then each constrained item's grammar
    mask (packed.grammar_states) on its processed rows. Without processed or constrained items
    the rows are the logits themselves (no copy)."""
    rows = packed.num_verify_rows
    num_final = len(packed.final_chunks)
    assert logits.shape[0] == rows + num_final, (logits.shape, rows)
    if processing:
        starts = itertools.accumulate((len(d) + 1 for d in packed.drafts), initial=0)
        finals = itertools.count(rows)
        logits = processing.apply(logits, [
            *((r.request_id, start, d) for r, d, start in zip(packed.requests, packed.drafts,
                                                               starts)),
            *((c.request_id, next(finals), ()) for c in packed.final_chunks)])
    # A final chunk's one row is a block without drafts.
    logits = _constrained(logits, packed.grammar_states, packed.drafts + [[]] * num_final)
    return TargetRows(verify=logits[:rows], first=logits[rows:])


def verify_round(packed: PackedRound, logits: torch.Tensor,
                 rule: VerificationRule = VerificationRule.TOKEN,
                 processing: LogitsProcessing | None = None) -> RoundVerdict:
    """Step 2, batched: the forward's logits [num_verify_rows + num_final_chunks, vocab_size]
    -> each request's verdict and each final chunk's first token (`processing`: as
    target_rows takes it; it is read, not changed). One device read for the verdicts, one for
    the first tokens."""
    target = target_rows(logits, packed, processing)
    batch, num_accepted, output_tokens = None, [], []
    if packed.requests:
        batch = VerifyBatch(draft_tokens=packed.draft_tokens, draft_lens=packed.draft_lens,
                            draft_probs=packed.draft_probs, target_logits=target.verify,
                            sampling=[r.sampling for r in packed.requests])
        result = verify(batch, packed.draws.to(logits.device), rule)
        num_accepted, output_tokens = result.to_host(batch)  # one device-to-host copy
    final = packed.final_chunks
    first_tokens = None
    if final:
        first_tokens = sample_first_tokens(  # [F]
            target.first, SamplingTensors.from_params([c.sampling for c in final],
                                                      device=logits.device),
            packed.first_generators,
            [s + len(c.token_ids) for c, s in zip(packed.chunks, packed.chunk_starts) if c.final],
            rule)
    return RoundVerdict(batch, num_accepted, output_tokens, first_tokens)


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
                prompt_lengths: Sequence[int | None] | None = None,
                grammars: Sequence[GrammarRequest | None] | None = None) -> PrefillOutput:
        """`logprobs`: per request as PrefillChunk.logprobs (None: no request asks);
        `prompt_lengths`: per request as PrefillChunk.prompt_length (None: all prompts);
        `grammars`: per request as PrefillChunk.grammar (None: none is constrained)."""
        logprobs = [None] * len(request_ids) if logprobs is None else logprobs
        prompt_lengths = [None] * len(request_ids) if prompt_lengths is None else prompt_lengths
        grammars = [None] * len(request_ids) if grammars is None else grammars
        chunks = [PrefillChunk(rid, list(p), True, s, g, logprobs=k, grammar=gr,
                               prompt_length=n)
                  for rid, p, s, g, k, gr, n in zip(request_ids, prompts, sampling, generators,
                                                    logprobs, grammars, prompt_lengths)]
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
            packed = self.pack(requests, prefill)
            start = time.perf_counter()
            out = self.runner.forward(packed.items)  # logits: l_r + 1 rows a request, 1 a final chunk
            step_seconds = time.perf_counter() - start
            self.observe_forward(packed)
            return self.commit(packed, out, self.verify_packed(packed, out.logits), step_seconds)
        except BaseException:
            for chunk in new:
                self.runner.free(chunk.request_id)
                self.processing.release(chunk.request_id)
                self.grammar_states.pop(chunk.request_id, None)
            raise

    def pack(self, requests: Sequence[VerifyRequest],
             prefill: Sequence[PrefillChunk] = ()) -> PackedRound:
        """Step 1 (`pack_round`) at the positions this verifier's KV caches hold, with the
        grammar states of the constrained items (built from a replay where one is sent)."""
        states = [*(self._grammar_state(r.request_id, r.grammar) for r in requests),
                  *(self._grammar_state(c.request_id, c.grammar) for c in prefill if c.final)]
        return pack_round(requests, prefill,
                          anchor_positions=[self.runner.length(r.request_id) for r in requests],
                          chunk_starts=[self.runner.length(c.request_id) for c in prefill],
                          vocab_size=self.vocab_size, device=self.runner.device,
                          grammar_states=states)

    def observe_forward(self, packed: PackedRound) -> None:
        """The tokens the round's forward read enter their requests' logits processing (after
        the forward: a forward the KV cache refused changes nothing): each chunk's tokens and
        each verified request's anchor; `commit` adds the accepted drafts. A request without
        processing costs a dictionary look-up."""
        if not self.processing:
            return
        for req in packed.requests:
            self.processing.observe_output(req.request_id, (req.anchor_token,))
        for chunk in packed.chunks:
            self.processing.observe(chunk.request_id, chunk.token_ids, chunk.prompt_length)

    def verify_packed(self, packed: PackedRound, logits: torch.Tensor) -> RoundVerdict:
        """Step 2 (`verify_round`) under this verifier's rule and its requests' logits
        processing (after `observe_forward`); logits [rows, vocab_size] as the forward of
        packed.items returned them."""
        return verify_round(packed, logits, self.rule, self.processing)

    def commit(self, packed: PackedRound, out: ForwardOutput, verdict: RoundVerdict,
               step_seconds: float) -> VerifyOutput:
        """Step 3: keep what the verdict accepted. Each request's KV cache is truncated to its
        anchor and accepted drafts; their features are returned, or held (`take_features`);
        the chunks' features likewise; log-probabilities for the items that asked. Grammar
        states advance by each request's output tokens and each final chunk's first token."""
        requests, prefill = packed.requests, packed.chunks
        rows = packed.num_verify_rows
        self._advance_grammars(packed, verdict)
        features = []
        for i, (req, old, accepted) in enumerate(zip(requests, packed.anchor_positions,
                                                     verdict.num_accepted)):
            self.runner.truncate(req.request_id, old + 1 + accepted)  # drop rejected drafts
            self.processing.observe_output(req.request_id, verdict.output_tokens[i][:accepted])
            flat = self._flat_features(out.hidden_of(i)[:1 + accepted]
                                       if out.hidden is not None else None)
            # Once a request holds features, later ones are held too: its context stays in order.
            if (req.hold_features or req.request_id in self.stash) and flat is not None:
                committed = [req.anchor_token] + verdict.output_tokens[i][:accepted]
                self.stash.hold(req.request_id, FeaturePiece(
                    flat, torch.arange(old, old + 1 + accepted),
                    torch.tensor(committed, dtype=torch.int64)))
                flat = None
            features.append(flat)
        logprobs = (_output_logprobs(requests, [len(d) for d in packed.drafts],
                                     verdict.output_tokens, out.logits[:rows])
                    if requests else None)
        chunks = self._chunk_outputs(packed, out, verdict, out.logits[rows:])
        if chunks is not None:
            for i, (chunk, start) in enumerate(zip(prefill, packed.chunk_starts)):
                held = chunk.hold_features or chunk.request_id in self.stash
                if held and chunks.features[i] is not None:
                    self.stash.hold(chunk.request_id, FeaturePiece(
                        chunks.features[i], torch.arange(start, start + len(chunk.token_ids)),
                        torch.tensor(list(chunk.token_ids), dtype=torch.int64)))
                    chunks.features[i] = None
        return VerifyOutput(verdict.num_accepted, verdict.output_tokens, features,
                            batch_tokens=rows, step_seconds=step_seconds, prefill=chunks,
                            prefill_tokens=sum(len(c.token_ids) for c in prefill),
                            logprobs=logprobs)

    def _advance_grammars(self, packed: PackedRound, verdict: RoundVerdict) -> None:
        """Each constrained request's grammar state observes its output tokens (accepted drafts
        and the recovered or bonus token), each constrained final chunk's its first token."""
        states = packed.grammar_states
        if all(s is None for s in states):
            return
        first = ([[t] for t in verdict.first_tokens.tolist()]
                 if verdict.first_tokens is not None else [])  # [num_final_chunks]
        for state, tokens in zip(states, [*verdict.output_tokens, *first]):
            if state is not None:
                state.observe(tokens)

    def _chunk_outputs(self, packed: PackedRound, out: ForwardOutput, verdict: RoundVerdict,
                       logits: torch.Tensor) -> ChunkOutput | None:
        """The chunks' first tokens (final chunks), their log-probabilities from `logits`
        [num_final, V] where asked, and every chunk's features; None without chunks."""
        prefill = packed.chunks
        if not prefill:
            return None
        final = packed.final_chunks
        first: list[int | None] = [None] * len(prefill)
        logprobs: list[TokenLogprobs | None] | None = None
        if final:
            sampled = iter(verdict.first_tokens.tolist())
            first = [next(sampled) if c.final else None for c in prefill]
            asked = [c.logprobs for c in final]
            if any(k is not None for k in asked):
                rows = iter(_rows_logprobs(logits, verdict.first_tokens, asked))
                logprobs = [next(rows) if c.final else None for c in prefill]
        first_item = len(packed.requests)
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

    def fork(self, parent_id: Hashable, child_id: Hashable, token_ids: Sequence[int],
             sampling: SamplingParams, generator: CounterGenerator | None = None) -> None:
        """A new request `child_id` whose KV cache holds a copy of `parent_id`'s first
        len(token_ids) tokens (which are `token_ids`, the prompt both share), its logits
        processing started under `sampling` having read them; its next prefill chunk continues
        from there (`PrefillChunk.continued`). The parent's held features stay its own: the
        caller hands them to the drafter first. KVCacheFull (nothing changed) when the copy
        does not fit. `generator`: the child's random numbers (here its chunks bring them; a
        remote verifier sends their seed)."""
        if self.runner.has_request(child_id):
            raise ValueError(f"fork into {child_id!r}: request already held")
        self.runner.fork(parent_id, child_id, len(token_ids))
        self.processing.start(child_id, sampling)
        self.processing.observe(child_id, token_ids)

    def release(self, request_id: Hashable) -> None:
        self.grammar_states.pop(request_id, None)
        self.stash.drop(request_id)
        self.processing.release(request_id)
        if self.runner.has_request(request_id):
            self.runner.free(request_id)


def _constrained(logits: torch.Tensor, states: Sequence[GrammarState | None],
                 drafts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The target rows of a round with each constrained item's grammar mask applied:
    logits [sum_i (l_i + 1), V], item i's rows in order (its drafts [l_i] as host ints; a final
    chunk: none); states [num_items] (None: that item's rows stay as they are). The same tensor
    when no item is constrained."""
    assert len(states) == len(drafts), (len(states), len(drafts))
    if all(s is None for s in states):
        return logits
    vocab_size = logits.shape[1]
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # [rows, V] on the host
    row = 0
    for state, item_drafts in zip(states, drafts):
        if state is not None:
            mask = state.row_masks(item_drafts)  # [l_i + 1, V_grammar]
            width = min(vocab_size, mask.shape[1])
            allowed[row:row + mask.shape[0], :width] = mask[:, :width]
            allowed[row:row + mask.shape[0], width:] = False  # beyond the tokenizer
        row += len(item_drafts) + 1
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
