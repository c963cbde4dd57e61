"""The drafter-unavailable fallback is exact: point-mass drafts (dspark.serving.remote_drafter.
fallback_blocks), verified by the real TargetVerifier in the real engine loop, leave the output
distribution exactly the target's (chi-square on the joint of the first two sampled tokens) and
greedy output token for token the same."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig
from dspark.loading import load_target
from dspark.sampling import SamplingParams
from dspark.serving.remote_drafter import fallback_blocks
from loadtest.tiny_models import GAMMA, LAYER_IDS, VOCAB
from dspark.verifier import TargetVerifier


class FallbackDrafter:
    """A drafter that is always 'unavailable': every block is the scheduler's fallback."""

    gamma = GAMMA

    def append_context(self, request_id, features, positions, token_ids=None) -> None:
        pass

    def release(self, request_id) -> None:
        pass

    def draft(self, requests, sparse_top_k=None, num_positions=None):
        return fallback_blocks(requests, num_positions or self.gamma)


def engine(tiny_models, policy: str) -> Engine:
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=16384)
    return Engine(TargetVerifier(runner), FallbackDrafter(), CostTable.load(tiny_models.cost_table),
                  EngineConfig(AdmissionConfig(policy=policy), batching=BatchingConfig(max_running=64),
                               update_cost_table=False))


def exact_first_two(tiny_models, prompt: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_models.target_dir).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), 0)
        ctx = torch.tensor([prompt + [v] for v in range(VOCAB)])
        p2 = torch.softmax(model(ctx).logits[:, -1].double(), 1)  # [V, V]
    return (p1[:, None] * p2).reshape(-1)


def test_fallback_sampling_is_exact(tiny_models):
    prompt, num = [3, 9, 27], 2000
    e = engine(tiny_models, f"fixed:{GAMMA}")  # every fallback draft is verified
    outputs: dict[int, list[int]] = {}
    for i in range(num):
        # Token 1 comes from the prefill; token 2 from verifying one point-mass draft (max_tokens
        # caps the drafts at max_tokens - produced - 1 = 1).
        e.add_request(prompt, SamplingParams(temperature=1.0), max_tokens=3, request_id=i)
    for out in e.stream():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert max(e.stats.batch_tokens) == 128  # 64 requests x (anchor + 1 draft): really verified
    codes = torch.tensor([o[0] * VOCAB + o[1] for o in outputs.values()])
    observed = torch.bincount(codes, minlength=VOCAB * VOCAB).double()
    expected = exact_first_two(tiny_models, prompt) * num
    big = expected >= 5  # pool small cells so the chi-square approximation holds
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    exp = exp / exp.sum() * obs.sum()
    assert float(chisquare(obs.numpy(), exp.numpy()).pvalue) > 1e-3


def test_fallback_greedy_is_plain_greedy(tiny_models):
    from dspark.models.runner import generate_greedy

    prompts = [[3, 9, 27, 17], [5, 6], [40]]
    done = engine(tiny_models, f"fixed:{GAMMA}").generate(prompts, SamplingParams(temperature=0),
                                                         max_tokens=24)
    runner = load_target(tiny_models.target_dir, (), kv_cache_tokens=4096)
    assert [r.output_ids for r in done] == generate_greedy(runner, prompts, 24)
