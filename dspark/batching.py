"""Which requests run together: the waiting and running queues, the KV cache reservation that
decides who may join, and preemption when the cache runs out (docs/design.md section 5).

Glossary
- *waiting*: submitted, not yet holding a slot; *prefilling*: joined (they hold a slot) but their
  prompts are not all read yet (chunked prefill); *running*: decoding, drafted and verified each
  round.
- *worst case* of a request: prompt + max_tokens + gamma + 1 tokens of KV cache (the anchor and a
  full draft block are written before the rejected drafts are cut), rounded up to whole blocks.
- *preemption*: when the verifier's KV cache cannot hold a round, the request that joined last
  gives its cache up and waits first in line; when it joins again the target re-reads its prompt
  and output before the anchor (*recomputing*) without sampling anything.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, Sequence

from dspark.request import Request
from dspark.verifier import PrefillChunk


@dataclass(frozen=True)
class BatchingConfig:
    """How many requests run together, how their prompts are read, and the KV cache they share."""

    max_running: int = 16
    """Requests verified together in one round; the rest wait."""
    prefill_chunk_tokens: int = 256
    """Chunked prefill: joining requests' prompts are read in the same target forward as the
    running requests' verification, at most this many prompt tokens a round, oldest joiner
    first (a long prompt takes several rounds). A prompt's last chunk samples the request's
    first token; it is drafted and verified from the next round on. Running requests then never
    stop for a prefill forward of its own, nor wait longer than one chunk. 0 = whole prompts,
    in a forward of their own before the round (and the joiners decode in that same step)."""
    kv_cache_tokens: int = 0
    """Verifier KV cache this engine may fill, in tokens; 0 = not checked. A waiting request
    joins only while the worst case of every joined request fits (see the module doc). Beyond
    that it waits in the queue instead of running into a KVCacheFull that fails the round for
    everyone (vLLM's scheduler also admits against free blocks; it preempts where this
    reserves)."""
    kv_block_size: int = 1
    """The verifier's KV cache block size, in tokens."""

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < 0 or self.kv_block_size < 1:
            raise ValueError("kv_cache_tokens must be >= 0 and kv_block_size >= 1")
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")


class Batcher:
    """The request queues of one engine and the rules that move requests between them. It
    decides who joins, what prompt pieces a round reads and who is preempted; the engine runs
    the models and releases a request's caches when this says it left."""

    def __init__(self, config: BatchingConfig, gamma: int) -> None:
        self.config = config
        self.gamma = gamma
        """Draft block size (0 without drafting): the worst case reserves a full block."""
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []
        """Joined (they hold a slot) but their prompts are not all read yet (chunked prefill)."""
        self.running: list[Request] = []
        self.joins_paused = False
        """Set by a preemption: nobody joins until a request leaves (or none holds cache)."""

    # -- the queues ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def find(self, request_id: Hashable) -> Request:
        """The request in any queue with this id (KeyError if none)."""
        for r in itertools.chain(self.waiting, self.prefilling, self.running):
            if r.request_id == request_id:
                return r
        raise KeyError(request_id)

    def remove(self, request_id: Hashable) -> list[Request]:
        """Take the request out of every queue; returns those that held cache (to release)."""
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        released = []
        for held in (self.prefilling, self.running):
            for r in [r for r in held if r.request_id == request_id]:
                held.remove(r)
                released.append(r)
                self.joins_paused = False
        return released

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def load(self) -> int:
        """Requests in the engine: waiting, reading their prompts or running."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def start_running(self, r: Request) -> None:
        """Its prompt (or its recompute) is read: it decodes from the next round on."""
        self.prefilling.remove(r)
        self.running.append(r)

    def retire_finished(self) -> list[Request]:
        """Take the finished requests out of the running queue; returns them (to release)."""
        finished = [r for r in self.running if r.finished]
        for r in finished:
            self.running.remove(r)
            self.joins_paused = False
        return finished

    # -- joining -------------------------------------------------------------------------------
    def join_waiting(self) -> None:
        """Waiting requests take the free slots (chunked prefill: their prompts come later), in
        arrival order, while their worst-case KV cache fits (BatchingConfig.kv_cache_tokens)."""
        if self.joins_paused and (self.running or self.prefilling):
            return
        self.joins_paused = False
        free = self.config.max_running - len(self.running) - len(self.prefilling)
        joining = self.waiting[:max(0, free)]
        joining = joining[:self._joinable(joining)]
        if self.config.kv_cache_tokens:
            reserved = sum(self.kv_tokens_reserved(r) for r in [*self.running, *self.prefilling])
            fitting = 0
            for r in joining:
                need = self.kv_tokens_reserved(r)
                alone = not (self.running or self.prefilling or fitting)
                if reserved + need > self.config.kv_cache_tokens and not alone:
                    break  # first come, first served: later ones do not overtake it
                reserved += need
                fitting += 1
            joining = joining[:fitting]
        if joining:
            self.waiting = self.waiting[len(joining):]
            self.prefilling += joining

    def _joinable(self, joining: Sequence[Request]) -> int:
        """How many of the first waiting requests may join: up to the first one that forks a
        request still reading its prompt (in prefilling, or ahead of it in the queue), which
        joins once that prompt is read (dspark/forks.py), first come, first served. A request
        whose parent waits behind it (both preempted) does not wait for it."""
        unread = {r.request_id for r in self.prefilling}
        for i, r in enumerate(joining):
            if r.fork_of is not None and r.fork_of in unread:
                return i
            unread.add(r.request_id)
        return len(joining)

    def kv_tokens_reserved(self, r: Request) -> int:
        """The request's worst case in KV cache tokens, in whole blocks."""
        block = self.config.kv_block_size
        return -(-(len(r.prompt_ids) + r.max_tokens + self.gamma + 1) // block) * block

    def plan_chunks(self, budget: int | None = None, requests: Sequence[Request] | None = None
                    ) -> list[tuple[Request, PrefillChunk]]:
        """This round's prompt pieces, the oldest joiners first: up to `budget` prompt tokens
        (None: prefill_chunk_tokens) of `requests` (None: every joiner)."""
        budget = self.config.prefill_chunk_tokens if budget is None else budget
        planned = []
        for r in self.prefilling if requests is None else requests:
            if budget == 0:
                break
            tokens = r.tokens_to_read
            end = min(len(tokens), r.prefilled + budget)
            final = end == len(tokens) and not r.recomputing  # a recompute samples nothing
            planned.append((r, PrefillChunk(r.request_id, tokens[r.prefilled:end], final,
                                            r.sampling, r.generator, continued=r.prefilled > 0,
                                            logprobs=r.logprobs,
                                            grammar=r.grammar_request() if final else None,
                                            prompt_length=(r.prompt_length
                                                           if r.recomputing or r.earlier_output
                                                           else None))))
            budget -= end - r.prefilled
        return planned

    # -- preemption ----------------------------------------------------------------------------
    def preempt_newest(self) -> tuple[Request, bool]:
        """The cache could not hold this step: the request that joined last leaves the batch.
        Returns it and whether it was alone. Alone it cannot run at all (the caller ends it);
        otherwise it waits first in line, to be recomputed when it joins again, and nobody
        joins until a request leaves. The caller releases its caches either way."""
        alone = len(self.running) + len(self.prefilling) == 1
        victim = (self.prefilling or self.running).pop()
        if not alone:
            victim.prefilled = 0
            victim.recomputing = bool(victim.output_ids)
            self.waiting.insert(0, victim)
            self.joins_paused = True
        return victim, alone
