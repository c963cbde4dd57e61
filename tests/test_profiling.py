"""`dspark profile`'s measurement loop on a tiny random Llama (fp32, CPU)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.step_timing import measure_step_seconds, split_tokens


class RecordingRunner(TargetRunner):
    """A real TargetRunner that also records the shape of every forward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forwards: list[list[int]] = []  # new tokens per item, per forward

    def forward(self, items):
        self.forwards.append([len(it.token_ids) for it in items])
        return super().forward(items)


def tiny_runner(tmp_path) -> RecordingRunner:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    return RecordingRunner(tmp_path, RunnerConfig(block_size=4, kv_cache_tokens=1024))


def test_split_tokens():
    assert split_tokens(1, 4) == [1]
    assert split_tokens(6, 4) == [2, 2, 1, 1]
    assert split_tokens(8, 4) == [2, 2, 2, 2]


def test_sizes_take_turns_and_context_stays_fixed(tmp_path):
    runner = tiny_runner(tmp_path)
    sizes = [1, 3, 8]
    seconds = measure_step_seconds(runner, sizes, context_len=20, requests=2, repeats=3, warmup=1)
    assert len(seconds) == len(sizes) and all(s > 0 for s in seconds)
    prefill, *steps = runner.forwards
    assert prefill == [20, 20]
    # One forward per size per round, sizes in turn, (warmup + repeats) rounds.
    assert steps == [split_tokens(b, 2) for b in sizes] * 4
    # Every request was truncated back to its context after each forward, then freed.
    assert runner.cache.manager.request_ids == []
    assert runner.num_free_blocks == runner.cache.manager.num_blocks
