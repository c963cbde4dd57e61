"""OpenAI's `stop` strings over streamed text: the output ends before the first one it contains.

A stop string can straddle two chunks, so the last (longest stop string - 1) characters are held
back until the next chunk shows they do not begin one; nothing after a stop string is ever sent.

min_tokens (vLLM's semantics, vllm/v1/engine/detokenizer.py): no stop string ends the output
within the text of its first min_tokens tokens. A stop string counts only where it ends after
that text (`protected` characters); one that begins inside it and ends after it counts.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        """Characters that could be the start of a stop string completed by the next chunk."""
        self._pending = ""
        self._sent = 0
        """Characters returned by `feed` so far: the output text position of _pending[0]."""
        self.stop_end = 0
        """Once `feed` found a stop string: how many characters of the text fed last reach to
        its end (the stop string ends in that text: it was not complete before)."""

    def feed(self, text: str, protected: int | None = 0) -> tuple[str, bool]:
        """(the text that can be sent now, whether a stop string ended the output).
        `protected`: the output's first characters in which no stop string may end (the text
        of its first min_tokens tokens); None: all the text fed so far (the output has not
        passed min_tokens tokens yet)."""
        held = len(self._pending)
        self._pending += text
        if protected is None:
            protected = self._sent + len(self._pending)
        hits = []
        for s in self.stops:  # the first occurrence ending past the protected characters
            i = self._pending.find(s, max(0, protected - self._sent - len(s) + 1))
            if i >= 0:
                hits.append((i, i + len(s)))
        if hits:
            start, end = min(hits)
            out, self._pending = self._pending[:start], ""
            self._sent += len(out)
            self.stop_end = end - held
            return out, True
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self._sent += len(out)
        return out, False

    def flush(self) -> str:
        """The held-back text, once the output ended without a stop string."""
        out, self._pending = self._pending, ""
        self._sent += len(out)
        return out
