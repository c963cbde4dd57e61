"""The graphed forwards' static-buffer path (dspark/models/graph_runner.py) run eagerly on the CPU:
the same logits and hidden states as the ordinary PADDED forward, over buckets of batch size and
table width, and greedy engine outputs token-identical with and without it."""

from __future__ import annotations

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.engine import Engine, EngineConfig
from dspark.models.graph_runner import SCRATCH_ID, batch_bucket, table_bucket
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner
from dspark.models.transformer import AttentionImpl
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import GAMMA, LAYER_IDS

from ..conftest import tiny_dspark


def make_runner(folder, graphs: bool, attention: AttentionImpl = AttentionImpl.PADDED) -> TargetRunner:
    return TargetRunner(folder, RunnerConfig(
        hidden_layer_ids=LAYER_IDS, kv_cache_tokens=4096, block_size=4, attention=attention,
        cpu_packed_weights=False, cuda_graphs=graphs, graph_rows_per_request=GAMMA + 1))


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, None]
    assert [table_bucket(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]


@pytest.mark.parametrize("attention", [AttentionImpl.PADDED, AttentionImpl.TRITON])
def test_static_path_equals_the_ordinary_forward(tiny_target, attention):
    """Prompts (more than Q tokens: the ordinary path), then decode and verification-like
    forwards of 1, 3 and 5 requests (buckets 1, 4, 8) with 1 to Q new tokens each (a decode
    step of one token a request among them), contexts
    growing across table widths: logits and hidden states equal the ordinary path's, the cache
    ends up the same, and the scratch block stays out of every request. TRITON: the kernel under
    Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py), the same code a GPU runs."""
    folder, _ = tiny_target
    plain, graphed = make_runner(folder, False, attention), make_runner(folder, True, attention)
    assert plain.graphs is None and graphed.graphs is not None
    Q = GAMMA + 1
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (11, 3, 17, 9, 26)]
    rounds = [[ForwardItem(r, p) for r, p in enumerate(prompts)]]  # prefill: ordinary path
    for step, ids in enumerate([[0], [0, 2, 4], [0, 1, 2, 3, 4], [1, 3, 4], [2]]):
        rounds.append([ForwardItem(r, torch.randint(3, 60, (1 + (r + step) % Q,), generator=g).tolist(),
                                   logits_from=0 if (r + step) % 2 else None) for r in ids])
    rounds.append([ForwardItem(r, [7 + r]) for r in range(len(prompts))])  # a decode step
    for runner in (plain, graphed):
        for r in range(len(prompts)):
            runner.add_request(r)
    for items in rounds:
        outs = [runner.forward(items) for runner in (plain, graphed)]
        assert outs[0].logit_counts == outs[1].logit_counts
        assert outs[0].hidden_counts == outs[1].hidden_counts
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[1].hidden, outs[0].hidden, rtol=1e-4, atol=1e-4)
    assert graphed.graphs.forwards == len(rounds) - 1
    assert {b for b, _, _ in graphed.graphs.buckets} == {1, 4, 8}
    assert len({w for _, w, _ in graphed.graphs.buckets}) > 1
    assert {q for _, _, q in graphed.graphs.buckets} == {1, Q}  # a decode step takes 1 row
    manager = graphed.cache.manager
    scratch = graphed.graphs.scratch_block
    for r in range(len(prompts)):
        assert scratch not in manager.block_ids(r, manager.length(r))
        assert manager.length(r) == plain.cache.manager.length(r)
    assert SCRATCH_ID in manager


def test_more_rows_than_a_bucket_take_the_ordinary_path(tiny_target):
    folder, _ = tiny_target
    runner = make_runner(folder, True)
    runner.add_request("a")
    runner.forward([ForwardItem("a", list(range(3, 3 + GAMMA + 2)))])  # Q + 1 new tokens
    assert runner.graphs.forwards == 0
    runner.forward([ForwardItem("a", [5])])
    assert runner.graphs.forwards == 1


@pytest.mark.parametrize("policy", ["none", "async_topk", f"fixed:{GAMMA}"])
def test_greedy_engine_outputs_are_token_identical_with_and_without(tiny_target, policy):
    folder, _ = tiny_target
    outputs = []
    for graphs in (False, True):
        runner = make_runner(folder, graphs)
        table = CostTable.from_step_seconds({b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)})
        engine = Engine(TargetVerifier(runner), tiny_dspark(0, runner), table, EngineConfig().with_values(
            policy=policy, max_running=8, update_cost_table=False))
        prompts = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [40], [8, 8, 8, 8, 8]]
        done = engine.generate(prompts, SamplingParams(temperature=0), max_tokens=24)
        outputs.append([r.output_ids for r in done])
        if graphs:
            assert runner.graphs.forwards > 0
    assert outputs[0] == outputs[1]


def test_a_graphed_forward_uploads_once_and_reads_nothing(tiny_target):
    """On a pretend CUDA device (tests/pretend_device.py): a graphed verification-like forward
    moves its metadata and output rows in one copy and reads nothing back."""
    from ..pretend_device import PretendDevice

    folder, _ = tiny_target
    runner = make_runner(folder, True)
    device = PretendDevice()
    device.place_runner(runner)
    for r in range(3):
        runner.add_request(r)
    with device:
        runner.forward([ForwardItem(r, [5, 6, 7]) for r in range(3)])  # short prompts: graphed too
        device.reset_counts()
        out = runner.forward([ForwardItem(r, [8, 9, 10, 11][: 2 + r], logits_from=0)
                              for r in range(3)])
        assert (device.uploads, device.syncs) == (1, 0), dict(device.sync_calls)
    assert runner.graphs.forwards == 2 and out.logits.shape[0] == 2 + 3 + 4
    assert device.is_on_device(out.logits)
