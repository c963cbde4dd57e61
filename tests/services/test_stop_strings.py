"""StopStrings over every way of cutting a text into chunks equals cutting the whole text at the
first stop string (the obviously-correct reference)."""

from __future__ import annotations

import random

from services.scheduler.stop_strings import StopStrings


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def streamed(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher, out = StopStrings(stops), ""
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out += text
        if stopped:
            return out, True
    return out + matcher.flush(), False


def test_random_chunkings_match_the_reference():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(0, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(chunks, stops) == reference(text, stops), (chunks, stops)


def test_nothing_after_a_stop_string_is_sent_even_inside_its_chunk():
    assert streamed(["hello wor", "ld. And more"], ["world"]) == ("hello ", True)
    assert streamed(["abc"], []) == ("abc", False)
