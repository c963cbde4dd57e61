"""Every tensor of a round lives on the runner's device: the engine run on a pretend CUDA device
(tests/pretend_device.py) on the CPU, where an op that mixes device and host tensors raises as
CUDA would. The outputs must also equal the same run on the plain CPU (the pretend device
changes nothing but where tensors say they are).
"""

from __future__ import annotations

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.engine import Engine, EngineConfig
from dspark.models.draft_types import DraftBlock
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.rejection import VerificationRule
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier, VerifyRequest
from loadtest.tiny_models import GAMMA, LAYER_IDS, VOCAB

from .conftest import tiny_dspark
from .pretend_device import MixedDevices, PretendDevice

PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [40]]
TABLE = {b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)}


def build(folder, policy: str, device: PretendDevice | None, rule=VerificationRule.TOKEN,
          sparse_top_k=None, chunk: int = 256) -> Engine:
    runner = TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS, kv_cache_tokens=4096,
                                               cpu_packed_weights=False))
    drafter = tiny_dspark(0, runner) if policy != "none" else None
    if device is not None:
        device.place_runner(runner)
        if drafter is not None:
            device.place(drafter)
    return Engine(TargetVerifier(runner, rule), drafter, CostTable.from_step_seconds(TABLE),
                  EngineConfig().with_values(
                      policy=policy, max_running=4, update_cost_table=False,
                      sparse_top_k=sparse_top_k, prefill_chunk_tokens=chunk))


def run(folder, policy, sampling, device=None, **kw) -> list[list[int]]:
    engine = build(folder, policy, device, **kw)
    torch.manual_seed(1)
    if device is None:
        done = engine.generate(PROMPTS, sampling, max_tokens=12)
    else:
        with device:
            done = engine.generate(PROMPTS, sampling, max_tokens=12)
    return [r.output_ids for r in done]


@pytest.mark.parametrize("policy", ["none", "async_topk", "fixed:3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_round_keeps_every_tensor_on_the_device(tiny_target, policy, temperature):
    folder, _ = tiny_target
    sampling = SamplingParams(temperature=temperature, seed=5)
    expected = run(folder, policy, sampling)
    got = run(folder, policy, sampling, PretendDevice())
    assert got == expected


@pytest.mark.parametrize("rule", [VerificationRule.TOKEN, VerificationRule.BLOCK])
@pytest.mark.parametrize("sparse_top_k", [None, 8])
def test_sampled_rules_and_sparse_drafts_on_the_device(tiny_target, rule, sparse_top_k):
    folder, _ = tiny_target
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3)
    kw = dict(rule=rule, sparse_top_k=sparse_top_k, chunk=3)
    assert (run(folder, f"fixed:{GAMMA}", sampling, PretendDevice(), **kw)
            == run(folder, f"fixed:{GAMMA}", sampling, **kw))


def test_blocks_from_the_host_are_moved_to_the_device(tiny_target):
    """A remote drafter's blocks arrive as host tensors (decoded from gRPC): the verifier moves
    them to its device."""
    folder, _ = tiny_target
    device = PretendDevice()
    runner = TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS, kv_cache_tokens=1024,
                                               cpu_packed_weights=False))
    device.place_runner(runner)
    verifier = TargetVerifier(runner)
    probs = torch.full((GAMMA, VOCAB), 1.0 / VOCAB)
    block = DraftBlock(tokens=torch.tensor([4, 5, 6, 7]), probs=probs,
                       confidences=torch.full((GAMMA,), 0.5))
    with device:
        verifier.prefill(["a", "b"], [[3, 4, 5], [6]], [SamplingParams(), SamplingParams(1.0)],
                         [None, None])
        out = verifier.verify([VerifyRequest("a", 9, block, GAMMA, SamplingParams()),
                               VerifyRequest("b", 9, block, 2, SamplingParams(1.0))])
    assert len(out.output_tokens) == 2 and all(1 <= len(t) <= GAMMA + 1 for t in out.output_tokens)


def test_the_pretend_device_catches_mixed_devices():
    """The checker itself: a host tensor meeting a device tensor raises; a host scalar, host
    indices into a device tensor, and explicit moves do not."""
    device = PretendDevice()
    with device:
        a = torch.ones(3, device="cuda")
        assert a.device.type == "cuda" and device.is_on_device(a)
        host = torch.ones(3)
        with pytest.raises(MixedDevices):
            a + host
        with pytest.raises(MixedDevices):
            host[torch.tensor([0], device="cuda")]
        a + torch.tensor(2.0)  # a host scalar is fine
        assert device.is_on_device(a[torch.tensor([0, 1])])
        assert device.is_on_device(host.to(a.device) + a)
        assert not device.is_on_device(a.cpu()) and device.is_on_device(a)
        before = device.syncs
        a.sum().item()
        assert device.syncs == before + 1
