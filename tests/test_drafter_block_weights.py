"""The drafter on Q8_0 blocks of its own float32 weights (dspark.models.drafter_block_weights):
every linear and the LM head read blocks; its drafts equal those of a plain float32 drafter whose
weights are the blocks dequantised (the independent reference: F.linear on float tensors); dense
stays the default; and greedy output stays token for token the target's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig
from dspark.loading import choose_drafter_weights, load_method_drafter, load_target
from dspark.models.draft_types import DraftRequest
from dspark.models.drafter_block_weights import BlockLinear, DrafterWeights
from dspark.models.drafter_io import load_drafter
from dspark.models.quantized_linear import dequantize, kernel_available, quantize_q8_0
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import GAMMA, LAYER_IDS

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the block kernel")


def _features(runner, prompt: list[int]) -> torch.Tensor:
    from dspark.models.runner import ForwardItem

    runner.add_request("p")
    out = runner.forward([ForwardItem("p", prompt)])
    runner.free("p")
    return out.hidden_of(0).reshape(len(prompt), -1).float()  # [n, m * hidden]


def test_every_linear_and_the_lm_head_read_blocks(tiny_models):
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024, dtype="float32")
    drafter = load_method_drafter(tiny_models.drafter_dir, runner, weights="q8")
    assert not [name for name, m in drafter.named_modules()
                if type(m) is nn.Linear and m.in_features % 32 == 0]  # the rest stay float32
    blocks = [m for m in drafter.modules() if isinstance(m, BlockLinear)]
    assert blocks and drafter.fc in blocks and drafter.lm_head_blocks is not None
    assert drafter.fc.weight.dtype == torch.float32


def test_drafts_equal_the_dequantized_float32_drafter(tiny_models):
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024, dtype="float32")
    q8 = load_method_drafter(tiny_models.drafter_dir, runner, weights="q8")
    reference = load_drafter(tiny_models.drafter_dir, runner.model.embed_tokens.weight,
                             runner.model.lm_head.weight, dtype=torch.float32)  # not packed: F.linear
    with torch.no_grad():
        for m in reference.modules():
            if type(m) is nn.Linear and m.in_features % 32 == 0:
                m.weight.copy_(dequantize(quantize_q8_0(m.weight)))
        reference.lm_head_weight = dequantize(quantize_q8_0(reference.lm_head_weight))
    prompt = [3, 9, 27, 17, 5, 6, 40, 11]
    features = _features(runner, prompt)
    for drafter in (q8, reference):
        drafter.append_context("r", features, torch.arange(len(prompt)))
    for temperature in (0.0, 1.0):
        request = [DraftRequest("r", prompt[-1], len(prompt), SamplingParams(temperature=temperature, seed=7))]
        got, want = q8.draft(request)[0], reference.draft(request)[0]
        assert torch.equal(got.tokens, want.tokens), temperature
        torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.confidences, want.confidences, rtol=1e-4, atol=1e-5)


def test_choice(tiny_models):
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024, dtype="float32")
    assert choose_drafter_weights(None, runner) is DrafterWeights.DENSE  # see its docstring
    assert choose_drafter_weights("q8", runner) is DrafterWeights.Q8
    assert choose_drafter_weights(None, runner, torch.bfloat16) is DrafterWeights.DENSE  # a dtype: dense
    assert choose_drafter_weights("dense", runner) is DrafterWeights.DENSE
    with pytest.raises(ValueError):
        choose_drafter_weights("q8", runner, torch.bfloat16)


def test_q8_drafter_keeps_greedy_output_the_targets(tiny_models):
    from dspark.models.runner import generate_greedy

    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=16384, dtype="float32")
    drafter = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True, weights="q8")
    engine = Engine(TargetVerifier(runner), drafter, CostTable.load(tiny_models.cost_table),
                    EngineConfig(AdmissionConfig(policy=f"fixed:{GAMMA}"),
                                 batching=BatchingConfig(max_running=64), update_cost_table=False))
    prompts = [[3, 9, 27, 17], [5, 6], [40], [11, 12, 13, 14, 15, 16, 2]]
    done = [engine.request(engine.add_request(p, SamplingParams(temperature=0), 24)) for p in prompts]
    accepted = sum(result.stats.drafts_accepted for result in engine.steps())
    assert accepted > 0  # q8 drafts were verified and some accepted
    target = load_target(tiny_models.target_dir, (), kv_cache_tokens=4096, dtype="float32")
    assert [r.output_ids for r in done] == generate_greedy(target, prompts, 24)
