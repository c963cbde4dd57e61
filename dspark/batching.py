"""Which requests run together: the waiting and running queues, the KV cache reservation that
decides who may join, and preemption when the cache runs out (DESIGN.md section 5).

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

from dataclasses import dataclass


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
