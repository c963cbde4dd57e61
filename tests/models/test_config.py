"""ModelConfig from config.json: families, rope variants (against transformers' own rope init), errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dspark.models.config import Family, ModelConfig, RopeConfig, RopeType

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=96)


def hf_dict(config_cls, **kwargs) -> dict:
    cfg = config_cls(**{**SMALL, **kwargs})
    cfg.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    return json.loads(cfg.to_json_string())


def test_llama_fields():
    mc = ModelConfig.from_dict(hf_dict(LlamaConfig, tie_word_embeddings=True, rms_norm_eps=1e-5))
    assert mc.family is Family.LLAMA
    assert (mc.vocab_size, mc.hidden_size, mc.intermediate_size) == (128, 64, 96)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (4, 2, 16)
    assert mc.num_queries_per_kv == 2
    assert mc.tie_word_embeddings and not mc.qkv_bias and not mc.qk_norm
    assert mc.rms_norm_eps == 1e-5
    assert mc.rope.type is RopeType.DEFAULT and mc.rope.theta == 10000.0


def test_qwen2_has_qkv_bias_only():
    mc = ModelConfig.from_dict(hf_dict(Qwen2Config))
    assert mc.family is Family.QWEN2
    assert mc.qkv_bias and not mc.o_bias and not mc.qk_norm
    assert mc.head_dim == 16  # hidden_size // num_attention_heads: Qwen2 has no head_dim field


def test_qwen3_has_qk_norm_and_own_head_dim():
    mc = ModelConfig.from_dict(hf_dict(Qwen3Config, head_dim=32))
    assert mc.family is Family.QWEN3
    assert mc.qk_norm and not mc.qkv_bias
    assert mc.head_dim == 32


@pytest.mark.parametrize("name", ["MistralForCausalLM", "GPT2LMHeadModel"])
def test_unsupported_architecture_is_named(name):
    raw = hf_dict(LlamaConfig)
    raw["architectures"] = [name]
    with pytest.raises(ValueError, match=name):
        ModelConfig.from_dict(raw)


def test_model_type_mismatch_is_named():
    raw = hf_dict(LlamaConfig)
    raw["model_type"] = "mistral"
    with pytest.raises(ValueError, match="mistral"):
        ModelConfig.from_dict(raw)


def test_gqa_must_divide():
    raw = hf_dict(LlamaConfig)
    raw["num_key_value_heads"] = 3
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.from_dict(raw)


def test_unsupported_rope_type_is_named():
    raw = hf_dict(LlamaConfig)
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_dict(raw)


def test_old_spelling_rope_theta_and_scaling():
    raw = hf_dict(LlamaConfig)
    del raw["rope_parameters"]
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {"type": "linear", "factor": 4.0}
    rope = ModelConfig.from_dict(raw).rope
    assert rope == RopeConfig(theta=500000.0, type=RopeType.LINEAR, factor=4.0)


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
             "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_match_transformers(case):
    params = ROPE_CASES[case]
    cfg = LlamaConfig(**SMALL, head_dim=32, max_position_embeddings=2048, rope_parameters=params)
    cfg.architectures = ["LlamaForCausalLM"]
    mc = ModelConfig.from_dict(json.loads(cfg.to_json_string()))
    assert mc.rope.type is RopeType(case)
    ours, our_scale = mc.rope.inv_freq_and_scaling(mc.head_dim)
    if case == "default":
        theirs = 1.0 / (params["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.float) / 32))
        their_scale = 1.0
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[case](cfg)
    assert ours.shape == (16,)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(their_scale)
    if case != "default":
        assert not torch.allclose(ours, 1.0 / (params["rope_theta"] ** (torch.arange(0, 32, 2) / 32)))


def test_from_pretrained_reads_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_dict(Qwen3Config)))
    assert ModelConfig.from_pretrained(tmp_path).family is Family.QWEN3
