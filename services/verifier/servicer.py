"""The Verifier gRPC servicer: dspark.verifier.TargetVerifier behind `dspark.v1.Verifier`.

It adds only what a network boundary needs: string request ids, per-request random streams
(the scheduler's generators cannot travel), input validation with INVALID_ARGUMENT naming the
problem, NOT_FOUND for a request this process does not hold (after a restart the scheduler
re-prefills it), and one lock, because the target runner serves one call at a time.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import grpc
import torch

from dspark.cost_table import CostTable
from dspark.feature_stash import FeaturePiece, joined
from dspark.models.kv_cache import KVCacheFull
from dspark.serving import messages, tensor_codec
from dspark.serving.grpc_errors import HANDLED, abort_with
from dspark.serving.idle_expiry import IdleExpiry
from dspark.serving.protos import pb, rpc
from dspark.serving.tracing import incoming_context
from dspark.verifier import PrefillChunk, TargetVerifier, VerifyRequest


@dataclass(frozen=True)
class VerifierLimits:
    max_context_tokens: int
    """Longest prompt + output of one request."""
    idle_expiry_seconds: float = 0.0
    """Free a request untouched this long (dspark.serving.idle_expiry); 0 = never."""


class VerifierServicer(rpc.verifier.VerifierServicer):
    def __init__(self, verifier: TargetVerifier, cost_table: CostTable, limits: VerifierLimits,
                 name: str, tracer) -> None:
        self.verifier = verifier
        self.cost_table = cost_table
        self.limits = limits
        self.name = name
        self.tracer = tracer
        self._lock = threading.Lock()
        self._generators: dict[str, torch.Generator | None] = {}
        self._idle = IdleExpiry(limits.idle_expiry_seconds)

    # -- helpers ----------------------------------------------------------------------------
    def _span(self, name: str, context: grpc.ServicerContext):
        return self.tracer.start_as_current_span(
            name, context=incoming_context(context.invocation_metadata()))

    def _release_locked(self, request_id: str) -> None:
        self.verifier.release(request_id)
        self._generators.pop(request_id, None)
        self._idle.forget(request_id)

    def _expire_idle_locked(self) -> None:
        for rid in self._idle.expired():
            self._release_locked(rid)

    @staticmethod
    def _abort_on(context: grpc.ServicerContext, error: Exception) -> None:
        """INVALID_ARGUMENT, RESOURCE_EXHAUSTED or INTERNAL with the error's message
        (dspark.serving.grpc_errors), never grpc's bare UNKNOWN."""
        abort_with(context, error)

    # -- RPCs -------------------------------------------------------------------------------
    def Info(self, request, context):
        runner = self.verifier.runner
        with self._lock:
            held = sorted(self._generators)
            usage = self.verifier.kv_cache_usage
        return pb.verifier.VerifierInfo(vocab_size=self.verifier.vocab_size,
                                        hidden_layer_ids=list(runner.config.hidden_layer_ids),
                                        name=self.name,
                                        max_context_tokens=self.limits.max_context_tokens,
                                        active_requests=held,
                                        kv_cache_tokens=runner.cache.manager.capacity_tokens,
                                        kv_block_size=runner.cache.manager.block_size,
                                        kv_cache_usage=usage)

    def Prefill(self, request, context):
        with self._span("verifier.prefill", context) as span:
            span.set_attribute("dspark.num_requests", len(request.items))
            try:
                ids, prompts, params, logprobs, prompt_lengths, grammars = \
                    self._check_prefill(request)
            except ValueError as e:
                self._abort_on(context, e)
            with self._lock:
                self._expire_idle_locked()
                for rid in ids:  # a re-prefill (restore) replaces whatever was held
                    self._release_locked(rid)
                generators = [p.generator() for p in params]
                try:
                    # A restore samples nothing that counts: its grammar states are rebuilt
                    # from the requests' outputs instead.
                    out = self.verifier.prefill(ids, prompts, params, generators, logprobs,
                                                prompt_lengths,
                                                None if request.restore else grammars)
                    if request.restore:
                        for rid, grammar in zip(ids, grammars):
                            if grammar is not None:
                                self.verifier.grammar_states[rid] = \
                                    self.verifier.grammars.state_for(grammar)
                except HANDLED as e:
                    self._abort_on(context, e)
                for rid, g in zip(ids, generators):
                    self._generators[rid] = g
                    self._idle.touch(rid)
                for item, rid, prompt, f in zip(request.items, ids, prompts, out.features):
                    if item.HasField("held_from") and f is not None:  # a restore's held part
                        start = int(item.held_from)
                        self.verifier.stash.hold(rid, FeaturePiece(
                            f[start:], torch.arange(start, len(prompt)),
                            torch.tensor(prompt[start:], dtype=torch.int64)))
                usage = self.verifier.kv_cache_usage
            first_logprobs = out.logprobs or [None] * len(ids)
            results = [pb.verifier.PrefillResult(
                first_token=int(t), features=pb.common.Tensor() if request.restore
                else tensor_codec.encode(f), logprobs=messages.logprobs_to_pb(lp))
                for t, f, lp in zip(out.first_tokens, out.features, first_logprobs)]
            return pb.verifier.PrefillReply(results=results, kv_cache_usage=usage)

    def _check_prefill(self, request):
        self._check_prompts(request.items)
        for item in request.items:
            if item.HasField("held_from") and not (
                    request.restore and 0 <= item.held_from <= len(item.prompt_ids)):
                raise ValueError(f"{item.request_id}: held_from {item.held_from} needs a restore "
                                 f"and a position in 0..{len(item.prompt_ids)}")
        return ([item.request_id for item in request.items],
                [list(item.prompt_ids) for item in request.items],
                [messages.sampling_from_pb(item.sampling) for item in request.items],
                [messages.num_top_from_pb(item) for item in request.items],
                [_prompt_length(item) for item in request.items],
                [self._grammar(item, True) for item in request.items])

    def _check_prompts(self, items) -> None:
        """Prompts (whole, or chunks that may continue what the cache holds): a request id,
        each request once, tokens in the vocabulary, within the context."""
        vocab = self.verifier.vocab_size
        seen = set()
        for item in items:
            rid = item.request_id
            if not rid:
                raise ValueError("prefill item without request_id")
            if rid in seen:
                raise ValueError(f"request {rid} appears twice in one call")
            seen.add(rid)
            prompt = list(item.prompt_ids)
            if not prompt:
                raise ValueError(f"{rid}: empty prompt")
            held = self.verifier.runner.length(rid) if item.continued else 0
            if held + len(prompt) >= self.limits.max_context_tokens:
                raise ValueError(f"{rid}: prompt of {held + len(prompt)} tokens does not fit "
                                 f"the context of {self.limits.max_context_tokens}")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"{rid}: prompt token outside the vocabulary 0..{vocab - 1}")

    def Verify(self, request, context):
        with self._span("verifier.verify", context) as span:
            with self._lock:
                self._expire_idle_locked()
                runner = self.verifier.runner
                held = [it.request_id for it in request.items] + [
                    it.request_id for it in request.prefill if it.continued]
                missing = [rid for rid in held if not runner.has_request(rid)]
                if missing:
                    context.abort(grpc.StatusCode.NOT_FOUND,
                                  f"requests not held by this verifier: {','.join(missing)}")
                try:
                    self._check_prompts(request.prefill)
                    for it in request.prefill:  # a first chunk replaces whatever was held
                        if not it.continued:
                            self._release_locked(it.request_id)
                    batch = [self._verify_request(it, runner) for it in request.items]
                    chunks = [self._prefill_chunk(it) for it in request.prefill]
                    out = self.verifier.verify(batch, chunks)
                except HANDLED as e:
                    for it in request.prefill:
                        if not it.continued:
                            self._generators.pop(it.request_id, None)
                    self._abort_on(context, e)
                for rid in [*held, *(it.request_id for it in request.prefill)]:
                    self._idle.touch(rid)
                usage = self.verifier.kv_cache_usage
            span.set_attribute("dspark.batch_tokens", out.batch_tokens)
            span.set_attribute("dspark.prefill_tokens", out.prefill_tokens)
            span.set_attribute("dspark.num_accepted", list(out.num_accepted))
            logprobs = out.logprobs or [None] * len(out.output_tokens)
            results = [pb.verifier.VerifyResult(num_accepted=int(n), output_tokens=tokens,
                                                features=tensor_codec.encode(f),
                                                logprobs=messages.logprobs_to_pb(lp))
                       for n, tokens, f, lp in zip(out.num_accepted, out.output_tokens,
                                                   out.features, logprobs)]
            prefill = [] if out.prefill is None else [
                pb.verifier.PrefillResult(first_token=-1 if t is None else int(t),
                                          features=tensor_codec.encode(f),
                                          logprobs=messages.logprobs_to_pb(lp))
                for t, f, lp in zip(out.prefill.first_tokens, out.prefill.features,
                                    out.prefill.logprobs or [None] * len(request.prefill))]
            return pb.verifier.VerifyBatchReply(results=results, batch_tokens=out.batch_tokens,
                                                step_seconds=out.step_seconds,
                                                prefill_results=prefill,
                                                prefill_tokens=out.prefill_tokens,
                                                kv_cache_usage=usage)

    def _prefill_chunk(self, item) -> PrefillChunk:
        params = messages.sampling_from_pb(item.sampling)
        if not item.continued:
            self._generators[item.request_id] = params.generator()
        return PrefillChunk(item.request_id, list(item.prompt_ids), not item.more, params,
                            self._generators.get(item.request_id), continued=item.continued,
                            hold_features=item.hold_features,
                            logprobs=messages.num_top_from_pb(item),
                            prompt_length=_prompt_length(item),
                            grammar=self._grammar(item, not item.more))

    def _grammar(self, item, allowed: bool):
        """The item's grammar (messages.grammar_from_pb), checked: only where one is taken (a
        final chunk, a verify item, a restore), compiled by this process, and a state to use
        (given, or held here). ValueError / InvalidGrammar (INVALID_ARGUMENT) otherwise."""
        grammar = messages.grammar_from_pb(item)
        if grammar is None:
            return None
        if not allowed:
            raise ValueError(f"{item.request_id}: a grammar on a chunk that samples nothing")
        if self.verifier.grammars is None:
            raise ValueError("this verifier has no tokenizer for structured output")
        self.verifier.grammars.compile(grammar.spec)  # InvalidGrammar names a bad schema
        if grammar.replay is None and item.request_id not in self.verifier.grammar_states:
            raise ValueError(f"{item.request_id}: no grammar state held here (send rebuild)")
        vocab = self.verifier.vocab_size
        if any(not 0 <= t < vocab for t in grammar.stop_token_ids + (grammar.replay or ())):
            raise ValueError(f"{item.request_id}: grammar token ids outside the vocabulary")
        return grammar

    def _verify_request(self, item, runner) -> VerifyRequest:
        vocab = self.verifier.vocab_size
        if not 0 <= item.anchor_token < vocab:
            raise ValueError(f"{item.request_id}: anchor_token {item.anchor_token} outside the "
                             f"vocabulary 0..{vocab - 1}")
        block, n = messages.admitted_drafts_from_pb(item, vocab)
        if runner.length(item.request_id) + 1 + n > self.limits.max_context_tokens:
            raise ValueError(f"{item.request_id}: would exceed the context of "
                             f"{self.limits.max_context_tokens} tokens")
        return VerifyRequest(item.request_id, int(item.anchor_token), block, n,
                             messages.sampling_from_pb(item.sampling),
                             self._generators.get(item.request_id),
                             hold_features=item.hold_features,
                             logprobs=messages.num_top_from_pb(item),
                             grammar=self._grammar(item, True))

    def TakeFeatures(self, request, context):
        with self._span("verifier.take_features", context) as span:
            span.set_attribute("dspark.num_requests", len(request.request_ids))
            with self._lock:
                missing = [rid for rid in request.request_ids
                           if not self.verifier.runner.has_request(rid)]
                if missing:
                    context.abort(grpc.StatusCode.NOT_FOUND,
                                  f"requests not held by this verifier: {','.join(missing)}")
                taken = self.verifier.take_features(list(request.request_ids))
                for rid in request.request_ids:
                    self._idle.touch(rid)
            results = []
            for rid, pieces in zip(request.request_ids, taken):
                if not pieces:  # nothing held: empty tensors
                    results.append(pb.verifier.HeldFeatures(request_id=rid))
                    continue
                piece = joined(pieces)
                results.append(pb.verifier.HeldFeatures(
                    request_id=rid, features=tensor_codec.encode(piece.features),
                    positions=tensor_codec.encode(piece.positions),
                    token_ids=tensor_codec.encode(piece.token_ids)))
            return pb.verifier.TakeFeaturesReply(results=results)

    def Fork(self, request, context):
        with self._span("verifier.fork", context):
            with self._lock:
                self._expire_idle_locked()
                parent, child = request.parent_id, request.child_id
                if not self.verifier.runner.has_request(parent):
                    context.abort(grpc.StatusCode.NOT_FOUND,
                                  f"requests not held by this verifier: {parent}")
                try:
                    tokens = self._check_fork(request)
                    self._release_locked(child)  # a fork replaces whatever was held
                    params = messages.sampling_from_pb(request.sampling)
                    self.verifier.fork(parent, child, tokens, params)
                except HANDLED as e:
                    self._abort_on(context, e)
                self._generators[child] = params.generator()
                for rid in (parent, child):
                    self._idle.touch(rid)
                usage = self.verifier.kv_cache_usage
            return pb.verifier.ForkReply(kv_cache_usage=usage)

    def _check_fork(self, request) -> list[int]:
        """The fork's tokens: a child id other than the parent's, 1..the parent's length
        tokens in the vocabulary (ValueError otherwise)."""
        tokens = list(request.token_ids)
        held = self.verifier.runner.length(request.parent_id)
        if not request.child_id or request.child_id == request.parent_id:
            raise ValueError("fork needs a child_id other than its parent_id")
        if not 0 < len(tokens) <= held:
            raise ValueError(f"{request.child_id}: fork of {len(tokens)} tokens from "
                             f"{request.parent_id}, which holds {held}")
        if min(tokens) < 0 or max(tokens) >= self.verifier.vocab_size:
            raise ValueError(f"{request.child_id}: fork token outside the vocabulary")
        return tokens

    def Release(self, request, context):
        with self._lock:
            for rid in request.request_ids:
                self._release_locked(rid)
            usage = self.verifier.kv_cache_usage
        return pb.verifier.ReleaseReply(kv_cache_usage=usage)

    def GetCostTable(self, request, context):
        t = self.cost_table
        return pb.verifier.CostTableReply(batch_tokens=t.batch_tokens, step_seconds=t.step_seconds,
                                          meta_json=json.dumps(t.meta),
                                          draft_seconds=t.draft_seconds)


def _prompt_length(item) -> int | None:
    """A PrefillItem's `optional int64 prompt_length`: None when absent; ValueError when
    negative."""
    if not item.HasField("prompt_length"):
        return None
    if item.prompt_length < 0:
        raise ValueError(f"{item.request_id}: prompt_length must be >= 0, got "
                         f"{item.prompt_length}")
    return int(item.prompt_length)
