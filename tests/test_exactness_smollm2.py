"""End-to-end greedy exactness on the real target with the shipped drafter.

18 eval prompts (chat template, spread over the four eval files) x up to 128 new tokens: the
embedded engine's output is token-identical to transformers `generate` run prompt by prompt on the
same fp32 weights, for every admission policy, with 8 concurrent requests (all 18 prompts through
continuous batching) and with 1 (one request at a time).

CI budget: the 8-concurrent runs cover all 18 prompts for every policy. One at a time, each
policy runs its own 3 of the 18, so the six policies together cover all 18; set
DSPARK_FULL_EXACTNESS=1 to run all 18 one at a time under every policy (six times the
one-at-a-time runs; not timed here).
Outputs stop at EOS on both sides, so they are compared including it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig
from dspark.loading import load_method_drafter, load_target
from dspark.models.drafter_config import DrafterConfig
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier

from .conftest import REPO_ROOT

pytestmark = pytest.mark.slow

NUM_PROMPTS, NEW_TOKENS = 18, 128
POLICIES = ["none", "fixed:1", "fixed:7", "threshold:0.5", "sync_greedy", "async_topk"]
FULL = os.environ.get("DSPARK_FULL_EXACTNESS") == "1"
DRAFTER_DIR = REPO_ROOT / "checkpoints" / "dspark-markov"
# Which tokens get verified must not change the output; a plausible CPU table keeps the policies'
# choices realistic without a noisy start-up profile.
COST_TABLE = CostTable.from_step_seconds({1: 0.060, 8: 0.090, 16: 0.120, 32: 0.190, 64: 0.330,
                                          128: 0.620})


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """This module is all real-model forwards: use the machine's cores (CI has two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer, eval_dir):
    """NUM_PROMPTS first turns, round-robin over the eval files, chat-templated token ids."""
    per_file = [[json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
                for path in sorted(eval_dir.glob("*.jsonl"))]
    texts = [rows[i] for i in range(NUM_PROMPTS) for rows in per_file if i < len(rows)][:NUM_PROMPTS]
    assert len(texts) == NUM_PROMPTS
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]) for t in texts]


@pytest.fixture(scope="module")
def expected(smollm2_dir, tokenizer, prompts):
    """transformers greedy `generate`, one prompt at a time (no padding), stopping at EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    """(verifier, drafter) on the real target, fp32, sharing one runner across the policies."""
    assert DRAFTER_DIR.is_dir(), f"the shipped drafter is missing: {DRAFTER_DIR}"
    layer_ids = tuple(DrafterConfig.load(DRAFTER_DIR).target_layer_ids)
    runner = load_target(smollm2_dir, layer_ids, kv_cache_tokens=8 * 1024, dtype="float32")
    drafter = load_method_drafter(DRAFTER_DIR, runner, apply_calibration=True)
    return TargetVerifier(runner), drafter


def run_engine(stack, policy: str, max_running: int, prompts, eos: int) -> list[list[int]]:
    verifier, drafter = stack
    engine = Engine(verifier, drafter, COST_TABLE, EngineConfig(
        AdmissionConfig(policy=policy), batching=BatchingConfig(max_running=max_running),
        update_cost_table=False))
    free_before = verifier.runner.num_free_blocks
    finished = engine.generate(prompts, SamplingParams(temperature=0.0), max_tokens=NEW_TOKENS,
                               stop_token_ids=[eos])
    assert verifier.runner.num_free_blocks == free_before  # every request's KV blocks came back
    return [list(r.output_ids) for r in finished]


def first_difference(ours: list[int], theirs: list[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"first difference at token {i}: ours {ours[i:i + 5]} vs transformers {theirs[i:i + 5]}"


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_identical_8_concurrent(stack, prompts, expected, tokenizer, policy):
    outs = run_engine(stack, policy, 8, prompts, tokenizer.eos_token_id)
    for i, (ours, theirs) in enumerate(zip(outs, expected)):
        assert ours == theirs, f"{policy}, prompt {i}: {first_difference(ours, theirs)}"


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_identical_one_at_a_time(stack, prompts, expected, tokenizer, policy):
    share = NUM_PROMPTS // len(POLICIES)
    index = POLICIES.index(policy)
    chosen = range(NUM_PROMPTS) if FULL else range(index * share, (index + 1) * share)
    outs = run_engine(stack, policy, 1, [prompts[i] for i in chosen], tokenizer.eos_token_id)
    for i, ours in zip(chosen, outs):
        assert ours == expected[i], f"{policy}, prompt {i}: {first_difference(ours, expected[i])}"
