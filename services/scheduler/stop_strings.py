"""OpenAI's `stop` strings over streamed text: the output ends before the first one it contains.

A stop string can straddle two chunks, so the last (longest stop string - 1) characters are held
back until the next chunk shows they do not begin one; nothing after a stop string is ever sent.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        """Characters that could be the start of a stop string completed by the next chunk."""
        self._pending = ""
        self.stop_end = 0
        """Once `feed` found a stop string: how many characters of the text fed last reach to
        its end (the stop string ends in that text: it was not complete before)."""

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text that can be sent now, whether a stop string ended the output)."""
        held = len(self._pending)
        self._pending += text
        hits = [(i, i + len(s)) for i, s in ((self._pending.find(s), s) for s in self.stops)
                if i >= 0]
        if hits:
            start, end = min(hits)
            out, self._pending = self._pending[:start], ""
            self.stop_end = end - held
            return out, True
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back text, once the output ended without a stop string."""
        out, self._pending = self._pending, ""
        return out
