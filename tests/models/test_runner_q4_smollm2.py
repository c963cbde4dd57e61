"""The real target with weights="q4" (the GGUF's own blocks): greedy token-identical to
transformers on the dequantised weights, the same under speculation (async_topk, fixed:7) as
target-only decoding, and a request's logits bit-identical alone or batched with others."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.engine import Engine, EngineConfig
from dspark.loading import load_method_drafter
from dspark.models.drafter_config import DrafterConfig
from dspark.models.gguf_blocks import find_gguf, read_block_weights
from dspark.models.quantized_linear import dequantize, kernel_available
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner, generate_greedy
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier

from ..conftest import REPO_ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the block kernel")]

NUM_PROMPTS, NEW_TOKENS = 4, 48
DRAFTER_DIR = REPO_ROOT / "checkpoints" / "dspark-markov"
COST_TABLE = CostTable.from_step_seconds({1: 0.060, 8: 0.090, 16: 0.120, 32: 0.190, 64: 0.330, 128: 0.620})


@pytest.fixture(scope="module")
def gguf_dir(smollm2_dir):
    if find_gguf(smollm2_dir) is None:
        pytest.skip("the model folder has no GGUF (dspark fetch-model keeps it)")
    return smollm2_dir


@pytest.fixture(scope="module")
def hf(gguf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(gguf_dir)


@pytest.fixture(scope="module")
def runner(gguf_dir):
    layer_ids = tuple(DrafterConfig.load(DRAFTER_DIR).target_layer_ids)
    r = TargetRunner(gguf_dir, RunnerConfig(dtype="float32", weights="q4", hidden_layer_ids=layer_ids,
                                            kv_cache_tokens=4096))
    assert r.weights == "q4"
    return r


@pytest.fixture(scope="module")
def strict_runner(gguf_dir):
    """Blocks for every pass, however many rows (q4_max_rows=None)."""
    return TargetRunner(gguf_dir, RunnerConfig(dtype="float32", weights="q4", q4_max_rows=None,
                                               kv_cache_tokens=4096))


@pytest.fixture(scope="module")
def prompts(hf, eval_dir):
    _, tokenizer = hf
    texts = []
    for path in sorted(eval_dir.glob("*.jsonl"))[:NUM_PROMPTS]:
        line = next(line for line in path.read_text().splitlines() if line.strip())
        texts.append(json.loads(line)["turns"][0])
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for t in texts]


@pytest.fixture(scope="module")
def expected(hf, prompts):
    model, tokenizer = hf
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.eos_token_id)
            outs.append(ids[0, len(p):].tolist())
    return outs


def test_blocks_are_the_folder_weights(gguf_dir, hf):
    """Every projection's blocks dequantise to transformers' float32 weights bit for bit (q and k
    rows un-interleaved, q|k|v and gate|up stacked)."""
    model, _ = hf
    blocks = read_block_weights(find_gguf(gguf_dir), model.config)
    for i in (0, 17, model.config.num_hidden_layers - 1):
        layer = model.model.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        assert torch.equal(dequantize(blocks[f"layers.{i}.self_attn.qkv_proj"]), qkv)
        assert torch.equal(dequantize(blocks[f"layers.{i}.self_attn.o_proj"]), attn.o_proj.weight)
        assert torch.equal(dequantize(blocks[f"layers.{i}.mlp.gate_up_proj"]),
                           torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert torch.equal(dequantize(blocks[f"layers.{i}.mlp.down_proj"]), mlp.down_proj.weight)
    assert torch.equal(dequantize(blocks["lm_head"]), model.lm_head.weight)


def test_greedy_token_identical_to_transformers(runner, prompts, expected, hf):
    _, tokenizer = hf
    outs = generate_greedy(runner, prompts, NEW_TOKENS, stop_token_ids=[tokenizer.eos_token_id])
    for i, (ours, theirs) in enumerate(zip(outs, expected)):
        assert ours == theirs, f"prompt {i}"


def test_logits_batch_invariant(strict_runner, prompts):
    """A request's verification logits (8 rows) are the same bits alone and beside three others,
    its prompt prefilled alone or beside theirs (q4_max_rows=None: blocks for every pass)."""
    runner = strict_runner

    def logits(batch: list[int]) -> list[torch.Tensor]:
        for i in batch:
            runner.add_request(("inv", i))
        out = runner.forward([ForwardItem(("inv", i), prompts[i]) for i in batch])
        out = runner.forward([ForwardItem(("inv", i), prompts[(i + 1) % len(prompts)][:8], logits_from=0)
                              for i in batch])
        for i in batch:
            runner.free(("inv", i))
        return [out.logits_of(k) for k in range(len(batch))]

    alone = logits([2])[0]
    together = logits([0, 1, 2, 3])[2]
    assert torch.equal(alone, together)


@pytest.mark.parametrize("drafter_weights", ["dense", "q8"])
@pytest.mark.parametrize("policy", ["async_topk", "fixed:7"])
def test_speculation_equals_target_only(runner, prompts, expected, hf, policy, drafter_weights):
    """The engine with the shipped drafter (dense, or on Q8_0 blocks of its weights) gives
    transformers' greedy tokens under the policy as under `none` (target-only decoding), 4
    concurrent requests."""
    _, tokenizer = hf
    drafter = load_method_drafter(DRAFTER_DIR, runner, apply_calibration=True, weights=drafter_weights)
    verifier = TargetVerifier(runner)
    outs = {}
    for p in ("none", policy):
        engine = Engine(verifier, drafter, COST_TABLE, EngineConfig().with_values(
            policy=p, max_running=4, update_cost_table=False))
        finished = engine.generate(prompts, SamplingParams(temperature=0.0), max_tokens=NEW_TOKENS,
                                   stop_token_ids=[tokenizer.eos_token_id])
        outs[p] = [list(r.output_ids) for r in finished]
    assert outs[policy] == outs["none"]
    assert outs["none"] == expected
