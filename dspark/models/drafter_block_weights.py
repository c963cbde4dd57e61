"""The drafter's products on Q8_0 blocks quantised from its own float32 weights (CPU).

The drafter's weights are ours, not the GGUF file's, so nothing obliges them to stay float: every
linear of its layers, its feature fc, its sequential head's W2 and its (draft-vocabulary) LM head
are quantised once at load time to Q8_0 (`quantize_q8_0`: d = max|w| / 127 per 32 weights as
fp16, q = round(w / d)) and multiplied by the target's block kernel (`block_linear`: float32
activations and accumulation). That reads a quarter of the float32 bytes (half of bf16's) each
drafting round. The LM head rows are the target's Q8_0 LM head already, so for it quantising
is lossless (the same blocks); the layers move by at most half a step per weight.

Not the default (`dspark.loading.choose_drafter_weights`): the block kernel's fixed summation
order per output makes it arithmetic-bound beyond one row, and a drafting round multiplies
gamma rows per request through weights that mostly stay in the cache, so fewer bytes do not
buy time there (docs/results/q4_drafter.md).

Drafts stay exact whatever the drafter's weights: each is drawn from the distribution the drafter
reports for it and verified against the target's own logits; the weights only move acceptance,
which docs/results/q4_drafter.md measures against the float32 drafter.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from dspark.models.quantized_linear import BLOCK_WEIGHTS, BlockWeight, block_linear, quantize_q8_0

__all__ = ["DrafterWeights", "BlockLinear", "use_block_weights", "block_weights_fit"]


class DrafterWeights(enum.Enum):
    """How the drafter's linear weights are held."""

    Q8 = "q8"
    """Q8_0 blocks quantised from the float32 checkpoint, float32 activations (`use_block_weights`);
    a CPU with the block kernel, the drafter in float32."""
    DENSE = "dense"
    """The drafter's dtype tensors (`dspark.loading.drafter_dtype`), oneDNN-packed on a CPU."""


class BlockLinear(nn.Module):
    """An nn.Linear for inference whose product reads Q8_0 blocks of its weight. `weight` and
    `bias` stay (the same Parameters): code that reads a device or dtype from them keeps working."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.blocks: BlockWeight = quantize_q8_0(linear.weight)  # [out, in / 32 * 34] uint8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] float32 -> [..., out_features] float32."""
        return block_linear(x, self.blocks, self.bias)


def _linears(module: nn.Module):
    """(parent, attribute name, linear) for every nn.Linear under `module`."""
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            yield module, name, child
        else:
            yield from _linears(child)


def block_weights_fit(drafter: nn.Module) -> bool:
    """Whether the drafter's LM head and its largest linears take 32-weight blocks (hidden size a
    multiple of 32): the drafters we train on SmolLM2 (hidden 576) do."""
    return drafter.lm_head_weight.shape[-1] % BLOCK_WEIGHTS == 0


def use_block_weights(drafter: nn.Module) -> int:
    """Multiply with Q8_0 blocks from now on: every linear whose in_features is a multiple of 32
    (a BlockLinear in its place; any other stays a float32 nn.Linear) and the LM head
    (`FrozenTargetHead.lm_head_blocks`). Inference only; call after `set_target_weights`,
    instead of `pack_for_inference`. Returns the number of linears replaced."""
    drafter._check_ready()
    if getattr(drafter, "packed_lm_head", None) is not None:
        raise ValueError("the drafter is packed already (pack_for_inference): its fused packed "
                         "products would take precedence over the blocks")
    if drafter.lm_head_weight.dtype != torch.float32 or drafter.lm_head_weight.device.type != "cpu":
        raise ValueError("Q8_0 drafter weights need the drafter in float32 on a CPU")
    if not block_weights_fit(drafter):
        raise ValueError(f"Q8_0 drafter weights need a hidden size that is a multiple of {BLOCK_WEIGHTS}")
    count = 0
    for parent, name, linear in list(_linears(drafter)):
        if linear.in_features % BLOCK_WEIGHTS == 0:
            setattr(parent, name, BlockLinear(linear))
            count += 1
    drafter.lm_head_blocks = quantize_q8_0(drafter.lm_head_weight)  # [V_d, hidden / 32 * 34]
    return count
