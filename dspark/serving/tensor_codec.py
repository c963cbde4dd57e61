"""Tensors on the wire: raw little-endian bytes plus dtype and shape (`dspark.v1.Tensor`).

Never pickle: a message is data, not code. bfloat16 has no numpy dtype, so its bytes travel as
the raw 16-bit words (little-endian) and are reinterpreted on arrival. Decoding checks that the
byte count matches dtype x shape, so a malformed message is a clear error, not a silent reshape.
"""

from __future__ import annotations

import math
import sys

import torch

from dspark.serving.protos import pb

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_LITTLE_ENDIAN = sys.byteorder == "little"


class TensorDecodeError(ValueError):
    """A Tensor message whose dtype, shape and bytes do not agree."""


def encode(tensor: torch.Tensor | None) -> "pb.common.Tensor":
    """Any CPU/GPU tensor of a supported dtype -> message; None -> an empty message (dtype "")."""
    if tensor is None:
        return pb.common.Tensor()
    if tensor.dtype not in _NAMES:
        raise TypeError(f"tensor dtype {tensor.dtype} has no wire encoding")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat
    array = raw.numpy()
    if not _LITTLE_ENDIAN:
        array = array.byteswap()
    return pb.common.Tensor(dtype=_NAMES[tensor.dtype], shape=list(tensor.shape),
                            data=array.tobytes())


def is_empty(message: "pb.common.Tensor") -> bool:
    """True for the message that stands for None."""
    return message.dtype == ""


def decode(message: "pb.common.Tensor") -> torch.Tensor | None:
    """Message -> CPU tensor (a copy, writable); the empty message -> None."""
    if is_empty(message):
        return None
    dtype = _DTYPES.get(message.dtype)
    if dtype is None:
        raise TensorDecodeError(f"unknown tensor dtype {message.dtype!r}")
    shape = [int(s) for s in message.shape]
    if any(s < 0 for s in shape):
        raise TensorDecodeError(f"negative tensor shape {shape}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(message.data) != expected:
        raise TensorDecodeError(f"tensor {message.dtype}{shape} needs {expected} bytes, "
                                f"got {len(message.data)}")
    wire_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(message.data), dtype=wire_dtype) if expected else \
        torch.empty(0, dtype=wire_dtype)
    if not _LITTLE_ENDIAN:
        flat = torch.from_numpy(flat.numpy().byteswap())
    if dtype == torch.bfloat16:
        flat = flat.view(torch.bfloat16)
    return flat.reshape(shape)
