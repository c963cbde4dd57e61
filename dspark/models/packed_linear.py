"""oneDNN-packed matrix products for float32 (and, where the CPU has bf16 support, bfloat16)
inference on a CPU.

MKL's sgemm (behind F.linear) is fast for one row or many, but slow for the 2-16 rows a
verification or drafting step multiplies: it costs 2-3x a single row. oneDNN with the weight
reordered once into its blocked layout stays close to the one-row cost. Measured on this 2-core
CPU (AVX2, 2 threads), microseconds per product:

    weight [out, in]       rows:    1     2     4     8    16    64
    576 -> 3072  F.linear         169   340   524   513   707  1703
                 oneDNN packed    128   121   208   254   485  1596
    576 -> 49152 F.linear        8264 18440 19386 18979 19620 39880
                 oneDNN packed   4030  4100  5658  6275  9422 25852

bfloat16 on a CPU with AVX512-BF16 (an AMD EPYC), same shapes:

    576 -> 3072  F.linear bf16      100    98   117   149   210
                 oneDNN packed bf16  48    47    57    87   148
    576 -> 49152 F.linear bf16     3171  3596  3867  4189  5458
                 oneDNN packed bf16 1880  2137  1663  2150  3027

Inference only: the packed products have no autograd. Results differ from F.linear's by float
rounding (another summation order), as any two BLAS kernels do.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["packing_available", "bf16_packing_supported", "pack_weight", "packed_linear",
           "PackedLinear", "pack_linears"]

_LAYOUT_ROWS = 16
"""The blocked layout is chosen for 16-row inputs; it serves 1..64 rows as well as a per-size layout."""


def packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where packed products apply: on a CPU whose PyTorch has oneDNN, float32 always and
    bfloat16 where oneDNN reports bf16 support (AVX512 and newer; an AVX2-only CPU has none, and
    there `Linear`'s float32 upcast is the faster path)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bf16_packing_supported()


def bf16_packing_supported() -> bool:
    """Whether oneDNN runs bfloat16 products natively on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] (float32 or bfloat16) -> an opaque oneDNN tensor (a copy) for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _LAYOUT_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + b -> [..., out] with a weight from `pack_weight`."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])  # [..., out]


class PackedLinear(nn.Module):
    """An nn.Linear for inference with a packed copy of its weight. `weight` and `bias` stay (the
    same Parameters): code that reads them, or a device/dtype from them, keeps working."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
