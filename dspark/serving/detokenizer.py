"""Incremental detokenization for streaming: each chunk decodes a short window, not the whole
output.

Decoding every streamed chunk's whole output again costs O(n) per chunk (O(n^2) per request),
under the tokenizer's one global lock. The window here is the approach of Hugging Face TGI and
vLLM: keep two offsets into the token list, `prefix` (where the last decoded window started) and
`read` (how far text was emitted). Decode tokens[prefix:read] and tokens[prefix:]; the new text
is what the second adds to the first. Decoding from `prefix` rather than `read` gives the
tokenizer the context it needs for word boundaries (a leading space, a byte-fallback piece). An
incomplete UTF-8 character decodes to U+FFFD; it is held back until completed (or the request
ends).
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"
# A resumed stream decodes its first window from this many earlier tokens (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET), so that its first text has its word boundary.
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], already: Sequence[int] = ()) -> None:
        """`decode(token_ids) -> text`; `already`: tokens whose text was produced before."""
        self._decode = decode
        self.token_ids = list(already)
        self._prefix = max(0, len(self.token_ids) - INITIAL_CONTEXT_TOKENS)
        self._read = len(self.token_ids)

    def push(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """The text the new tokens add (empty while an incomplete character is held back)."""
        self.token_ids += new_token_ids
        if self._read == len(self.token_ids):
            return ""
        before = self._decode(self.token_ids[self._prefix:self._read])
        after = self._decode(self.token_ids[self._prefix:])
        if len(after) <= len(before) and not final:
            return ""  # the new tokens decode to nothing yet (e.g. a special token skipped)
        if after.endswith(REPLACEMENT_CHARACTER) and not final:
            return ""
        self._prefix, self._read = self._read, len(self.token_ids)
        return after[len(before):]
