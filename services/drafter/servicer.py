"""The Drafter gRPC servicer: any object following dspark.models.draft_types.Drafter behind the
`dspark.v1.Drafter` bidirectional stream.

Per DraftRound: releases, then context updates (a `reset` first drops what is held: the
scheduler's resync after this process restarted), then forks (a child's context a copy of its
parent's prompt, dspark/forks.py), then one batched `draft` call; the blocks are
streamed back one message per request. A request's drafts are keyed by its seed here as in the
embedded engine (dspark.random_draws; the DRAFT purpose keeps them apart from the verifier's
numbers); the scheduler sends every request's seed, its own fresh one for an unseeded request, so
that drafter and verifier key one request alike. Under the drafter-invariant rule (`rule`, the
verifier's) the drafts are Gumbel-max samples with the noise the target samples with, as the
embedded engine drafts (dspark.gumbel_verification.request_generator). One lock: the model drafts one round at
a time even if two schedulers are connected.

Draft processing (dspark.models.draft_processing) as in the embedded engine: logit_bias,
min_tokens, the penalties and min_p from the item's sampling, and a grammar from the item's
`grammar` spec; the tokens the penalties and the grammar read come from the context updates'
token ids (services/drafter/request_tokens.py), so the drafts are the embedded engine's.
"""

from __future__ import annotations

import threading

import grpc
from opentelemetry import propagate

from dspark.gumbel_verification import request_generator
from dspark.models.draft_types import DraftRequest, Drafter
from dspark.random_draws import CounterGenerator
from dspark.rejection import VerificationRule
from dspark.serving import messages, tensor_codec
from dspark.serving.grpc_errors import HANDLED, abort_with
from dspark.serving.idle_expiry import IdleExpiry
from dspark.serving.protos import pb, rpc
from dspark.structured_output import GrammarCompiler
from services.drafter.request_tokens import RequestTokens


class DrafterServicer(rpc.drafter.DrafterServicer):
    def __init__(self, drafter: Drafter, vocab_size: int, target_layer_ids: list[int], name: str,
                 tracer, idle_expiry_seconds: float = 0.0,
                 rule: VerificationRule = VerificationRule.TOKEN,
                 grammars: GrammarCompiler | None = None) -> None:
        """`grammars`: compiles structured-output specs over the target's tokenizer (None: an
        item with a grammar is refused)."""
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.target_layer_ids = target_layer_ids
        self.name = name
        self.tracer = tracer
        self.rule = VerificationRule(rule)
        self._lock = threading.Lock()
        self._generators: dict[str, CounterGenerator] = {}
        self._idle = IdleExpiry(idle_expiry_seconds)
        self._tokens = RequestTokens(grammars)

    def _release(self, request_id: str) -> None:
        self.drafter.release(request_id)
        self._generators.pop(request_id, None)
        self._tokens.release(request_id)
        self._idle.forget(request_id)

    def Info(self, request, context):
        return pb.drafter.DrafterInfo(gamma=self.drafter.gamma, vocab_size=self.vocab_size,
                                      target_layer_ids=self.target_layer_ids, name=self.name)

    def Draft(self, request_iterator, context):
        for round_msg in request_iterator:
            parent = propagate.extract(dict(round_msg.trace_context))
            with self.tracer.start_as_current_span("drafter.round", context=parent) as span:
                span.set_attribute("dspark.round_id", round_msg.round_id)
                span.set_attribute("dspark.num_requests", len(round_msg.requests))
                try:
                    with self._lock:
                        blocks = self._round(round_msg)
                except HANDLED as e:  # bad input, or the device failed: never UNKNOWN
                    abort_with(context, e)
            for item, block in zip(round_msg.requests, blocks):
                yield messages.block_to_pb(round_msg.round_id, item.request_id, block)

    def _round(self, round_msg) -> list:
        for rid in [*self._idle.expired(), *round_msg.release]:
            self._release(rid)
        for update in round_msg.context:
            self._apply_context(update)
            self._idle.touch(update.request_id)
        for fork in round_msg.forks:
            if not fork.child_id or fork.child_id == fork.parent_id or fork.num_positions < 1:
                raise ValueError(f"fork of {fork.parent_id!r} into {fork.child_id!r} at "
                                 f"{fork.num_positions}: needs another child and a position > 0")
            self._release(fork.child_id)
            self.drafter.fork(fork.parent_id, fork.child_id, int(fork.num_positions))
            self._tokens.fork(fork.parent_id, fork.child_id, int(fork.num_positions))
            self._idle.touch(fork.child_id)
        requests = []
        for item in round_msg.requests:
            self._idle.touch(item.request_id)
            if item.request_id not in self._generators:
                # The verifier's seed: the drafter's uniforms are its own purpose (DRAFT) of the
                # same key (dspark.random_draws), never the verifier's.
                params = messages.sampling_from_pb(item.sampling)
                self._generators[item.request_id] = request_generator(params, self.rule)
            if not (0 <= item.anchor_token < self.vocab_size) or item.anchor_position < 0:
                raise ValueError(f"{item.request_id}: anchor token or position out of range")
            if not 0 <= item.num_output <= item.anchor_position + 1:
                raise ValueError(f"{item.request_id}: num_output must be in "
                                 f"0..{item.anchor_position + 1} (the anchor's position + 1)")
            params = messages.sampling_from_pb(item.sampling)
            grammar = messages.draft_grammar_from_pb(item)
            tokens = state = None
            if params.has_penalties or grammar is not None:
                tokens = self._tokens.through_anchor(item.request_id, int(item.anchor_token),
                                                     int(item.anchor_position))
            if grammar is not None:
                state = self._tokens.grammar_state(item.request_id, grammar,
                                                   tokens[len(tokens) - item.num_output:])
            requests.append(DraftRequest(item.request_id, int(item.anchor_token),
                                         int(item.anchor_position), params,
                                         self._generators[item.request_id],
                                         int(item.num_output), state, grammar,
                                         tokens if params.has_penalties else None))
        if not 0 <= round_msg.sparse_top_k <= self.vocab_size:
            raise ValueError(f"sparse_top_k must be in 0..{self.vocab_size}")
        top_k = round_msg.sparse_top_k or None
        num_positions = round_msg.num_positions or None  # validated by the drafter (ValueError)
        return (self.drafter.draft(requests, sparse_top_k=top_k, num_positions=num_positions)
                if requests else [])

    def _apply_context(self, update) -> None:
        if update.reset:
            self.drafter.release(update.request_id)
            self._tokens.release(update.request_id)
        features = tensor_codec.decode(update.features)
        positions = tensor_codec.decode(update.positions)
        tokens = tensor_codec.decode(update.token_ids)
        if features is None or positions is None:
            raise ValueError(f"{update.request_id}: context update needs features and positions")
        if features.dim() != 2 or positions.shape != (features.shape[0],):
            raise ValueError(f"{update.request_id}: features [n, d] and positions [n] disagree: "
                             f"{tuple(features.shape)} vs {tuple(positions.shape)}")
        # Token ids index the embedding and positions the rotary tables: out of range is a
        # device-side assert on a GPU, so refuse them before they get there.
        if positions.dtype.is_floating_point or (positions.numel() and int(positions.min()) < 0):
            raise ValueError(f"{update.request_id}: positions must be non-negative integers")
        if tokens is not None and (tokens.dtype.is_floating_point or tokens.shape != positions.shape
                                   or (tokens.numel() and not (0 <= int(tokens.min()) and
                                                               int(tokens.max()) < self.vocab_size))):
            raise ValueError(f"{update.request_id}: token_ids [n] must be ids in the vocabulary "
                             f"0..{self.vocab_size - 1}")
        self.drafter.append_context(update.request_id, features.float(), positions.long(),
                                    None if tokens is None else tokens.long())
        self._tokens.record(update.request_id, positions.tolist(),
                            None if tokens is None else tokens.tolist())
