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

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text that can be sent now, whether a stop string ended the output)."""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._pending = self._pending[:min(hits)], ""
            return out, True
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back text, once the output ended without a stop string."""
        out, self._pending = self._pending, ""
        return out
