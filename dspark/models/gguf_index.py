"""A GGUF file's tensor index and scalar metadata, read without parsing its arrays.

`gguf.GGUFReader` builds a numpy view for every part of every metadata field; for a chat model's
vocabulary (49,152 tokens and 48,900 merges as arrays of strings) that took about 4 s of every
q4 runner's start-up on a Zen 4, while the tensors the runner needs are a few hundred records
after those arrays. This reader walks the metadata once, keeping scalars and strings and stepping
over arrays (string arrays by their length prefixes), then reads the tensor records: name, shape
(GGUF order: the fastest dimension first), ggml type and the absolute offset of the data.

Format (GGUF v2 and v3, little-endian): "GGUF", uint32 version, uint64 tensor count, uint64
metadata count; each metadata entry a string key, a uint32 value type and the value; each tensor
record a string name, uint32 dimension count, uint64 dimensions, uint32 ggml type, uint64 offset
from the data section, which starts at the next multiple of `general.alignment` (default 32).
Strings are a uint64 byte length and the bytes.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

__all__ = ["GGML_TYPES", "GgufTensor", "GgufIndex", "read_gguf_index"]

GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 30: "BF16"}
"""ggml type id -> name, for the types whose bytes per row this module knows."""

_BLOCK = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20),
          "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34)}
"""type name -> (weights per block, bytes per block)."""

# metadata value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]
    """GGUF order: shape[0] is the fastest dimension (a weight's in_features)."""
    type_name: str
    offset: int
    """Absolute byte offset of the data in the file."""

    def row_bytes(self) -> int:
        per_block, nbytes = _BLOCK[self.type_name]
        if self.shape[0] % per_block:
            raise ValueError(f"{self.name}: {self.shape[0]} is not a whole number of {self.type_name} blocks")
        return self.shape[0] // per_block * nbytes

    def num_rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1


@dataclasses.dataclass(frozen=True)
class GgufIndex:
    path: Path
    version: int
    metadata: dict[str, object]
    """Scalar and string metadata; arrays are skipped (absent)."""
    tensors: dict[str, GgufTensor]

    def rows(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as [rows, row bytes] uint8 (a read-only map of the file)."""
        t = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset,
                         shape=(t.num_rows(), t.row_bytes()))


class _Cursor:
    def __init__(self, data) -> None:  # bytes or an mmap
        self.data, self.pos = data, 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.data[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        data, pos, end = self.data, self.pos, len(self.data)
        for _ in range(count):
            if pos + 8 > end:  # a damaged count would otherwise step past the end for ever
                raise ValueError("GGUF metadata runs past the end of the file")
            pos += 8 + int.from_bytes(data[pos:pos + 8], "little")
        self.pos = pos

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type == _STRING:
                self.skip_strings(count)
            elif item_type in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item_type])
            else:  # arrays of arrays: walk them
                for _ in range(count):
                    self.value(item_type)
            return None
        raise ValueError(f"unknown GGUF metadata value type {vtype}")


def read_gguf_index(path: str | Path) -> GgufIndex:
    """The tensor index and scalar metadata of the GGUF file at `path`."""
    path = Path(path)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _parse(path, data)
        except struct.error as e:  # a record runs past the end of the file
            raise ValueError(f"{path}: truncated or damaged GGUF ({e})") from e


def _parse(path: Path, data) -> GgufIndex:
    cur = _Cursor(data)
    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (2 or 3 expected)")
    n_tensors, n_meta = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, object] = {}
    for _ in range(n_meta):
        key = cur.string()
        value = cur.value(cur.unpack("<I"))
        if value is not None:
            metadata[key] = value
    records = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        type_id, offset = cur.unpack("<I"), cur.unpack("<Q")
        records.append((name, dims, type_id, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = {name: GgufTensor(name, dims, GGML_TYPES.get(type_id, f"type{type_id}"), data_start + offset)
               for name, dims, type_id, offset in records}
    return GgufIndex(path, version, metadata, tensors)
