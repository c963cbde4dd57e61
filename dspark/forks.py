"""Forks: the n samples of one prompt read that prompt once (vLLM's `n`, `best_of`).

Glossary
- *parent*: the request that reads the prompt (sample 0);
- *child*: another sample of the same prompt (`Request.fork_of` = the parent's id); it waits in
  the queue until the parent's prompt is read (dspark.batching), and when it joins it *forks*;
- *fork*: the child starts from a copy of the parent's state for the first P - 1 prompt tokens
  (P = the prompt's length): the target's KV cache and logits-processing state
  (`TargetVerifier.fork`), and the drafter's context (`Drafter.fork`). The child then reads the
  prompt's last token as an ordinary one-token final chunk, which samples its first token with
  its own random numbers (its own seed; the gateway gives sample i seed + i, as vLLM does) and
  gives its own features of that position to the drafter.

Re-reading the last token rather than copying all P tokens and keeping the parent's last logits
is what vLLM's prefix cache does when a whole prompt hits it, and it reuses the final-chunk path
unchanged (grammar, logprobs, penalties): a prompt of P tokens sampled n times is read
P + (n - 1) tokens instead of n * P. Each child's output is what the same request sent alone
gives, up to float rounding of the last position's logits (read against cached K/V instead of
in the prompt's forward), the difference chunked prefill already makes.

A child whose parent is gone when it joins (finished, aborted, preempted behind it) reads its
prompt like any request; so does a child when the copy does not fit in the KV cache.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from dspark.held_features import HeldFeatures
from dspark.models.draft_types import Drafter
from dspark.models.kv_cache import KVCacheFull
from dspark.request import Request
from dspark.verifier import TargetVerifier


def fork_joined(joined: Sequence[Request], running: Sequence[Request], verifier: TargetVerifier,
                drafter: Drafter | None, held: HeldFeatures) -> int:
    """Fork every request of `joined` (they hold a slot, nothing read yet) whose parent is
    running with the same prompt: afterwards it has read P - 1 prompt tokens
    (`Request.prefilled`). `drafter`: None without speculation. Returns the prompt tokens
    taken from parents instead of read."""
    parents: dict[Hashable, Request] = {r.request_id: r for r in running}
    forked = 0
    for child in joined:
        parent = parents.get(child.fork_of)
        shared = len(child.prompt_ids) - 1
        if (child.fork_of is None or child.prefilled or child.recomputing or parent is None
                or shared < 1 or parent.prompt_ids != child.prompt_ids):
            continue
        if drafter is not None:
            # The parent's features the verifier holds go to the drafter first, so that the
            # copy of its context is whole (taking early keeps their order).
            held.take([parent.request_id], verifier, drafter)
        try:
            verifier.fork(parent.request_id, child.request_id, child.prompt_ids[:shared],
                          child.sampling, child.generator)
        except KVCacheFull:
            continue  # it reads its prompt instead (and waits for the cache like any request)
        if drafter is not None:
            drafter.fork(parent.request_id, child.request_id, shared)
        child.prefilled = shared
        forked += shared
    return forked
