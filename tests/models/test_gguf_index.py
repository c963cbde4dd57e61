"""The GGUF tensor index against the `gguf` package's own reader: the same tensors (names, shapes,
types, data offsets, bytes) and scalar metadata, on files written by `gguf.GGUFWriter` with
string arrays, number arrays, another alignment and every block format the q4 runner reads."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from dspark.models.gguf_index import read_gguf_index


def write_gguf(path, alignment: int | None, rng: np.random.Generator) -> None:
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("general.name", "tiny ünïcode")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5) for i in range(300)])  # strings of 0.. bytes
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(50)])
    w.add_bool("general.flag", True)
    w.add_uint64("general.big", 1 << 40)
    # block tensors as raw bytes [rows, row bytes] (what the runner reads), and a float32 one
    w.add_tensor("blk.0.attn_q.weight", rng.integers(0, 256, (8, 2 * 20), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q4_1)
    w.add_tensor("output.weight", rng.integers(0, 256, (5, 3 * 34), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("blk.0.ffn_down.weight", rng.integers(0, 256, (3, 7, 20), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q4_1)  # three dimensions
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_index_matches_the_gguf_reader(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, alignment, np.random.default_rng(0))
    ref = GGUFReader(str(path))
    index = read_gguf_index(path)
    assert set(index.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        ours = index.tensors[t.name]
        assert ours.shape == tuple(int(d) for d in t.shape), t.name
        assert ours.type_name == t.tensor_type.name, t.name
        assert ours.offset == int(t.data_offset), t.name
        rows = index.rows(t.name)
        assert rows.tobytes() == np.asarray(t.data).tobytes(), t.name
    assert index.metadata["general.architecture"] == "llama"
    assert index.metadata["general.name"] == "tiny ünïcode"
    assert index.metadata["llama.block_count"] == 3
    assert index.metadata["general.big"] == 1 << 40
    assert index.metadata["general.flag"] is True
    assert "tokenizer.ggml.tokens" not in index.metadata  # arrays are stepped over
    if alignment is not None:
        assert index.metadata["general.alignment"] == alignment
        assert all(t.offset % alignment == 0 for t in index.tensors.values())


def test_block_rows_shape(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, None, np.random.default_rng(1))
    index = read_gguf_index(path)
    assert index.rows("blk.0.attn_q.weight").shape == (8, 40)  # 64 inputs = 2 Q4_1 blocks a row
    assert index.rows("output.weight").shape == (5, 102)
    assert index.rows("blk.0.ffn_down.weight").shape == (21, 20)
    assert index.tensors["blk.0.attn_q.weight"].shape == (64, 8)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_index(path)


def test_damaged_array_count_is_an_error(tmp_path):
    """A string array whose count runs past the end of the file raises (it does not step on
    through the count), and so does a file cut inside its vocabulary."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, None, np.random.default_rng(2))
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4  # past the value type and the item type
    assert int.from_bytes(data[at:at + 8], "little") == 300
    data[at:at + 8] = (1 << 62).to_bytes(8, "little")
    (tmp_path / "damaged.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="past the end"):
        read_gguf_index(tmp_path / "damaged.gguf")
    cut = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(cut[:cut.index(b"tok2tok2") + 4])
    with pytest.raises((ValueError, struct.error)):
        read_gguf_index(tmp_path / "cut.gguf")
