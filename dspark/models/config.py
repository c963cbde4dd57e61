"""Typed model configuration, read from a Hugging Face `config.json`.

Supported families: Llama (SmolLM2, Llama 2/3), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).
Both config spellings are accepted: transformers 5 writes `rope_parameters` (theta and scaling in
one dict); older files write `rope_theta` and `rope_scaling` side by side.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any

import torch


class Family(enum.Enum):
    """Decoder families our transformer implements; they differ only in the attention block."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"


# config.json `architectures` entry -> family; `model_type` must match the family's value.
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family.LLAMA,
    "Qwen2ForCausalLM": Family.QWEN2,
    "Qwen3ForCausalLM": Family.QWEN3,
}


class RopeType(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding, as transformers' `rope_parameters` describes it."""

    theta: float
    """Base wavelength."""
    type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    """linear / llama3 / yarn: context extension factor."""
    low_freq_factor: float = 1.0
    """llama3 only."""
    high_freq_factor: float = 4.0
    """llama3 only."""
    original_max_position_embeddings: int | None = None
    """llama3 / yarn: the pre-training context length."""
    attention_factor: float | None = None
    """yarn: scale applied to cos/sin (None: derived from `factor`, as transformers does)."""
    beta_fast: float = 32.0
    """yarn: extrapolation boundary of the linear ramp."""
    beta_slow: float = 1.0
    """yarn: interpolation boundary of the linear ramp."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions."""

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope factor must be positive, got {self.factor}")
        if self.type in (RopeType.LLAMA3, RopeType.YARN) and not self.original_max_position_embeddings:
            raise ValueError(f"rope type {self.type.value} needs original_max_position_embeddings")
        if self.type is RopeType.LLAMA3 and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")

    def inv_freq_and_scaling(self, head_dim: int) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale.

        Written to give the same floats as transformers' `ROPE_INIT_FUNCTIONS`.
        """
        dim = head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.type is RopeType.DEFAULT:
            return inv_freq, 1.0
        if self.type is RopeType.LINEAR:
            return inv_freq / self.factor, 1.0
        old_len = float(self.original_max_position_embeddings)
        if self.type is RopeType.LLAMA3:
            low_freq_wavelen = old_len / self.low_freq_factor
            high_freq_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            return torch.where(is_medium, smoothed, scaled), 1.0
        # YARN: blend interpolated and extrapolated frequencies with a linear ramp over dimensions.
        attention_factor = self.attention_factor
        if attention_factor is None:
            attention_factor = 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # the ramp needs a non-empty interval
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation_factor = 1 - ramp
        inv_freq = (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation_factor) + (
            1.0 / pos_freqs) * extrapolation_factor
        return inv_freq, float(attention_factor)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        """From a config.json dict (either `rope_parameters` or `rope_theta` + `rope_scaling`)."""
        params = raw.get("rope_parameters")
        if params is None:  # the pre-transformers-5 spelling
            params = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 10000.0)}
        theta = params.get("rope_theta", 10000.0)
        type_name = params.get("rope_type", params.get("type", "default"))
        try:
            rope_type = RopeType(type_name)
        except ValueError:
            raise ValueError(f"unsupported rope type {type_name!r}; supported: "
                             f"{', '.join(t.value for t in RopeType)}") from None
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        original = params.get("original_max_position_embeddings")
        if rope_type is RopeType.YARN and original is None:
            original = raw.get("max_position_embeddings")
        factor = params.get("factor")
        if factor is None and rope_type is RopeType.YARN:
            factor = raw["max_position_embeddings"] / original
        return cls(
            theta=float(theta),
            type=rope_type,
            factor=float(factor if factor is not None else 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original) if original is not None else None,
            attention_factor=params.get("attention_factor"),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only causal LM: everything the forward pass needs."""

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """< num_attention_heads means grouped-query attention (GQA)."""
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    """The LM head reuses the token embedding matrix."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2; Llama's `attention_bias`)."""
    o_bias: bool = False
    """The output projection carries a bias (Llama's `attention_bias`)."""
    mlp_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate and convert a config.json dict; ValueError names what is unsupported."""
        architectures = raw.get("architectures") or []
        model_type = raw.get("model_type")
        families = {ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES}
        if len(families) != 1 or model_type != next(iter(families)).value:
            raise ValueError(
                f"unsupported model: architectures={architectures!r}, model_type={model_type!r}; "
                f"supported: {', '.join(f'{a} ({f.value})' for a, f in ARCHITECTURES.items())}")
        family = families.pop()
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        if raw.get("use_sliding_window", False):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        layer_types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"unsupported layer_types {sorted(set(layer_types))} (only full_attention)")
        if raw.get("pretraining_tp", 1) != 1:
            raise ValueError("pretraining_tp != 1 is not supported")
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=RopeConfig.from_hf(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if family is Family.QWEN2 else attention_bias,
            o_bias=attention_bias if family is not Family.QWEN2 else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family is Family.QWEN3,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read `<model_dir>/config.json`."""
        with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))
