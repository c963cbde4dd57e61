"""Typed configuration of the drafters, read from and written to a DeepSpec-compatible config.json.

docs/design.md section 3. The reference implementation (DeepSeek's DeepSpec, MIT) builds a drafter's
config.json as a deep copy of the *target's* config with the drafter's fields added on top:
`architectures=["Qwen3DSparkModel"]`, `block_size`, `mask_token_id`, `target_layer_ids`,
`markov_rank`, `markov_head_type`, `num_hidden_layers` (the drafter's depth),
`enable_confidence_head`, `confidence_head_with_markov`, `num_target_layers`, `num_anchors`.
We keep that layout so that its released checkpoints load and ours load in its code:

- `markov_head_type` on disk is DeepSpec's name: "vanilla" for our `markov` head, "rnn" for `rnn`.
  The `none` head (DFlash) is `markov_rank = 0` (DeepSpec then has no sequential head); we write
  `markov_head_type = "none"` beside it, which DeepSpec ignores. "markov" is accepted on reading.
- With the `none` head there is no `W1`, so the confidence head, if enabled, reads `norm(h_k)` only
  (`confidence_head_with_markov = false`, weight [1, hidden]); that is what DeepSpec does with
  markov_rank 0, and such a confidence cannot depend on any sampled token at all.
- `draft_vocab_size` (optional, EAGLE-3 style): the drafter's LM head covers only the N most
  frequent target tokens; the checkpoint then carries `d2t` (draft id -> target id offsets).
- Every other key of the target's config (model_type, rope, token ids...) is kept in `extra` and
  written back unchanged.

The Eagle-style baseline (`dspark.models.eagle`) uses the same dataclass with
`architecture = EAGLE`: one layer, no sequential head, no confidence head.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class SequentialHead(str, Enum):
    """The sequential head that adds a prefix-dependent bias to the parallel logits."""

    MARKOV = "markov"  # B(x_{k-1}, .) = W1[x_{k-1}] W2^T, low rank (the default)
    RNN = "rnn"  # gated recurrent state over the block prefix
    NONE = "none"  # no bias: the DFlash baseline


class Architecture(str, Enum):
    """Which drafter a checkpoint holds (config.json `architectures[0]`)."""

    DSPARK = "Qwen3DSparkModel"
    EAGLE = "EagleStyleDrafter"


# DeepSpec's on-disk names of the heads, and the names we accept when reading.
_HEAD_TO_DISK = {SequentialHead.MARKOV: "vanilla", SequentialHead.RNN: "rnn",
                 SequentialHead.NONE: "none"}
_DISK_TO_HEAD = {"vanilla": SequentialHead.MARKOV, "markov": SequentialHead.MARKOV,
                 "rnn": SequentialHead.RNN, "none": SequentialHead.NONE}

# Keys this dataclass owns; everything else in config.json goes to `extra`.
_OWN_KEYS = (
    "architectures", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "vocab_size", "num_hidden_layers", "block_size", "mask_token_id",
    "target_layer_ids", "num_target_layers", "markov_rank", "markov_head_type",
    "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size", "attention_bias",
    "hidden_act", "num_anchors", "layer_types", "tie_word_embeddings", "inject_last_context",
)


@dataclass
class DrafterConfig:
    """Shape and options of a drafter. Validated on construction."""

    hidden_size: int
    """d: the target's hidden size (the drafter shares the target's embedding and LM head)."""
    intermediate_size: int
    """Width of each drafter layer's SwiGLU MLP."""
    num_attention_heads: int
    num_key_value_heads: int
    """GQA: query heads are grouped over this many key/value heads."""
    head_dim: int
    vocab_size: int
    """V: the target's vocabulary size."""
    target_layer_ids: list[int]
    """l_1..l_m: target layers whose outputs are fused into context features (-1 = embeddings)."""
    num_target_layers: int
    """Depth of the target (to validate target_layer_ids)."""
    num_hidden_layers: int = 1
    """Depth of the drafter's backbone."""
    block_size: int = 7
    """gamma: draft positions per block (anchor + gamma - 1 mask tokens in, gamma predictions out)."""
    mask_token_id: int = 0
    """Target token whose (frozen) embedding fills block positions 2..gamma."""
    markov_head_type: SequentialHead = SequentialHead.MARKOV
    markov_rank: int = 256
    """r: rank of W1 [V, r] and W2 [V_draft, r]; 0 with head `none`."""
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    """Confidence input [norm(h_k); W1[x_{k-1}]] (True) or norm(h_k) only (False)."""
    draft_vocab_size: int | None = None
    """Size of the reduced draft vocabulary; None = the full vocabulary."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    num_anchors: int = 16
    """Anchors per training sequence (DeepSpec requires the field; informative here)."""
    inject_last_context: bool = False
    """Add the fused context state of the last context token (position a - 1),
    `hidden_norm(fc(features))`, to every block input embedding: a direct path to the most recent
    target features, as EAGLE / MTP heads have (they concatenate it with the token embedding).
    No extra parameters. False = DeepSpec's DFlash/DSpark backbone (its checkpoints lack the key)."""
    architecture: Architecture = Architecture.DSPARK
    extra: dict[str, Any] = field(default_factory=dict)
    """The rest of the target's config, written back unchanged."""

    def __post_init__(self) -> None:
        self.markov_head_type = SequentialHead(self.markov_head_type)
        self.architecture = Architecture(self.architecture)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_hidden_layers",
                     "block_size", "num_target_layers"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        prev = None
        for layer_id in self.target_layer_ids:
            if not (layer_id == -1 or 0 <= layer_id < self.num_target_layers):
                raise ValueError(f"target layer {layer_id} out of range for a "
                                 f"{self.num_target_layers}-layer target")
            if prev is not None and layer_id <= prev:
                raise ValueError("target_layer_ids must be strictly increasing")
            prev = layer_id
        if not (0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary")
        if self.markov_rank < 0:
            raise ValueError("markov_rank must be >= 0")
        if self.markov_head_type == SequentialHead.NONE:
            if self.markov_rank != 0:
                raise ValueError("head `none` has no W1/W2: markov_rank must be 0")
            if self.confidence_head_with_markov and self.enable_confidence_head:
                raise ValueError("head `none` has no W1: confidence_head_with_markov must be False")
        elif self.markov_rank == 0:
            raise ValueError(f"head `{self.markov_head_type.value}` needs markov_rank > 0")
        if self.draft_vocab_size is not None and not (0 < self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be in (0, {self.vocab_size}]")
        if self.architecture == Architecture.EAGLE:
            if self.markov_head_type != SequentialHead.NONE or self.enable_confidence_head:
                raise ValueError("the Eagle-style drafter has no sequential or confidence head")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")

    # ---- derived -------------------------------------------------------------------------

    @property
    def gamma(self) -> int:
        return self.block_size

    @property
    def num_context_layers(self) -> int:
        """m: number of fused target layers; context features are [num_tokens, m * hidden]."""
        return len(self.target_layer_ids)

    @property
    def effective_draft_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def confidence_input_size(self) -> int:
        with_w1 = self.confidence_head_with_markov and self.markov_rank > 0
        return self.hidden_size + (self.markov_rank if with_w1 else 0)

    # ---- construction from a target ------------------------------------------------------

    @staticmethod
    def from_target_config(target_config: dict[str, Any], **overrides: Any) -> "DrafterConfig":
        """A drafter config for a target whose HF config.json is `target_config`.

        `overrides` sets the drafter fields (num_hidden_layers, block_size, mask_token_id,
        target_layer_ids, markov_head_type, markov_rank, ...).
        """
        base = copy.deepcopy(dict(target_config))
        base["num_target_layers"] = int(base["num_hidden_layers"])
        base.pop("num_hidden_layers")
        base.pop("architectures", None)
        head = SequentialHead(overrides.get("markov_head_type", SequentialHead.MARKOV))
        if head == SequentialHead.NONE:
            overrides.setdefault("markov_rank", 0)
            overrides.setdefault("confidence_head_with_markov", False)
        fields = _parse_common(base)
        fields.update(overrides)
        return DrafterConfig(**fields)

    # ---- config.json ---------------------------------------------------------------------

    def to_json_dict(self) -> dict[str, Any]:
        out = copy.deepcopy(self.extra)
        out.update({
            "architectures": [self.architecture.value],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "markov_rank": self.markov_rank,
            "markov_head_type": _HEAD_TO_DISK[self.markov_head_type],
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": bool(self.confidence_head_with_markov
                                                and self.markov_rank > 0),
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "num_anchors": self.num_anchors,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "tie_word_embeddings": False,
        })
        if self.inject_last_context:
            out["inject_last_context"] = True
        # Keep the target's rope description consistent with rope_theta.
        rope = out.get("rope_parameters")
        if isinstance(rope, dict):
            rope = dict(rope)
            rope["rope_theta"] = self.rope_theta
            rope.setdefault("rope_type", "default")
            out["rope_parameters"] = rope
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        else:
            out.pop("draft_vocab_size", None)
        return out

    @staticmethod
    def from_json_dict(data: dict[str, Any]) -> "DrafterConfig":
        data = copy.deepcopy(dict(data))
        arch_names = data.get("architectures") or [Architecture.DSPARK.value]
        try:
            architecture = Architecture(arch_names[0])
        except ValueError:
            raise ValueError(f"unsupported drafter architecture {arch_names[0]!r}") from None
        fields = _parse_common(data)
        markov_rank = int(data.get("markov_rank", 0))
        head_name = str(data.get("markov_head_type", "vanilla" if markov_rank > 0 else "none"))
        if markov_rank == 0:
            head = SequentialHead.NONE
        elif head_name.lower() in _DISK_TO_HEAD:
            head = _DISK_TO_HEAD[head_name.lower()]
        else:
            raise ValueError(f"unsupported markov_head_type {head_name!r} "
                             f"(supported: vanilla/markov, rnn, none)")
        enable_conf = bool(data.get("enable_confidence_head", False))
        with_markov = bool(data.get("confidence_head_with_markov", markov_rank > 0))
        num_target_layers = data.get("num_target_layers")
        if num_target_layers is None:
            num_target_layers = max(int(i) for i in data["target_layer_ids"]) + 1
        fields.update(
            architecture=architecture,
            num_hidden_layers=int(data["num_hidden_layers"]),
            num_target_layers=int(num_target_layers),
            block_size=int(data["block_size"]),
            mask_token_id=int(data["mask_token_id"]),
            target_layer_ids=[int(i) for i in data["target_layer_ids"]],
            markov_rank=markov_rank,
            markov_head_type=head,
            enable_confidence_head=enable_conf,
            confidence_head_with_markov=with_markov and markov_rank > 0,
            draft_vocab_size=(int(data["draft_vocab_size"])
                              if data.get("draft_vocab_size") else None),
            num_anchors=int(data.get("num_anchors", 16)),
            inject_last_context=bool(data.get("inject_last_context", False)),
        )
        return DrafterConfig(**fields)

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @staticmethod
    def load(folder: str | Path) -> "DrafterConfig":
        return DrafterConfig.from_json_dict(json.loads((Path(folder) / "config.json").read_text()))


def _parse_common(data: dict[str, Any]) -> dict[str, Any]:
    """The backbone fields shared by every HF decoder config; the rest goes to `extra`."""
    hidden = int(data["hidden_size"])
    heads = int(data["num_attention_heads"])
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ("default", None):
        raise ValueError(f"rope type {rope_type!r} is not supported (only default RoPE)")
    rope_theta = data.get("rope_theta")
    if rope_theta is None and isinstance(rope, dict):
        rope_theta = rope.get("rope_theta")
    act = data.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    extra = {k: v for k, v in data.items() if k not in _OWN_KEYS}
    if isinstance(data.get("rope_parameters"), dict):
        extra["rope_parameters"] = copy.deepcopy(data["rope_parameters"])
    return dict(
        hidden_size=hidden,
        intermediate_size=int(data["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads),
        vocab_size=int(data["vocab_size"]),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        attention_bias=bool(data.get("attention_bias", False)),
        num_target_layers=int(data.get("num_target_layers") or data.get("num_hidden_layers") or 1),
        extra=extra,
    )


def spread_layer_ids(num_target_layers: int, num_context_layers: int) -> list[int]:
    """m target layers spread over depth, from layer 1 to layer L-3 (never the final layer,
    whose transformers hidden state is already normalised), as DFlash picks them."""
    if num_context_layers < 1:
        raise ValueError("num_context_layers must be >= 1")
    lo, hi = 1, max(1, num_target_layers - 3)
    if num_context_layers == 1:
        return [(lo + hi) // 2]
    ids = [round(lo + i * (hi - lo) / (num_context_layers - 1)) for i in range(num_context_layers)]
    out: list[int] = []
    for i in ids:  # keep strictly increasing on very shallow targets
        out.append(max(i, out[-1] + 1) if out else i)
    if out[-1] >= num_target_layers:
        raise ValueError(f"cannot spread {num_context_layers} layers over a "
                         f"{num_target_layers}-layer target")
    return out
