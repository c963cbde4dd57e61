"""RemoteVerifier: the TargetVerifier interface (prefill, verify, release, vocab_size,
kv_cache_usage) over gRPC.

The engine cannot tell it from the in-process TargetVerifier. It also keeps, per live request,
the prompt and every token produced so far, which is what a restarted verifier needs: when a call
fails because the verifier is unavailable or no longer holds a request (NOT_FOUND), it waits for
the verifier to come back, re-prefills those requests' caches from their tokens (`restore`) and
retries the call. Greedy requests then continue token for token as if nothing happened; sampled
ones continue from a fresh random stream (still exact in distribution).

Grammar states (structured output) live there too: a restore sends each constrained request's
grammar with its produced tokens, and the new process rebuilds the state from them.

Held features (`hold_features`, dspark.feature_stash) live in the verifier process; a restart
loses them. So it also remembers, per request, the first position it asked the verifier to hold
and has not taken back since; a restore asks the new process to hold the restored tokens'
features from there (`held_from`), and the drafter's context stays whole.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import grpc
import torch

from dspark.cost_table import CostTable
from dspark.feature_stash import FeaturePiece
from dspark.logprobs import TokenLogprobs
from dspark.models.kv_cache import KVCacheFull
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams
from dspark.serving import messages, tensor_codec
from dspark.serving.grpc_runtime import channel
from dspark.serving.protos import pb, rpc
from dspark.serving.tracing import outgoing_metadata
from dspark.structured_output import GrammarRequest
from dspark.verifier import ChunkOutput, PrefillChunk, PrefillOutput, VerifyOutput, VerifyRequest

# Codes after which the request is retried once the verifier is back, its caches restored.
_RESTORABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)


class VerifierRejected(ValueError):
    """The verifier refused a call as invalid (INVALID_ARGUMENT / RESOURCE_EXHAUSTED)."""


class VerifierKVCacheFull(VerifierRejected, KVCacheFull):
    """The verifier's KV cache could not hold the call's tokens (RESOURCE_EXHAUSTED); nothing
    changed there (the remote side of dspark.models.kv_cache.KVCacheFull: the engine preempts)."""

    def __init__(self, details: str) -> None:
        Exception.__init__(self, details)


@dataclass
class _History:
    prompt_ids: list[int]
    sampling: SamplingParams
    produced: list[int] = field(default_factory=list)
    """Every token produced since the prompt; the last one is the anchor (not in the KV cache)."""
    prompt_length: int | None = None
    """A recomputed request (its chunks re-read output): the true prompt's length; None = all of
    prompt_ids is prompt."""


class RemoteVerifier:
    def __init__(self, address: str, wait_seconds: float = 60.0,
                 on_restore: Callable[[list[str]], None] | None = None,
                 internal_token: str = "") -> None:
        self.address = address
        self.wait_seconds = wait_seconds
        self.on_restore = on_restore
        """Called with the request ids whose caches were rebuilt (metrics, logs)."""
        self._channel = channel(address, internal_token)
        self._stub = rpc.verifier.VerifierStub(self._channel)
        info = self._stub.Info(pb.common.InfoRequest(), wait_for_ready=True, timeout=wait_seconds)
        self.vocab_size = int(info.vocab_size)
        self.hidden_layer_ids = list(info.hidden_layer_ids)
        self.max_context_tokens = int(info.max_context_tokens)
        self.kv_cache_tokens = int(info.kv_cache_tokens)
        """All requests' KV capacity in the verifier (0 from a verifier that does not say)."""
        self.kv_block_size = max(1, int(info.kv_block_size))
        self.kv_cache_usage = float(info.kv_cache_usage)
        """The fraction of the verifier's KV cache blocks in use, as its last reply said."""
        self.name = info.name
        self._history: dict[str, _History] = {}
        self._held_from: dict[str, int] = {}
        self._grammars: dict[str, GrammarRequest] = {}
        """Per constrained request, its grammar (spec and stop tokens)."""
        """Per request, the first position whose features the verifier holds (not yet taken)."""

    # -- the TargetVerifier interface -------------------------------------------------------
    def prefill(self, request_ids: Sequence[Hashable], prompts: Sequence[Sequence[int]],
                sampling: Sequence[SamplingParams],
                generators: Sequence[CounterGenerator | None],
                logprobs: Sequence[int | None] | None = None,
                prompt_lengths: Sequence[int | None] | None = None,
                grammars: Sequence[GrammarRequest | None] | None = None) -> PrefillOutput:
        """(generators are the scheduler's; the verifier seeds its own from sampling.seed.)
        `prompt_lengths`: as TargetVerifier.prefill's (a resumed request's prompt proper)."""
        ids = [str(r) for r in request_ids]
        logprobs = [None] * len(ids) if logprobs is None else logprobs
        # The seed each request is sent with (its own, else the scheduler's fresh one), kept for
        # a restore, so that the verifier keys the request as the drafter does.
        sampling = [seeded(s, g) for s, g in zip(sampling, generators)]
        grammars = [None] * len(ids) if grammars is None else grammars
        prompt_lengths = [None] * len(ids) if prompt_lengths is None else prompt_lengths
        request = pb.verifier.PrefillRequest(items=[
            pb.verifier.PrefillItem(request_id=rid, prompt_ids=list(p),
                                    sampling=messages.sampling_to_pb(s), logprobs=k,
                                    prompt_length=n, grammar=messages.grammar_to_pb(g))
            for rid, p, s, k, g, n in zip(ids, prompts, sampling, logprobs, grammars,
                                          prompt_lengths)])
        self._remember_grammars(ids, grammars)
        reply = self._call(self._stub.Prefill, request, restore_ids=[])
        self.kv_cache_usage = reply.kv_cache_usage
        first = [int(r.first_token) for r in reply.results]
        for rid, p, s, t, n in zip(ids, prompts, sampling, first, prompt_lengths):
            self._history[rid] = _History(list(p), s, [t], n)
        return PrefillOutput(first, [tensor_codec.decode(r.features) for r in reply.results],
                             _asked_logprobs(reply.results, [1] * len(ids), logprobs))

    def verify(self, requests: Sequence[VerifyRequest],
               prefill: Sequence[PrefillChunk] = ()) -> VerifyOutput:
        for req in requests:  # a recomputed request (Engine preemption) read no anchor yet
            history = self._history.get(str(req.request_id))
            if history is not None and not history.produced:
                history.produced.append(int(req.anchor_token))
        items = []
        for req in requests:
            tokens, probs, indices = messages.admitted_drafts_to_pb(req.block, req.num_drafts)
            items.append(pb.verifier.VerifyItem(
                request_id=str(req.request_id), anchor_token=int(req.anchor_token),
                draft_tokens=tokens, draft_probs=probs, draft_indices=indices,
                sampling=messages.sampling_to_pb(req.sampling, req.generator),
                hold_features=req.hold_features, logprobs=req.logprobs,
                grammar=messages.grammar_to_pb(req.grammar)))
        chunks = [pb.verifier.PrefillItem(request_id=str(c.request_id), prompt_ids=list(c.token_ids),
                                          sampling=messages.sampling_to_pb(c.sampling,
                                                                           c.generator),
                                          continued=c.continued, more=not c.final,
                                          hold_features=c.hold_features,
                                          logprobs=c.logprobs if c.final else None,
                                          prompt_length=c.prompt_length,
                                          grammar=messages.grammar_to_pb(c.grammar))
                  for c in prefill]
        ids = [str(r.request_id) for r in requests]
        self._remember_grammars(ids + [str(c.request_id) for c in prefill],
                                [r.grammar for r in requests] + [c.grammar for c in prefill])
        continued = [str(c.request_id) for c in prefill if c.continued]
        reply = self._call(self._stub.Verify,
                           pb.verifier.VerifyBatchRequest(items=items, prefill=chunks),
                           restore_ids=ids + continued)
        self.kv_cache_usage = reply.kv_cache_usage
        self._remember_held(requests, prefill)
        outputs = [list(r.output_tokens) for r in reply.results]
        for rid, tokens in zip(ids, outputs):
            if rid in self._history:
                self._history[rid].produced += tokens
        chunk_out = None
        if prefill:
            first = [None if r.first_token < 0 else int(r.first_token)
                     for r in reply.prefill_results]
            self._remember_chunks(prefill, first)
            chunk_out = ChunkOutput(first, [tensor_codec.decode(r.features)
                                            for r in reply.prefill_results],
                                    _asked_logprobs(reply.prefill_results, [1] * len(prefill),
                                                    [c.logprobs if c.final else None
                                                     for c in prefill]))
        return VerifyOutput([int(r.num_accepted) for r in reply.results], outputs,
                            [tensor_codec.decode(r.features) for r in reply.results],
                            batch_tokens=int(reply.batch_tokens),
                            step_seconds=float(reply.step_seconds), prefill=chunk_out,
                            prefill_tokens=int(reply.prefill_tokens),
                            logprobs=_asked_logprobs(reply.results, [len(t) for t in outputs],
                                                     [r.logprobs for r in requests]))

    def _remember_grammars(self, ids: Sequence[str],
                           grammars: Sequence[GrammarRequest | None]) -> None:
        """Each constrained request's grammar, which a restore rebuilds from its output."""
        for rid, grammar in zip(ids, grammars):
            if grammar is not None:
                self._grammars[rid] = dataclasses.replace(grammar, replay=None)

    def _remember_held(self, requests: Sequence[VerifyRequest],
                       prefill: Sequence[PrefillChunk]) -> None:
        """Where each request's held features start (before the call's tokens are recorded)."""
        for req in requests:
            rid = str(req.request_id)
            if req.hold_features and rid in self._history and rid not in self._held_from:
                h = self._history[rid]
                self._held_from[rid] = len(h.prompt_ids) + len(h.produced) - 1  # the anchor
        for chunk in prefill:
            rid = str(chunk.request_id)
            if not chunk.continued:
                self._held_from.pop(rid, None)  # a first chunk replaces whatever was held
            if chunk.hold_features and rid not in self._held_from:
                h = self._history.get(rid)
                self._held_from[rid] = len(h.prompt_ids) if chunk.continued and h else 0

    def _remember_chunks(self, prefill: Sequence[PrefillChunk], first: list[int | None]) -> None:
        """History of chunked prompts: the tokens read so far (what a restore re-reads), then the
        first token once the prompt is complete."""
        for chunk, token in zip(prefill, first):
            rid = str(chunk.request_id)
            if not chunk.continued or rid not in self._history:
                self._history[rid] = _History([], seeded(chunk.sampling, chunk.generator))
            history = self._history[rid]
            history.prompt_ids += list(chunk.token_ids)
            if chunk.prompt_length is not None:
                history.prompt_length = chunk.prompt_length
            if token is not None:
                history.produced.append(token)

    def take_features(self, request_ids: Sequence[Hashable]) -> list[list[FeaturePiece]]:
        """The features the verifier held for these requests: one piece each (none where
        nothing is held), forgotten there."""
        ids = [str(r) for r in request_ids]
        reply = self._call(self._stub.TakeFeatures,
                           pb.verifier.TakeFeaturesRequest(request_ids=ids), restore_ids=ids)
        taken = []
        for rid, held in zip(ids, reply.results):
            self._held_from.pop(rid, None)
            features = tensor_codec.decode(held.features)
            positions, tokens = (tensor_codec.decode(held.positions),
                                 tensor_codec.decode(held.token_ids))
            taken.append([] if features is None else [FeaturePiece(features, positions, tokens)])
        return taken

    def fork(self, parent_id: Hashable, child_id: Hashable, token_ids: Sequence[int],
             sampling: SamplingParams, generator: CounterGenerator | None = None) -> None:
        """TargetVerifier.fork over the wire (`generator`: the child's, whose seed the verifier
        keys it by); a verifier that lost the parent rebuilds it first."""
        rid, cid = str(parent_id), str(child_id)
        sampling = seeded(sampling, generator)
        request = pb.verifier.ForkRequest(parent_id=rid, child_id=cid, token_ids=list(token_ids),
                                          sampling=messages.sampling_to_pb(sampling))
        reply = self._call(self._stub.Fork, request, restore_ids=[rid])
        self.kv_cache_usage = reply.kv_cache_usage
        self._history[cid] = _History(list(token_ids), sampling)
        self._held_from.pop(cid, None)

    def release(self, request_id: Hashable) -> None:
        rid = str(request_id)
        self._history.pop(rid, None)
        self._held_from.pop(rid, None)
        self._grammars.pop(rid, None)
        try:
            reply = self._stub.Release(pb.verifier.ReleaseRequest(request_ids=[rid]), timeout=5.0,
                                       metadata=outgoing_metadata())
            self.kv_cache_usage = reply.kv_cache_usage
        except grpc.RpcError:
            pass  # a verifier that is down holds nothing; a restarted one never saw the request

    # -- beyond the interface ---------------------------------------------------------------
    def cost_table(self) -> CostTable:
        reply = self._stub.GetCostTable(pb.common.InfoRequest(), timeout=30.0)
        return CostTable(list(reply.batch_tokens), list(reply.step_seconds),
                         meta=json.loads(reply.meta_json or "{}"),
                         draft_seconds=reply.draft_seconds)

    def close(self) -> None:
        self._channel.close()

    # -- faults -----------------------------------------------------------------------------
    def _call(self, method, request, restore_ids: list[str]):
        deadline = time.monotonic() + self.wait_seconds
        while True:
            try:
                return method(request, metadata=outgoing_metadata(), wait_for_ready=True,
                              timeout=max(1.0, deadline - time.monotonic()))
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise VerifierKVCacheFull(e.details()) from e
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise VerifierRejected(e.details()) from e
                if code not in _RESTORABLE or time.monotonic() >= deadline:
                    raise
            if restore_ids:
                try:
                    self._restore(restore_ids, deadline)
                except grpc.RpcError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)

    def _restore(self, request_ids: list[str], deadline: float) -> None:
        """Rebuild the KV caches of these requests: prompt + produced tokens except the anchor."""
        live = [rid for rid in request_ids if rid in self._history]
        items = []
        for rid in live:
            h = self._history[rid]
            grammar = self._grammars.get(rid)
            if grammar is not None:  # the state after every produced token, the anchor's too
                grammar = dataclasses.replace(grammar, replay=tuple(h.produced))
            items.append(pb.verifier.PrefillItem(request_id=rid,
                                                 prompt_ids=h.prompt_ids + h.produced[:-1],
                                                 sampling=messages.sampling_to_pb(h.sampling),
                                                 held_from=self._held_from.get(rid),
                                                 prompt_length=(len(h.prompt_ids)
                                                                if h.prompt_length is None
                                                                else h.prompt_length),
                                                 grammar=messages.grammar_to_pb(grammar)))
        reply = self._stub.Prefill(pb.verifier.PrefillRequest(items=items, restore=True),
                                   metadata=outgoing_metadata(), wait_for_ready=True,
                                   timeout=max(1.0, deadline - time.monotonic()))
        self.kv_cache_usage = reply.kv_cache_usage
        if self.on_restore is not None:
            self.on_restore(live)


def _asked_logprobs(results, num_tokens: Sequence[int], asked: Sequence[int | None]
                    ) -> list[TokenLogprobs | None] | None:
    """Each result's log-probabilities where its item asked (None when no item did); a reply
    without them for an item that asked is the verifier's fault, not the request's."""
    if all(k is None for k in asked):
        return None
    out = []
    for result, n, k in zip(results, num_tokens, asked):
        got = None if k is None else messages.logprobs_from_pb(result.logprobs, n)
        if k is not None and got is None:
            raise RuntimeError("the verifier returned no logprobs for an item that asked "
                               "(a verifier without logprobs support?)")
        out.append(got)
    return out


def seeded(sampling: SamplingParams, generator: CounterGenerator | None) -> SamplingParams:
    """`sampling` with the seed its message carries (messages.sampling_to_pb)."""
    if sampling.seed is not None or generator is None:
        return sampling
    return dataclasses.replace(sampling, seed=generator.seed)
