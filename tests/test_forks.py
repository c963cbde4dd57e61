"""The n samples of one prompt read it once (dspark/forks.py), and each gives what it would alone.

Against independent references: greedy forks equal one request's output (and transformers');
seeded forks equal the same requests sent one at a time, each in an engine of its own; the
prompt tokens the target reads are counted from the steps' stats; the copied KV cache and
drafter context equal the parent's, slot for slot.
"""

from __future__ import annotations

import pytest
import torch

from dspark.models.context_kv_cache import ContextKVCache
from dspark.models.draft_types import DraftRequest
from dspark.models.kv_cache import KVCacheFull, PagedKVCache
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams
from loadtest.tiny_models import GAMMA

from .conftest import tiny_dspark
from .models.test_eagle import HIDDEN, M, make_eagle
from .test_engine import PROMPTS, make_engine, reference_greedy  # noqa: F401 (a fixture)

POLICIES = ["none", f"fixed:{GAMMA}", "async_topk"]
LONG_PROMPT = [3 + (7 * i) % 50 for i in range(21)]


def generate_forked(engine, prompt, n, sampling_of, max_tokens):
    """One prompt n times: sample 0 reads it, samples 1..n-1 fork it; their requests and the
    prompt tokens read and forked over all steps."""
    parent = engine.add_request(prompt, sampling_of(0), max_tokens)
    ids = [parent] + [engine.add_request(prompt, sampling_of(i), max_tokens, fork_of=parent)
                      for i in range(1, n)]
    requests = [engine.request(rid) for rid in ids]
    read = forked = 0
    for result in engine.steps():
        read += result.stats.prompt_tokens
        forked += result.stats.forked_tokens
    return requests, read, forked


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk", [256, 5, 0])  # prefill_chunk_tokens: fused, chunked, separate
def test_greedy_forks_equal_one_request_and_read_the_prompt_once(tiny_target, reference_greedy,
                                                                 policy, chunk):
    greedy = lambda i: SamplingParams(temperature=0)  # noqa: E731
    engine = make_engine(tiny_target[0], policy, prefill_chunk_tokens=chunk)
    prompt = PROMPTS[2]
    requests, read, forked = generate_forked(engine, prompt, 3, greedy, 24)
    assert [r.output_ids for r in requests] == [reference_greedy[2]] * 3
    assert read == len(prompt) + 2  # the prompt once, then each child its last token
    assert forked == 2 * (len(prompt) - 1)
    manager = engine.verifier.runner.cache.manager
    assert manager.num_free_blocks == manager.num_blocks  # every copy released


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk", [256, 0])
def test_seeded_forks_equal_the_requests_sent_alone(tiny_target, policy, chunk):
    """Sample i with seed 42 + i (the gateway's seeding; T = 3 spreads the peaked target) forked
    from sample 0 gives the tokens
    of the request with seed 42 + i sent alone to an engine of its own."""
    seeded = lambda i: SamplingParams(temperature=3.0, seed=42 + i)  # noqa: E731
    engine = make_engine(tiny_target[0], policy, prefill_chunk_tokens=chunk)
    requests, read, _ = generate_forked(engine, LONG_PROMPT, 3, seeded, 20)
    alone = [make_engine(tiny_target[0], policy, prefill_chunk_tokens=chunk).generate(
        [LONG_PROMPT], seeded(i), max_tokens=20)[0].output_ids for i in range(3)]
    assert [r.output_ids for r in requests] == alone
    assert len({tuple(a) for a in alone}) == 3  # the seeds do make different samples
    assert read == len(LONG_PROMPT) + 2


def test_a_child_whose_parent_is_gone_reads_its_prompt(tiny_target, reference_greedy):
    """The parent finished before the child joined (one slot): the child reads the prompt."""
    engine = make_engine(tiny_target[0], "none", max_running=1)
    greedy = SamplingParams(temperature=0)
    parent = engine.add_request(PROMPTS[2], greedy, 4)
    child = engine.request(engine.add_request(PROMPTS[2], greedy, 24, fork_of=parent))
    read = sum(result.stats.prompt_tokens for result in engine.steps())
    assert child.output_ids == reference_greedy[2]
    assert read == 2 * len(PROMPTS[2])


@pytest.mark.parametrize("kv_tokens, expect_forked", [(32, 6), (16, 0)])
def test_a_fork_the_kv_cache_cannot_hold_reads_its_prompt_later(tiny_target, reference_greedy,
                                                               kv_tokens, expect_forked):
    """Blocks of 16 tokens; the parent (7 prompt + 4 output + a 4-draft block) needs one. With
    two the child's copy of 6 tokens fits; with one it does not, and the child reads its prompt
    once the parent has left (a preemption on the way); both outputs are the reference."""
    greedy = lambda i: SamplingParams(temperature=0)  # noqa: E731
    engine = make_engine(tiny_target[0], f"fixed:{GAMMA}", kv_cache_tokens=kv_tokens,
                         prefill_chunk_tokens=0)
    requests, _, forked = generate_forked(engine, PROMPTS[2], 2, greedy, 4)
    assert [r.output_ids for r in requests] == [reference_greedy[2][:4]] * 2
    assert forked == expect_forked
    manager = engine.verifier.runner.cache.manager
    assert manager.num_free_blocks == manager.num_blocks


def test_paged_kv_fork_copies_the_prefix_slot_for_slot():
    cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=3, num_blocks=6, block_size=4,
                         dtype=torch.float32, device="cpu")
    cache.manager.add_request("p")
    cache.manager.grow({"p": 10})
    slots = cache.manager.slots("p", 0, 10)
    for layer in range(2):
        cache.write(layer, slots, torch.randn(10, 2, 3), torch.randn(10, 2, 3))
    cache.fork("p", "c", 9)
    assert cache.manager.length("c") == 9
    assert set(cache.manager.block_table("c")).isdisjoint(cache.manager.block_table("p"))
    theirs, ours = cache.manager.slots("p", 0, 9), cache.manager.slots("c", 0, 9)
    for storage in (cache.k, cache.v):
        flat = storage.flatten(1, 2)  # [layers, slots, kv, hd]
        assert torch.equal(flat[:, ours], flat[:, theirs])
    with pytest.raises(KVCacheFull):  # 9 tokens need 3 blocks; 0 are free
        cache.fork("p", "d", 9)
    assert "d" not in cache.manager and cache.manager.num_free_blocks == 0


def test_context_fork_keeps_the_positions_before_the_cut():
    contexts = ContextKVCache()
    keys, values = torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)  # [layers, kv, n, hd]
    contexts.append("p", keys, values, torch.arange(5), hidden=torch.randn(5, 8))
    contexts.fork("p", "c", 3)
    child, parent = contexts.get("c"), contexts.get("p")
    assert child.length == 3 and child.last_position == 2 and parent.length == 5
    assert torch.equal(child.keys[:, :, :3], keys[:, :, :3])
    assert torch.equal(child.values[:, :, :3], values[:, :, :3])
    assert torch.equal(child.hidden[:3], parent.hidden[:3])
    contexts.fork("p", "e", 0)
    assert "e" not in contexts



def _draft(drafter, request_id, anchor: int, anchor_position: int):
    return drafter.draft([DraftRequest(request_id, anchor, anchor_position,
                                       SamplingParams(temperature=1.0), CounterGenerator(5))])[0]


@pytest.mark.parametrize("projected", [False, True])
def test_dspark_drafter_fork_drafts_as_the_whole_context(tiny_target, projected):
    """A child forked at position 6 from a parent whose context runs to 9, then given its own
    positions 6..8, drafts what a request given positions 0..8 by appends drafts, whether the
    parent's context was pending or already projected when it was forked."""
    drafter = tiny_dspark(0, make_engine(tiny_target[0], "none").verifier.runner)
    features, tokens = torch.randn(9, drafter.fc.weight.shape[1]), torch.randint(3, 60, (9,))
    drafter.append_context("whole", features, torch.arange(9), tokens)
    drafter.append_context("parent", features, torch.arange(9), tokens)
    if projected:
        drafter.context_length("parent")  # projects the pending tokens into the cache
    drafter.fork("parent", "child", 6)
    drafter.append_context("child", features[6:], torch.arange(6, 9), tokens[6:])
    whole, child = _draft(drafter, "whole", 7, 9), _draft(drafter, "child", 7, 9)
    assert torch.equal(whole.tokens, child.tokens)
    assert torch.allclose(whole.probs, child.probs, atol=1e-5)


def test_eagle_drafter_fork_drafts_as_the_whole_context():
    """As above for the Eagle-style drafter, whose child continues from the fused feature of
    the last copied position."""
    drafter = make_eagle()
    features, tokens = torch.randn(9, M * HIDDEN), torch.randint(0, 40, (9,))
    drafter.append_context("whole", features, torch.arange(9), tokens)
    drafter.append_context("parent", features, torch.arange(9), tokens)
    drafter.fork("parent", "child", 6)
    drafter.append_context("child", features[6:], torch.arange(6, 9), tokens[6:])
    whole, child = _draft(drafter, "whole", 7, 9), _draft(drafter, "child", 7, 9)
    assert torch.equal(whole.tokens, child.tokens)
    assert torch.allclose(whole.probs, child.probs, atol=1e-5)
