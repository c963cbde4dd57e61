"""OpenAI's `logprobs` objects from the target's log-probabilities (dspark.logprobs.TokenLogprobs).

- chat completions: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}`, top_logprobs the k most probable tokens at that position;
- completions (legacy): `{tokens, token_logprobs, top_logprobs, text_offset}`, each
  top_logprobs entry a dict token -> logprob of the k most probable tokens plus the produced one
  (so up to k + 1 entries, as OpenAI and vLLM do), text_offset the character offset of each
  token in the completion text (continuing across streamed chunks).

A token's string is the tokenizer's decoding of that one token (vLLM's choice), special tokens
included; `bytes` are its exact UTF-8 bytes where the tokenizer is byte-level (GPT-2 style BPE:
a token may be part of a character), else its string's UTF-8. Log-probabilities below
LOGPROB_FLOOR (-inf has no JSON form) are reported as LOGPROB_FLOOR, as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
from typing import Callable

from dspark.logprobs import TokenLogprobs
from services.scheduler.openai_models import (ChatLogprobs, ChatTokenLogprob,
                                              CompletionLogprobs, TopLogprob)

LOGPROB_FLOOR = -9999.0


def _byte_level_alphabet() -> dict[str, int] | None:
    """GPT-2's printable stand-in character -> byte, from transformers."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        return None
    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenStrings:
    """Token id -> (string, UTF-8 bytes), computed once per id.

    `piece(token_id) -> (the token decoded alone, its vocabulary entry)` (Gateway.token_piece)."""

    def __init__(self, tokenizer, piece: Callable[[int], tuple[str, str]]) -> None:
        self._piece = piece
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_level = self._alphabet_if_byte_level(tokenizer)

    @staticmethod
    def _alphabet_if_byte_level(tokenizer) -> dict[str, int] | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        return _byte_level_alphabet() if decoder.get("type") == "ByteLevel" else None

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self._cache.get(token_id)
        if known is not None:
            return known
        text, piece = self._piece(token_id)
        data = list(text.encode("utf-8"))
        if self._byte_level is not None and isinstance(piece, str) and piece and all(
                c in self._byte_level for c in piece):
            data = [self._byte_level[c] for c in piece]
        self._cache[token_id] = (text, data)
        return text, data


def _floor(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(logprobs: TokenLogprobs, token_ids: list[int],
                  strings: Callable[[int], tuple[str, list[int]]]) -> ChatLogprobs:
    content = []
    for token_id, value, top_ids, top_values in zip(
            token_ids, logprobs.token_logprobs.tolist(), logprobs.top_token_ids.tolist(),
            logprobs.top_logprobs.tolist()):
        text, data = strings(token_id)
        top = []
        for alt_id, alt_value in zip(top_ids, top_values):
            alt_text, alt_data = strings(alt_id)
            top.append(TopLogprob(token=alt_text, logprob=_floor(alt_value), bytes=alt_data))
        content.append(ChatTokenLogprob(token=text, logprob=_floor(value), bytes=data,
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(logprobs: TokenLogprobs, token_ids: list[int],
                        strings: Callable[[int], tuple[str, list[int]]],
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """The object for these tokens and the text offset after them (the next chunk's start)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, value, top_ids, top_values in zip(
            token_ids, logprobs.token_logprobs.tolist(), logprobs.top_token_ids.tolist(),
            logprobs.top_logprobs.tolist()):
        text, _ = strings(token_id)
        tokens.append(text)
        values.append(_floor(value))
        top = {strings(alt_id)[0]: _floor(alt_value)
               for alt_id, alt_value in zip(top_ids, top_values)}
        top.setdefault(text, _floor(value))  # the produced token is always there
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops,
                              text_offset=offsets), text_offset
