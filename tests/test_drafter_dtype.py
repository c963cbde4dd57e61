"""The drafter's dtype (dspark.loading.drafter_dtype): bf16 under a float32 target on a CPU with
native bf16 products, the target's otherwise, and exact either way: a bf16 drafter verified by a
float32 target leaves greedy output token for token the target's and the sampled output
distribution the target's (chi-square on the joint of the first two tokens)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig
from dspark.cpu_info import cpu_description
from dspark.loading import drafter_dtype, load_method_drafter, load_target
from dspark.models.packed_linear import bf16_packing_supported
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import GAMMA, LAYER_IDS, VOCAB


def bf16_drafter_engine(tiny_models, policy: str) -> Engine:
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=16384, dtype="float32")
    drafter = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True,
                                  dtype=torch.bfloat16)
    assert drafter.fc.weight.dtype == torch.bfloat16 and runner.dtype == torch.float32
    return Engine(TargetVerifier(runner), drafter, CostTable.load(tiny_models.cost_table),
                  EngineConfig(AdmissionConfig(policy=policy), batching=BatchingConfig(max_running=64),
                               update_cost_table=False))


def test_drafter_dtype_follows_the_cpu_under_a_float32_target(tiny_models):
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024, dtype="float32")
    native = bool({"avx512_bf16", "amx_bf16"} & set(cpu_description()["flags"]))
    expected = torch.bfloat16 if native and bf16_packing_supported() else torch.float32
    assert drafter_dtype(runner) == expected
    assert load_method_drafter(tiny_models.drafter_dir, runner).fc.weight.dtype == expected
    explicit = load_method_drafter(tiny_models.drafter_dir, runner, dtype=torch.float32)
    assert explicit.fc.weight.dtype == torch.float32


def test_drafter_dtype_is_the_targets_under_a_bf16_target(tiny_models):
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024, dtype="bfloat16")
    assert drafter_dtype(runner) == torch.bfloat16


def test_bf16_drafter_keeps_greedy_output_the_targets(tiny_models):
    from dspark.models.runner import generate_greedy

    prompts = [[3, 9, 27, 17], [5, 6], [40], [11, 12, 13, 14, 15, 16, 2]]
    engine = bf16_drafter_engine(tiny_models, f"fixed:{GAMMA}")
    done = [engine.request(engine.add_request(p, SamplingParams(temperature=0), 24))
            for p in prompts]
    accepted = sum(result.stats.drafts_accepted for result in engine.steps())
    assert accepted > 0  # bf16 drafts were verified and some accepted
    runner = load_target(tiny_models.target_dir, (), kv_cache_tokens=4096, dtype="float32")
    assert [r.output_ids for r in done] == generate_greedy(runner, prompts, 24)


def test_bf16_drafter_keeps_the_sampled_distribution_the_targets(tiny_models):
    from transformers import LlamaForCausalLM

    prompt, num = [3, 9, 27], 2000
    engine = bf16_drafter_engine(tiny_models, f"fixed:{GAMMA}")
    outputs: dict[int, list[int]] = {}
    for i in range(num):
        # Token 1 comes from the prefill, token 2 from verifying one bf16 draft (max_tokens caps
        # the drafts at 1).
        engine.add_request(prompt, SamplingParams(temperature=1.0), max_tokens=3, request_id=i)
    for out in engine.stream():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert max(engine.stats.batch_tokens) == 128  # 64 requests x (anchor + 1 draft)
    model = LlamaForCausalLM.from_pretrained(tiny_models.target_dir).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), 0)
        ctx = torch.tensor([prompt + [v] for v in range(VOCAB)])
        p2 = torch.softmax(model(ctx).logits[:, -1].double(), 1)  # [V, V]
    expected = (p1[:, None] * p2).reshape(-1) * num
    codes = torch.tensor([o[0] * VOCAB + o[1] for o in outputs.values()])
    observed = torch.bincount(codes, minlength=VOCAB * VOCAB).double()
    big = expected >= 5  # pool small cells so the chi-square approximation holds
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    exp = exp / exp.sum() * obs.sum()
    assert float(chisquare(obs.numpy(), exp.numpy()).pvalue) > 1e-3
