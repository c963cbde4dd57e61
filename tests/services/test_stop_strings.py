"""StopStrings over every way of cutting a text into chunks equals cutting the whole text at the
first stop string (the obviously-correct reference)."""

from __future__ import annotations

import random

from services.scheduler.stop_strings import StopStrings


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def streamed(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    return streamed_tokens(chunks, stops, 0, [1] * len(chunks))


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


def reference_min_tokens(tokens: list[str], stops: list[str], min_tokens: int
                         ) -> tuple[str, bool]:
    """vLLM's rule by brute force: the earliest stop string that ends after the text of the
    first min_tokens tokens (it may begin inside it); the output is cut where it begins."""
    text, protected = "".join(tokens), len("".join(tokens[:min_tokens]))
    for start in range(len(text)):
        if any(s and text.startswith(s, start) and start + len(s) > protected for s in stops):
            return text[:start], True
    return text, False


def streamed_tokens(tokens: list[str], stops: list[str], min_tokens: int,
                    per_chunk: list[int]) -> tuple[str, bool]:
    """Token texts fed in chunks of per_chunk tokens, `protected` as GenerationStream gives it."""
    matcher, out, fed = StopStrings(stops), "", 0
    for size in per_chunk:
        chunk, fed = tokens[fed:fed + size], fed + size
        protected = (None if fed <= min_tokens
                     else len("".join(tokens[:min_tokens])) if min_tokens else 0)
        text, stopped = matcher.feed("".join(chunk), protected)
        out += text
        if stopped:
            return out, True
    return out + matcher.flush(), False


def test_no_stop_string_ends_within_the_first_min_tokens_tokens():
    rng = random.Random(1)
    for _ in range(3000):
        tokens = ["".join(rng.choice("ab c") for _ in range(rng.randint(0, 3)))
                  for _ in range(rng.randint(0, 12))]
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(0, 3))]
        min_tokens = rng.randint(0, 8)
        per_chunk, left = [], len(tokens)
        while left:
            per_chunk.append(min(left, rng.randint(1, 4)))
            left -= per_chunk[-1]
        assert (streamed_tokens(tokens, stops, min_tokens, per_chunk)
                == reference_min_tokens(tokens, stops, min_tokens)), (tokens, stops, min_tokens)


def test_min_tokens_examples():
    # "stop" inside the first 2 tokens is skipped; the next one counts.
    assert streamed_tokens(["a stop", " b", " stop c"], ["stop"], 2, [1, 1, 1]) == (
        "a stop b ", True)
    # One that begins in the protected text and ends after it counts (vLLM: it ends in the
    # new text).
    assert streamed_tokens(["x st", "op y"], ["stop"], 1, [2]) == ("x ", True)
