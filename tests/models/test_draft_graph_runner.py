"""The drafter's round over static buffers (dspark/models/draft_graph_runner.py) run eagerly on
the CPU: the same drafts as the eager BATCHED round over buckets of batch size and context
length, and greedy engine outputs token-identical with and without it."""

from __future__ import annotations

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.engine import Engine, EngineConfig
from dspark.models.draft_graph_runner import MIN_CONTEXT_SLOTS, context_bucket
from dspark.models.draft_types import DraftRequest
from dspark.models.drafter import ContextAttention
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import GAMMA as TINY_GAMMA
from loadtest.tiny_models import LAYER_IDS

from ..conftest import tiny_dspark
from .test_drafter import VOCAB, make_drafter, sequence


def test_context_bucket():
    assert [context_bucket(n) for n in (0, 1, 64, 65, 128, 129)] == [64, 64, 64, 128, 128, 256]
    assert MIN_CONTEXT_SLOTS == 64


def two_drafters(head: str, inject: bool, draft_ids: torch.Tensor | None = None):
    """The same weights twice: eager BATCHED, and the static path (run eagerly on the CPU)."""
    eager, static = (make_drafter(head, inject=inject, draft_ids=draft_ids) for _ in range(2))
    for model in (eager, static):  # the static drafter's eager path too (more than 64 requests)
        model.context_attention = ContextAttention.BATCHED
    static.use_round_graphs(True)
    assert eager.round_graphs is None and static.round_graphs is not None
    assert not static.round_graphs.capture  # a CPU: the static path runs eagerly
    return eager, static


def add_contexts(models, lengths: dict[str, int], T: int = 150):
    ids, feats = sequence(T=T)
    for model in models:
        for rid, n in lengths.items():
            model.append_context(rid, feats[0, :n], torch.arange(n))
    return ids


# Context lengths across two context buckets (64 and 128 slots) and a request with none; anchors
# at the end of each context except "c", whose positions 5.. are hidden from its block.
LENGTHS = {"a": 3, "b": 100, "c": 40, "d": 0, "e": 64}
ANCHORS = {"a": 3, "b": 100, "c": 5, "d": 0, "e": 64}


def requests_for(ids, order, temperature, **sampling):
    return [DraftRequest(rid, int(ids[0, ANCHORS[rid]]), ANCHORS[rid],
                         SamplingParams(temperature(i), **sampling), CounterGenerator(21 + i))
            for i, rid in enumerate(order)]


def assert_same_blocks(got, want, exact: bool):
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=0, atol=1e-5)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g.tokens, w.tokens)
        torch.testing.assert_close(g.dense(VOCAB), w.dense(VOCAB), **tol)
        torch.testing.assert_close(g.confidences, w.confidences, equal_nan=True, **tol)


@pytest.mark.parametrize("head,inject,reduced", [("markov", False, False), ("rnn", True, False),
                                                 ("none", False, False), ("markov", True, True)])
@pytest.mark.parametrize("order", [["b"], ["a", "c", "d"], ["a", "b", "c", "d", "e"],
                                   ["e", "b", "b"], ["a", "c", "d", "e"]])
@pytest.mark.parametrize("sampled", [False, True])
def test_static_round_equals_the_eager_batched_round(head, inject, reduced, order, sampled):
    """1, 3, 5, 3 and 4 requests (batch buckets 1, 4, 8, 4, 4: padding requests in three of
    them), contexts of 0 to 100 tokens (context buckets 64 and 128), a hidden context tail and a
    duplicate request; greedy (the chain inside the captured part) and a mix of seeded T=1 and
    greedy rows (the chain outside it): the same tokens as the eager BATCHED round, and its
    probabilities and confidences to 1e-5. Bit for bit where the shapes are the eager round's
    own (4 requests, the longest context 64 tokens: no padding request, no padding slot past
    the longest context); elsewhere the attention sums over more (masked, zero) slots, in
    another float order."""
    draft_ids = torch.tensor([0, 1, 2, 3] + list(range(5, VOCAB, 2))) if reduced else None
    eager, static = two_drafters(head, inject, draft_ids)
    ids = add_contexts((eager, static), LENGTHS)
    temperature = (lambda i: 1.0 if i % 2 == 0 else 0.0) if sampled else (lambda i: 0.0)
    for _ in range(2):  # twice: the second round replays the buckets of the first
        blocks = [m.draft(requests_for(ids, order, temperature)) for m in (eager, static)]
        assert_same_blocks(blocks[1], blocks[0], exact=order == ["a", "c", "d", "e"])
    buckets = static.round_graphs.buckets
    assert static.round_graphs.rounds == 2 and len(buckets) == 1
    (B, L, chained), = buckets
    assert B >= len(order) and L == context_bucket(max(LENGTHS[r] for r in order))
    assert chained == (not sampled)


def test_fewer_positions_logit_processing_and_calibration():
    """num_positions < gamma (the captured part still runs the whole block), a request with a
    logit bias (its chain then runs outside the captured part, over the same hn and logits) and
    STS fits per sampling temperature (copied into the call's buffers): the eager drafts."""
    from dspark.calibration.sts_map import CalibrationSet, STSCalibration

    eager, static = two_drafters("markov", False)
    calibration = CalibrationSet([STSCalibration([0.5, 1.0, 2.0, 3.0], sampling_temperature=0.0),
                                  STSCalibration([2.0, 1.5, 1.0, 0.7], [0.1, 0.2, -0.3, 0.0],
                                                 sampling_temperature=1.0)])
    for m in (eager, static):
        m.set_confidence_calibration(calibration)
    ids = add_contexts((eager, static), LENGTHS)
    order = ["a", "b", "c"]
    for n in (1, 3):
        blocks = [m.draft(requests_for(ids, order, lambda i: 0.0), num_positions=n)
                  for m in (eager, static)]
        assert_same_blocks(blocks[1], blocks[0], exact=False)
        assert blocks[1][0].tokens.shape == (n,)
        biased = [m.draft(requests_for(ids, order, lambda i: float(i % 2),
                                       logit_bias=((5, -100.0), (7, 3.0))), num_positions=n)
                  for m in (eager, static)]
        assert_same_blocks(biased[1], biased[0], exact=False)
    assert {chained for _, _, chained in static.round_graphs.buckets} == {True, False}


def test_more_requests_than_a_bucket_take_the_eager_path():
    eager, static = two_drafters("markov", False)
    ids = add_contexts((eager, static), {f"r{i}": 5 + i for i in range(65)})
    order = [f"r{i}" for i in range(65)]
    requests = [DraftRequest(rid, int(ids[0, 5 + i]), 5 + i, SamplingParams(0.0))
                for i, rid in enumerate(order)]
    blocks = [m.draft(requests) for m in (eager, static)]
    assert_same_blocks(blocks[1], blocks[0], exact=True)
    assert static.round_graphs.rounds == 0
    static.draft(requests[:64])
    assert static.round_graphs.rounds == 1


def test_new_target_weights_drop_the_buckets():
    _, static = two_drafters("markov", False)
    ids = add_contexts((static,), {"a": 3})
    static.draft(requests_for(ids, ["a"], lambda i: 0.0))
    assert static.round_graphs.buckets
    static.set_target_weights(static.embed_weight * 2, static.lm_head_weight)
    assert not static.round_graphs.buckets


@pytest.mark.parametrize("policy", ["none", "async_topk", f"fixed:{TINY_GAMMA}"])
def test_greedy_engine_outputs_are_token_identical_with_and_without(tiny_target, policy):
    """The engine on the tiny target, greedy, 5 prompts at once: the same outputs with the
    drafter's round on the static path as with the eager BATCHED round."""
    folder, _ = tiny_target
    outputs = []
    for graphs in (False, True):
        runner = TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS, kv_cache_tokens=4096))
        drafter = tiny_dspark(0, runner)
        drafter.context_attention = ContextAttention.BATCHED
        drafter.use_round_graphs(graphs)
        table = CostTable.from_step_seconds({b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)})
        engine = Engine(TargetVerifier(runner), drafter, table, EngineConfig().with_values(
            policy=policy, max_running=8, update_cost_table=False))
        prompts = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [40], [8, 8, 8, 8, 8]]
        done = engine.generate(prompts, SamplingParams(temperature=0), max_tokens=24)
        outputs.append([r.output_ids for r in done])
        if graphs and policy != "none":
            assert drafter.round_graphs.rounds > 0
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_static_round_reads_nothing_back(temperature):
    """On a pretend CUDA device (tests/pretend_device.py): a round on the static path reads no
    device value on the host, greedy (the chain inside the captured part) and T=1 (outside),
    at 3 requests (bucket 4); its drafts stay on the device."""
    from dspark.models.draft_graph_runner import DraftGraphRunner

    from ..pretend_device import PretendDevice

    drafter = make_drafter("markov")
    drafter.context_attention = ContextAttention.BATCHED
    ids = add_contexts((drafter,), {"a": 3, "b": 30, "c": 12})
    device = PretendDevice()
    device.place(drafter)
    drafter.round_graphs = DraftGraphRunner(drafter, capture=False)  # eager: a CPU underneath
    order = ["a", "b", "c"]
    with device:
        drafter.draft(requests_for(ids, order, lambda i: temperature))  # the contexts absorbed
        device.reset_counts()
        blocks = drafter.draft(requests_for(ids, order, lambda i: temperature))
        assert device.syncs == 0, dict(device.sync_calls)
    assert drafter.round_graphs.rounds == 2 and all(device.is_on_device(b.tokens) for b in blocks)
