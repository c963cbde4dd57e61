"""Fixtures of the training tests: a tiny random Llama target and a repetitive toy answer set."""

from __future__ import annotations

import json
import random

import pytest
import torch

VOCAB = 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, rms_norm_eps=1e-6,
                      initializer_range=0.2)  # peaked p^t: acceptance starts low and can improve
    folder = tmp_path_factory.mktemp("target")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    """A repetitive toy set: short random prompts, answers cycling through a fixed pattern."""
    rng = random.Random(0)
    pattern = [10, 11, 12, 13, 14, 15]
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as f:
        for _ in range(40):
            prompt = [rng.randrange(20, 40) for _ in range(rng.randrange(3, 7))]
            start = rng.randrange(len(pattern))
            answer = [pattern[(start + i) % len(pattern)] for i in range(rng.randrange(24, 40))]
            f.write(json.dumps({"prompt_ids": prompt, "answer_ids": answer}) + "\n")
    return str(path)
