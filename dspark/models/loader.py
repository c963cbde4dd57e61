"""Load a Hugging Face-format causal LM folder (config.json + *.safetensors) into our Transformer.

Checkpoint names are mapped onto our fused layout: q/k/v projections are concatenated into
`qkv_proj`, gate/up into `gate_up_proj`. A checkpoint without `lm_head.weight` is accepted only
when the config ties the LM head to the embedding. Any weight left over or missing is an error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from dspark.models.config import ModelConfig
from dspark.models.transformer import Rotary, Transformer

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}

# HF names whose tensors are concatenated (dim 0, in this order) into one of ours.
_FUSED: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Layer projections that load_model stores as W^T on CPU float32 (transformer.Linear, transposed=True).
_TRANSPOSED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}") from None


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            return sorted({model_dir / name for name in json.load(f)["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files, by their Hugging Face names (on CPU)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def convert_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig,
                       transposed_projections: bool = False) -> dict[str, torch.Tensor]:
    """Hugging Face names -> our module names, fusing q|k|v and gate|up (and, with
    `transposed_projections`, storing the layers' projection weights as W^T)."""

    def layout(module: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        transpose = transposed_projections and kind == "weight" and module in _TRANSPOSED
        return tensor.t().contiguous() if transpose else tensor

    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    ours: dict[str, torch.Tensor] = {}
    fused_parts: dict[str, str] = {part: fused for fused, parts in _FUSED.items() for part in parts}
    pending: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            ours[name.removeprefix("model.")] = tensor
            continue
        match = _LAYER_KEY.match(name)
        if match is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        layer, module, kind = int(match[1]), match[2], match[3]
        if module in fused_parts:
            pending.setdefault((layer, fused_parts[module], kind), {})[module] = tensor
        else:
            ours[f"layers.{layer}.{module}.{kind}"] = layout(module, kind, tensor)
    for (layer, fused, kind), parts in pending.items():
        missing = [p for p in _FUSED[fused] if p not in parts]
        if missing:
            raise ValueError(f"layer {layer}: {kind} of {missing} missing from checkpoint")
        fused_tensor = torch.cat([parts[p] for p in _FUSED[fused]], dim=0)
        ours[f"layers.{layer}.{fused}.{kind}"] = layout(fused, kind, fused_tensor)
    if config.tie_word_embeddings:
        ours.pop("lm_head.weight", None)  # tied: the embedding is the LM head
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    elif "lm_head.weight" not in ours:
        raise ValueError("checkpoint has no lm_head.weight and the config does not tie embeddings")
    return ours


def load_model(model_dir: str | Path, dtype: str | torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> Transformer:
    """Build our Transformer from a Hugging Face folder, weights in `dtype` on `device`, eval mode."""
    model_dir = Path(model_dir)
    dtype, device = resolve_dtype(dtype), torch.device(device)
    config = ModelConfig.from_pretrained(model_dir)
    # W^T projections only where they are faster: float32 on CPU (transformer.Linear).
    transposed = device.type == "cpu" and dtype == torch.float32
    state = {name: t.to(device=device, dtype=dtype)
             for name, t in convert_state_dict(read_checkpoint(model_dir), config, transposed).items()}
    with torch.device("meta"):  # no allocation or random init: the checkpoint fills every weight
        model = Transformer(config, transposed_projections=transposed)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"checkpoint does not fit {config.family.value}: missing {result.missing_keys}, "
                         f"unexpected {result.unexpected_keys}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(config).to(device)  # a non-persistent buffer: not in the checkpoint
    return model.eval().requires_grad_(False)
