"""TargetRunner against transformers on the real SmolLM2-135M-Instruct (fp32, CPU).

Same agreement checks as the tiny models, on real weights and chat prompts, plus the end-to-end
one: greedy generation of 20 eval prompts x 64 tokens, all streams concurrently through our
flattened batch, is token-identical to transformers `generate` run prompt by prompt.
"""

from __future__ import annotations

import json

import pytest
import torch

from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner, generate_greedy

pytestmark = pytest.mark.slow

TOL = 1e-3  # max abs logit difference held (logits reach ~40; observed: 0 to ~1e-5)
HIDDEN_RTOL = 1e-5  # hidden states: max abs difference relative to the largest activation (~2.5e4)
NUM_PROMPTS, NEW_TOKENS = 20, 64
LAYERS = (2, 14, 27, 29)


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    return TargetRunner(smollm2_dir, RunnerConfig(dtype="float32", hidden_layer_ids=LAYERS,
                                                  max_tokens_per_pass=128))


@pytest.fixture(scope="module")
def chat_prompts(hf, eval_dir):
    """First turns of the eval files (5 per file, 4 files), chat-templated token ids."""
    _, tokenizer = hf
    files = sorted(eval_dir.glob("*.jsonl"))
    per_file = -(-NUM_PROMPTS // len(files))
    texts = []
    for path in files:
        lines = [line for line in path.read_text().splitlines() if line.strip()][:per_file]
        texts += [json.loads(line)["turns"][0] for line in lines]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
            for t in texts[:NUM_PROMPTS]]


def reference(model, token_ids):
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def assert_logits_match(ours, theirs):
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= TOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_prefill_decode_mixed_truncate(hf, runner, chat_prompts):
    model, _ = hf
    a, b, c = chat_prompts[0], chat_prompts[5], chat_prompts[10]
    for rid in "abc":
        runner.add_request(rid)
    try:
        # Prefill a (all positions, chunked: longer than 128 tokens after the next steps) and b.
        out = runner.forward([ForwardItem("a", a, logits_from=0), ForwardItem("b", b)])
        assert_logits_match(out.logits_of(0), reference(model, a)[0])
        assert_logits_match(out.logits_of(1), reference(model, b)[0][-1:])
        # Greedy continuations as "drafts": a decodes 1 token, b verifies 6, c is prefilled.
        a_next = out.logits_of(0)[-1:].argmax(-1).tolist()
        b_drafts = [int(t) for t in torch.randint(0, 49152, (6,), generator=torch.Generator().manual_seed(0))]
        out = runner.forward([ForwardItem("c", c), ForwardItem("a", a_next, logits_from=0),
                              ForwardItem("b", b_drafts, logits_from=0)])
        assert out.logit_counts == [1, 1, 6]
        assert_logits_match(out.logits_of(0), reference(model, c)[0][-1:])
        assert_logits_match(out.logits_of(1), reference(model, a + a_next)[0][-1:])
        assert_logits_match(out.logits_of(2), reference(model, b + b_drafts)[0][-6:])
        # b rejects all but 2 drafts, then continues.
        runner.truncate("b", len(b) + 2)
        more = [17, 42, 4242]
        out = runner.forward([ForwardItem("b", more, logits_from=0)])
        ref_logits, ref_hidden = reference(model, b + b_drafts[:2] + more)
        assert_logits_match(out.logits, ref_logits[-3:])
        # Hidden states of the configured layers for those 3 new tokens.
        for col, layer in enumerate(LAYERS):
            theirs = ref_hidden[layer + 1][-3:]
            ours = out.hidden[:, col]
            if layer == model.config.num_hidden_layers - 1:  # transformers reports it after the final norm
                ours = model.model.norm(ours)
            assert (ours - theirs).abs().max().item() <= HIDDEN_RTOL * theirs.abs().max().item()
    finally:
        for rid in "abc":
            runner.free(rid)


def test_greedy_generation_token_identical_to_transformers(hf, runner, chat_prompts):
    model, tokenizer = hf
    eos = model.generation_config.eos_token_id
    stop = [eos] if isinstance(eos, int) else list(eos)
    ours = generate_greedy(runner, chat_prompts, NEW_TOKENS, stop_token_ids=stop)
    assert runner.num_free_blocks == runner.cache.manager.num_blocks
    mismatches = []
    for index, prompt in enumerate(chat_prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=tokenizer.pad_token_id)
        theirs = ref[0, len(prompt):].tolist()
        if ours[index] != theirs:
            mismatches.append((index, ours[index], theirs))
    assert not mismatches, f"{len(mismatches)} of {len(chat_prompts)} prompts differ: {mismatches[:2]}"
    assert sum(len(t) for t in ours) > NUM_PROMPTS * NEW_TOKENS // 2  # real continuations, not instant EOS


def test_fetch_model_is_idempotent(smollm2_dir, capsys):
    """A second `dspark fetch-model` finds the prepared folder and only prints its path."""
    import argparse
    import time

    from dspark import fetch

    parser = argparse.ArgumentParser()
    fetch.configure(parser)
    start = time.perf_counter()
    assert fetch.run(parser.parse_args(["--dir", str(smollm2_dir)])) == 0
    assert time.perf_counter() - start < 5.0  # no download, no conversion
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
    assert (smollm2_dir / "chat_template.jinja").is_file() or "chat_template" in (
        smollm2_dir / "tokenizer_config.json").read_text()
