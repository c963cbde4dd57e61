"""The target's projection weights as the GGUF file's own blocks, under our module names.

A prepared model folder (`dspark fetch-model`) keeps the GGUF it was dequantised from beside the
safetensors. `read_block_weights` maps its tensors onto our fused layout: q|k|v stacked into
`layers.{i}.self_attn.qkv_proj`, gate|up into `layers.{i}.mlp.gate_up_proj`, `o_proj`,
`down_proj`, and the tied embedding as `lm_head`. Stacking outputs stacks rows of blocks, so
nothing is requantised. llama.cpp's converter interleaves the rows of Llama's q and k projections
(its RoPE pairs adjacent dimensions, transformers' pairs halves); transformers' GGUF loader undoes
that, and so do we, by reordering whole rows of blocks. `check_against_dense` holds the blocks to
the float32 weights the folder's safetensors carry, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dspark.models.config import ModelConfig
from dspark.models.gguf_index import read_gguf_index
from dspark.models.quantized_linear import BlockFormat, BlockWeight, dequantize

__all__ = ["find_gguf", "read_block_weights", "check_against_dense"]

_FORMATS = {"Q4_1": BlockFormat.Q4_1, "Q8_0": BlockFormat.Q8_0}
# our fused module -> its GGUF tensors (outputs stacked in this order), per layer
_LAYER_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def find_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file in a prepared model folder, or None."""
    files = sorted(Path(model_dir).glob("*.gguf"))
    return files[0] if files else None


def _unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order [num_rows] that turns llama.cpp's interleaved q/k rows back into transformers'
    (transformers' `reverse_permute_weights`, applied to whole rows)."""
    return torch.arange(num_rows).view(num_heads, num_rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def read_block_weights(gguf_path: str | Path, config: ModelConfig) -> dict[str, BlockWeight]:
    """Our module name -> its weight as GGUF blocks, for every layer projection and the LM head.
    Raises ValueError where a tensor is missing or not Q4_1 / Q8_0 (the caller keeps float32)."""
    index = read_gguf_index(gguf_path)
    tensors = index.tensors
    arch = str(index.metadata.get("general.architecture", ""))

    def block_weight(name: str) -> BlockWeight:
        if name not in tensors:
            raise ValueError(f"{gguf_path}: no tensor {name}")
        t = tensors[name]
        fmt = _FORMATS.get(t.type_name)
        if fmt is None:
            raise ValueError(f"{gguf_path}: {name} is {t.type_name}, not Q4_1 or Q8_0")
        blocks = torch.from_numpy(np.array(index.rows(name), dtype=np.uint8, order="C"))  # [out, in / 32 * bytes]: a copy
        return BlockWeight(fmt, blocks, int(t.shape[0]))

    def part(layer: int, name: str) -> BlockWeight:
        w = block_weight(f"blk.{layer}.{name}.weight")
        if arch == "llama" and name in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if name == "attn_q" else config.num_key_value_heads
            w = BlockWeight(w.format, w.blocks[_unpermute_rows(w.out_features, heads)], w.in_features)
        return w

    weights = {f"layers.{i}.{module}": BlockWeight.cat([part(i, p) for p in parts])
               for i in range(config.num_hidden_layers) for module, parts in _LAYER_PARTS.items()}
    weights["lm_head"] = block_weight("output.weight" if "output.weight" in tensors else "token_embd.weight")
    return weights


def check_against_dense(weights: dict[str, BlockWeight], dense: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless every block weight dequantises to exactly the dense weight
    [out_features, in_features] of the same name (those that `dense` holds)."""
    for name, w in weights.items():
        if name in dense and not torch.equal(dequantize(w), dense[name].float()):
            raise ValueError(f"the GGUF blocks of {name} are not the folder's float32 weights")
