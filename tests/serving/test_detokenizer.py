"""Incremental detokenization against decoding the whole output at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.serving.detokenizer import IncrementalDetokenizer


def byte_decode(ids) -> str:
    """A byte-level 'tokenizer': each token one UTF-8 byte (multi-byte characters split)."""
    return bytes(ids).decode("utf-8", errors="replace")


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40),
       cuts=st.lists(st.integers(0, 200), max_size=12))
def test_joined_deltas_are_the_whole_decode(text, cuts):
    ids = list(text.encode())
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    detok = IncrementalDetokenizer(byte_decode)
    deltas = [detok.push(ids[a:b], final=(b == len(ids))) for a, b in zip(bounds, bounds[1:])]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # incomplete characters were held back


def test_each_chunk_decodes_a_window_not_the_whole_output():
    windows = []

    def decode(part):
        windows.append(len(part))
        return byte_decode(part)

    detok = IncrementalDetokenizer(decode)
    for _ in range(500):
        detok.push(list(b"ab"))
    assert max(windows) <= 4 and len(detok.token_ids) == 1000


def test_resumed_stream_starts_after_what_was_printed():
    detok = IncrementalDetokenizer(byte_decode, already=list(b"hello "))
    assert detok.push(list(b"world"), final=True) == "world"


SMOLLM2 = Path.home() / ".cache/dspark/models/smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="SmolLM2 not prepared")
def test_smollm2_tokenizer_streams_what_it_decodes():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    text = "Grüße, 世界! Emoji 🎉🧪 and  spaces\nnew line — done."
    ids = tok(text)["input_ids"]

    def decode(part):
        return tok.decode(part, skip_special_tokens=True)

    detok = IncrementalDetokenizer(decode)
    pieces = [detok.push(ids[i:i + 1], final=(i == len(ids) - 1)) for i in range(len(ids))]
    assert "".join(pieces) == decode(ids)
