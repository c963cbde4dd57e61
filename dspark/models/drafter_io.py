"""Drafter checkpoints: a folder with config.json and safetensors in DeepSpec's tensor names.

docs/design.md section 3; the layout of DeepSeek's DeepSpec (MIT), so that its released DSpark
checkpoints load here and ours load there:

    config.json            the target's config + the drafter fields (see drafter_config)
    model.safetensors      fc.weight, hidden_norm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
                           layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
                           layers.{i}.{input,post_attention}_layernorm.weight, norm.weight,
                           markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [V_d, r],
                           (rnn: markov_head.joint_proj.{weight,bias}),
                           confidence_head.proj.weight [1, d (+ r)], confidence_head.proj.bias
                           d2t [V_d] int64, t2d [V] bool   (only with a reduced draft vocabulary)

`d2t` follows the EAGLE-3 convention: target id = draft id + d2t[draft id]. DeepSpec's own
checkpoints also carry `embed_tokens.weight` and `lm_head.weight` (frozen copies of the target's);
we never write them, and on loading use them only when the caller passes no target weights.
Sharded checkpoints (several *.safetensors files) load too.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.models.drafter import DSparkDrafter
from dspark.models.drafter_config import Architecture, DrafterConfig
from dspark.models.eagle import EagleDrafter

AnyDrafter = DSparkDrafter | EagleDrafter
WEIGHTS_NAME = "model.safetensors"
# Tensors DeepSpec stores that are the target's (frozen) and not ours to load as parameters.
_TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")


def drafter_class(config: DrafterConfig) -> type[AnyDrafter]:
    return EagleDrafter if config.architecture == Architecture.EAGLE else DSparkDrafter


def save_drafter(model: AnyDrafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors (atomically: a reader never sees half a file).

    dtype: store floating tensors in this dtype (e.g. torch.bfloat16 to halve the size)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        value = value.detach().cpu()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        tensors[name] = value.contiguous()
    cfg = model.config
    if cfg.draft_vocab_size is not None:
        ids = model.draft_to_target.detach().cpu()
        tensors["d2t"] = ids - torch.arange(ids.numel(), dtype=torch.int64)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".safetensors.tmp")
    os.close(fd)
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, folder / WEIGHTS_NAME)
    cfg.save(folder)
    return folder


def read_checkpoint(folder: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The config and every tensor of a checkpoint folder (all *.safetensors files merged)."""
    folder = Path(folder)
    config = DrafterConfig.load(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return config, tensors


def draft_token_ids_from(tensors: dict[str, torch.Tensor], config: DrafterConfig) -> torch.Tensor | None:
    """The draft vocabulary (ascending target ids) from `d2t`, or None for the full vocabulary."""
    d2t = tensors.get("d2t")
    if config.draft_vocab_size is None:
        if d2t is not None:
            raise ValueError("checkpoint has a d2t table but config has no draft_vocab_size")
        return None
    if d2t is None:
        raise ValueError(f"config declares draft_vocab_size={config.draft_vocab_size} but the "
                         f"checkpoint has no d2t table")
    d2t = d2t.to(torch.int64)
    if d2t.shape != (config.draft_vocab_size,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({config.draft_vocab_size},)")
    return torch.arange(d2t.numel(), dtype=torch.int64) + d2t


def load_drafter(folder: str | Path, embed_weight: torch.Tensor | None = None,
                 lm_head_weight: torch.Tensor | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> AnyDrafter:
    """Build the drafter a checkpoint folder describes and load its weights (strict names).

    embed_weight / lm_head_weight [V, hidden]: the target's; if omitted, the checkpoint's own
    copies (DeepSpec's `embed_tokens.weight` / `lm_head.weight`) are used when present.
    """
    config, tensors = read_checkpoint(folder)
    draft_ids = draft_token_ids_from(tensors, config)
    for name in ("d2t", "t2d"):
        tensors.pop(name, None)
    copies = {name: tensors.pop(name) for name in _TARGET_COPIES if name in tensors}
    model = drafter_class(config)(config)
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{folder}: tensor names do not match a {config.architecture.value} "
                         f"drafter; missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, value in model.state_dict().items():
        if tensors[name].shape != value.shape:
            raise ValueError(f"{folder}: {name} has shape {tuple(tensors[name].shape)}, "
                             f"expected {tuple(value.shape)}")
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    model.to(device=device, dtype=dtype)
    if embed_weight is None:
        embed_weight = copies.get("embed_tokens.weight")
    if lm_head_weight is None:
        lm_head_weight = copies.get("lm_head.weight")
        if lm_head_weight is not None and lm_head_weight.shape[0] != config.vocab_size:
            raise ValueError("the checkpoint's lm_head covers the draft vocabulary only; pass the "
                             "target's lm_head_weight")
    if embed_weight is None or lm_head_weight is None:
        raise ValueError("pass the target's embed_weight and lm_head_weight (the checkpoint has "
                         "no copies of them)")
    model.set_target_weights(embed_weight, lm_head_weight, draft_ids)
    model.eval()
    return model
