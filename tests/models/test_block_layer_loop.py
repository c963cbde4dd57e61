"""The decoder layers' kernel loop on GGUF blocks (`BlockLayerLoop`) against the module path:
the same logits and hidden-state bits for prefill, decode steps and verification blocks, taken
for the passes it applies to and left for the others."""

from __future__ import annotations

import pytest
import torch

from dspark.models import block_layer_loop, fused_norm
from dspark.models import paged_attention as pa
from dspark.models import quantized_linear
from dspark.models.quantized_linear import BlockFormat
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner
from dspark.models.transformer import AttentionImpl
from loadtest.tiny_models import VOCAB
from tests.models.test_block_linear import random_blocks

pytestmark = pytest.mark.skipif(
    not (quantized_linear.kernel_available() and pa.cpu_kernel_available() and fused_norm.lanes() is not None),
    reason="needs the block, attention and norm kernels")


def block_runner(folder, q4_max_rows: int | None, **config) -> TargetRunner:
    """A PAGED runner on the tiny Llama whose projections are random Q4_1 blocks (the LM head
    stays dense), the packed float32 weights beside them when `q4_max_rows` is set."""
    runner = TargetRunner(folder, RunnerConfig(block_size=4, kv_cache_tokens=512, max_tokens_per_pass=64,
                                               attention=AttentionImpl.PAGED, weights="dense", **config))
    model, c = runner.model, runner.model_config
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    shapes = {"self_attn.qkv_proj": (qkv, c.hidden_size),  # (out_features, in_features)
              "self_attn.o_proj": (c.hidden_size, c.num_attention_heads * c.head_dim),
              "mlp.gate_up_proj": (2 * c.intermediate_size, c.hidden_size),
              "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
    blocks = {f"layers.{i}.{name}": random_blocks(BlockFormat.Q4_1, out, in_features, seed=10 * i + j)
              for i in range(c.num_hidden_layers) for j, (name, (out, in_features)) in enumerate(shapes.items())}
    model.use_block_weights(blocks, max_rows=q4_max_rows)
    return runner


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def passes(runner: TargetRunner) -> list[torch.Tensor]:
    """Logits and hidden states of: two prompts (37 tokens: a long query, the module path; 9
    tokens), five decode steps of both, then an 8-token verification block beside a decode step."""
    outs = []
    for r, n in (("a", 37), ("b", 9)):
        runner.add_request(r)
        out = runner.forward([ForwardItem(r, tokens(n, seed=n), logits_from=0)])
        outs += [out.logits, out.hidden]
    for step in range(5):
        out = runner.forward([ForwardItem("a", tokens(1, seed=200 + step)), ForwardItem("b", tokens(1, seed=300 + step))])
        outs += [out.logits, out.hidden]
    out = runner.forward([ForwardItem("a", tokens(8, seed=7), logits_from=0), ForwardItem("b", tokens(1, seed=8))])
    return outs + [out.logits, out.hidden]


@pytest.mark.parametrize("q4_max_rows", [None, 4])
def test_loop_gives_the_module_paths_bits(tiny_target, monkeypatch, q4_max_rows):
    """With the loop and without it (module path), every pass's logits and captured hidden states
    are the same bits; the loop runs exactly the passes it applies to: not the 37-token prompt
    (long query), and with q4_max_rows=4 not the 9-row ones (the packed weights' passes)."""
    folder, _ = tiny_target
    runner = block_runner(folder, q4_max_rows, hidden_layer_ids=(0, 2))
    loop = runner.model.block_loop
    assert isinstance(loop, block_layer_loop.BlockLayerLoop)
    rows_run = []
    real_run = loop.run
    monkeypatch.setattr(loop, "run", lambda h, *a: rows_run.append(h.shape[0]) or real_run(h, *a))
    with_loop = passes(runner)
    assert rows_run == ([9] + [2] * 5 + [9] if q4_max_rows is None else [2] * 5)

    module_runner = block_runner(folder, q4_max_rows, hidden_layer_ids=(0, 2))
    module_runner.model.block_loop = None
    without = passes(module_runner)
    assert len(with_loop) == len(without)
    for a, b in zip(with_loop, without, strict=True):
        assert a is not None and torch.equal(a, b)


def test_loop_steps_aside_for_the_separate_steps(tiny_target, monkeypatch):
    """`Attention.fused_step` off (the tests' and benchmarks' separate steps) or no fused norm:
    the module path runs, so comparisons with the separate steps compare two paths."""
    from dspark.models import transformer

    folder, _ = tiny_target
    runner = block_runner(folder, None)
    loop = runner.model.block_loop
    rows_run = []
    real_run = loop.run
    monkeypatch.setattr(loop, "run", lambda h, *a: rows_run.append(h.shape[0]) or real_run(h, *a))
    runner.add_request("a")
    runner.forward([ForwardItem("a", tokens(5, seed=1), logits_from=0)])
    assert rows_run == [5]
    monkeypatch.setattr(transformer.Attention, "fused_step", False)
    runner.forward([ForwardItem("a", tokens(1, seed=2))])
    monkeypatch.setattr(transformer.Attention, "fused_step", True)
    monkeypatch.setattr(fused_norm, "lanes", lambda: None)
    runner.forward([ForwardItem("a", tokens(1, seed=3))])
    assert rows_run == [5]
