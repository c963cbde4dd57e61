"""RemoteDrafter: the Drafter protocol (gamma, append_context, release, draft) over the
`dspark.v1.Drafter` bidirectional stream, with exact fallback when the drafter is away.

Per round the engine calls `append_context` for each request's newly committed tokens, then
`draft`. Context is buffered here and shipped with the first DraftRound that drafts its request
(one message per round; all of a request's unsent pieces in one ContextUpdate), and the blocks
come back on the stream, matched by round id and request id. A request that is not drafted (a
round that skips drafting, or a probe that drafts a sample of the batch) sends nothing: under a
load where no draft pays, most requests' features never cross the wire to the drafter.

Faults. If the stream breaks, or a round's blocks are not all back within `draft_timeout`, the
drafter is marked down and that round (and every round until it is back) gets *fallback blocks*:
gamma copies of the anchor token, each drawn from a point mass (p^d = 1 on that token), with
confidence 0. Rejection sampling against a point mass is still exact (accept x with probability
p^t(x); on rejection the residual is p^t without x), so requests continue as plain target
decoding, token for token the same under greedy; confidence 0 tells the admission that the
drafts are worthless, so they rarely take batch slots. Every `retry_seconds` a new stream is
tried; on success every live request's whole context (kept here since its prefill) is resent
with `reset`, and speculation resumes.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import grpc
import torch

from dspark.models.draft_types import DraftBlock, DraftRequest, positions_to_draft
from dspark.serving import messages, tensor_codec
from dspark.serving.grpc_runtime import channel
from dspark.serving.protos import pb, rpc
from dspark.serving.tracing import outgoing_metadata


@dataclass
class _ContextPiece:
    features: torch.Tensor  # [n, num_layers * hidden_size]
    positions: torch.Tensor  # [n] int64
    token_ids: torch.Tensor | None  # [n] int64


@dataclass
class _RequestContext:
    pieces: list[_ContextPiece] = field(default_factory=list)
    """Everything appended since prefill: resent whole after a drafter restart."""
    unsent: int = 0
    """How many of the last pieces the current stream has not received yet."""
    reset: bool = False
    """The next update must first drop what the drafter holds (resync)."""


def _joined(pieces: list[_ContextPiece]) -> _ContextPiece:
    """Consecutive context pieces of one request as one (token ids only if every piece has them)."""
    if len(pieces) == 1:
        return pieces[0]
    tokens = [p.token_ids for p in pieces]
    return _ContextPiece(torch.cat([p.features for p in pieces]),  # [sum n, d]
                         torch.cat([p.positions for p in pieces]),  # [sum n]
                         None if any(t is None for t in tokens) else torch.cat(tokens))


def _before(piece: _ContextPiece, num_positions: int) -> _ContextPiece | None:
    """The piece's tokens at positions < num_positions (the piece itself when all are; None
    when none is)."""
    keep = piece.positions < num_positions  # [n]
    if bool(keep.all()):
        return piece
    if not bool(keep.any()):
        return None
    return _ContextPiece(piece.features[keep], piece.positions[keep],
                         None if piece.token_ids is None else piece.token_ids[keep])


# How long one reconnection attempt may hold up a round while the drafter is down.
RECONNECT_TIMEOUT_SECONDS = 0.5


class _Stream:
    """One open Draft call: a send queue feeding the request iterator and a reader thread."""

    _CLOSE = object()

    def __init__(self, stub) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.call = stub.Draft(iter(self.outbox.get, self._CLOSE), metadata=outgoing_metadata())
        self.reader = threading.Thread(target=self._read, daemon=True, name="drafter-stream")
        self.reader.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.inbox.put(msg)
            self.inbox.put(ConnectionError("drafter stream closed"))
        except grpc.RpcError as e:
            self.inbox.put(e)

    def send(self, msg) -> None:
        self.outbox.put(msg)

    def close(self) -> None:
        self.outbox.put(self._CLOSE)
        self.call.cancel()


class RemoteDrafter:
    def __init__(self, address: str, draft_timeout: float = 10.0, retry_seconds: float = 1.0,
                 connect_timeout: float = 60.0,
                 on_state_change: Callable[[bool], None] | None = None,
                 internal_token: str = "") -> None:
        self.address = address
        self.internal_token = internal_token
        self.draft_timeout = draft_timeout
        self.retry_seconds = retry_seconds
        self.on_state_change = on_state_change
        """Called with True when the drafter comes back, False when it is lost."""
        self._channel = channel(address, internal_token)
        self._stub = rpc.drafter.DrafterStub(self._channel)
        info = self._stub.Info(pb.common.InfoRequest(), wait_for_ready=True, timeout=connect_timeout)
        self.gamma = int(info.gamma)
        self.vocab_size = int(info.vocab_size)
        self.target_layer_ids = list(info.target_layer_ids)
        self.name = info.name
        self._contexts: dict[str, _RequestContext] = {}
        self._releases: list[str] = []
        """Requests released while the drafter was unreachable: sent when it is back (a drafter
        that was only slow still holds their context)."""
        self._round_id = 0
        self._stream: _Stream | None = _Stream(self._stub)
        self._next_retry = 0.0
        self.fallback_rounds = 0

    @property
    def available(self) -> bool:
        return self._stream is not None

    # -- the Drafter protocol ---------------------------------------------------------------
    def append_context(self, request_id: Hashable, features: torch.Tensor,
                       positions: torch.Tensor, token_ids: torch.Tensor | None = None) -> None:
        ctx = self._contexts.setdefault(str(request_id), _RequestContext())
        ctx.pieces.append(_ContextPiece(features, positions.long(),
                                        None if token_ids is None else token_ids.long()))
        ctx.unsent += 1

    def release(self, request_id: Hashable) -> None:
        rid = str(request_id)
        self._contexts.pop(rid, None)
        if self._stream is not None:
            self._stream.send(pb.drafter.DraftRound(round_id=self._next_round(), release=[rid]))
        else:
            self._releases.append(rid)

    def fork(self, parent_id: Hashable, child_id: Hashable, num_positions: int) -> None:
        """The child's context: the parent's pieces before num_positions (kept here for a
        resync). Sent at once, after the parent's unsent context, so the drafter copies the
        whole of it; while the drafter is away the child's pieces wait to be resent."""
        rid, cid = str(parent_id), str(child_id)
        parent = self._contexts.get(rid, _RequestContext())
        child = _RequestContext([p for p in (_before(piece, num_positions)
                                             for piece in parent.pieces) if p is not None])
        self._contexts[cid] = child
        if self._stream is None:
            child.unsent, child.reset = len(child.pieces), True
            return
        self._stream.send(pb.drafter.DraftRound(
            round_id=self._next_round(), context=self._pending_updates([rid]),
            forks=[pb.drafter.ContextFork(parent_id=rid, child_id=cid,
                                          num_positions=int(num_positions))]))

    def draft(self, requests: Sequence[DraftRequest], sparse_top_k: int | None = None,
              num_positions: int | None = None) -> list[DraftBlock]:
        n = positions_to_draft(num_positions, self.gamma)
        if self._stream is None and time.monotonic() >= self._next_retry:
            self._reconnect()
        if self._stream is None:
            return self._fallback(requests, n)
        round_id = self._next_round()
        msg = pb.drafter.DraftRound(round_id=round_id, sparse_top_k=sparse_top_k or 0,
                                    context=self._pending_updates(str(r.request_id)
                                                                  for r in requests),
                                    requests=[self._item(r) for r in requests],
                                    num_positions=0 if n == self.gamma else n)
        msg.trace_context.update(dict(outgoing_metadata()))
        self._stream.send(msg)
        try:
            return self._collect(round_id, requests, n)
        except (grpc.RpcError, ConnectionError, TimeoutError, ValueError):
            self._mark_down()
            return self._fallback(requests, n)

    # -- the stream -------------------------------------------------------------------------
    def _next_round(self) -> int:
        self._round_id += 1
        return self._round_id

    def _item(self, r: DraftRequest) -> "pb.drafter.DraftItem":
        return pb.drafter.DraftItem(request_id=str(r.request_id), anchor_token=int(r.anchor_token),
                                    anchor_position=int(r.anchor_position),
                                    sampling=messages.sampling_to_pb(r.sampling, r.generator),
                                    num_output=int(r.num_output),
                                    grammar=messages.draft_grammar_to_pb(r.grammar_request))

    def _pending_updates(self, request_ids) -> list:
        """One ContextUpdate per named request with unsent context: its unsent pieces joined."""
        updates = []
        for rid in dict.fromkeys(request_ids):
            ctx = self._contexts.get(rid)
            if ctx is None or not ctx.unsent:
                continue
            piece = _joined(ctx.pieces[len(ctx.pieces) - ctx.unsent:])
            updates.append(pb.drafter.ContextUpdate(
                request_id=rid, features=tensor_codec.encode(piece.features),
                positions=tensor_codec.encode(piece.positions),
                token_ids=tensor_codec.encode(piece.token_ids), reset=ctx.reset))
            ctx.unsent, ctx.reset = 0, False
        return updates

    def _collect(self, round_id: int, requests: Sequence[DraftRequest],
                 num_positions: int) -> list[DraftBlock]:
        wanted = {str(r.request_id) for r in requests}
        blocks: dict[str, DraftBlock] = {}
        deadline = time.monotonic() + self.draft_timeout
        while len(blocks) < len(wanted):
            try:
                msg = self._stream.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"drafter round {round_id} not back in {self.draft_timeout}s")
            if isinstance(msg, Exception):
                raise msg
            if msg.round_id == round_id and msg.request_id in wanted:
                block = messages.block_from_pb(msg)
                if block.gamma != num_positions:
                    raise ValueError(f"drafter sent a block of {block.gamma}, expected {num_positions}")
                blocks[msg.request_id] = block
        return [blocks[str(r.request_id)] for r in requests]

    def _mark_down(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._stream = None
        self._next_retry = time.monotonic() + self.retry_seconds
        for ctx in self._contexts.values():  # whatever the drafter had is now unknown
            ctx.unsent, ctx.reset = len(ctx.pieces), True
        if self.on_state_change is not None:
            self.on_state_change(False)

    def _reconnect(self) -> None:
        """One quick attempt on a fresh channel (no inherited reconnect backoff); the engine
        loop waits for it, so it must stay short."""
        self._channel.close()
        self._channel = channel(self.address, self.internal_token)
        self._stub = rpc.drafter.DrafterStub(self._channel)
        try:
            info = self._stub.Info(pb.common.InfoRequest(), timeout=RECONNECT_TIMEOUT_SECONDS)
            if int(info.gamma) != self.gamma:
                raise ValueError(f"drafter came back with gamma {info.gamma}, expected {self.gamma}")
            self._stream = _Stream(self._stub)
        except (grpc.RpcError, ValueError):
            self._next_retry = time.monotonic() + self.retry_seconds
            return
        if self._releases:
            self._stream.send(pb.drafter.DraftRound(round_id=self._next_round(),
                                                    release=self._releases))
            self._releases = []
        if self.on_state_change is not None:
            self.on_state_change(True)

    # -- fallback ---------------------------------------------------------------------------
    def _fallback(self, requests: Sequence[DraftRequest], num_positions: int) -> list[DraftBlock]:
        self.fallback_rounds += 1
        return fallback_blocks(requests, num_positions)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._channel.close()


def fallback_blocks(requests: Sequence[DraftRequest], gamma: int) -> list[DraftBlock]:
    """Point-mass drafts of each anchor token with confidence 0 (exact; see the module
    docstring), always sparse with k = 1: a fallback round is all fallback, so it never mixes
    sparse and dense blocks in one verification batch."""
    blocks = []
    for r in requests:
        tokens = torch.full((gamma,), int(r.anchor_token), dtype=torch.int64)  # [gamma]
        blocks.append(DraftBlock(tokens, torch.ones(gamma, 1), torch.zeros(gamma),
                                 tokens.unsqueeze(1).clone()))
    return blocks
