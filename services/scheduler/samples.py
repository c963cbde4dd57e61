"""The samples of one API request (vLLM's `n` and `best_of`), shared by the REST and gRPC APIs.

Glossary
- *n*: choices returned per prompt; *best_of*: samples generated per prompt (>= n; default n);
- *sample i* of a prompt: its own engine request; with a seed s it samples with seed s + i
  (vLLM's seeding), so it gives what the request with seed s + i sent alone gives;
- the prompt's sample 0 reads the prompt, samples 1.. fork it (`fork_of`, dspark/forks.py):
  a prompt of P tokens sampled k times is read P + (k - 1) tokens instead of k * P;
- with best_of > n, the n samples of each prompt whose counted tokens have the highest cumulative
  log-probability under the target (raw distribution, as `logprobs` reports it) are returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from services.scheduler.gateway import Gateway, GenerationStream, InvalidRequest

MAX_CHOICES = 128
"""Most generations one request may start (prompts x max(n, best_of))."""


@dataclass(frozen=True)
class SampleCounts:
    """How many generations a request starts per prompt, and how many it returns."""

    n: int
    """Choices returned per prompt."""
    best_of: int
    """Generations per prompt (>= n)."""

    @property
    def ranked(self) -> bool:
        """Whether the returned choices are the best n of more (known only at the end)."""
        return self.best_of > self.n


def sample_counts(n: int | None, best_of: int | None) -> SampleCounts:
    """n and best_of (None = absent: n 1, best_of n), in 1..MAX_CHOICES with best_of >= n, else
    InvalidRequest naming the field."""
    for name, value in (("n", n), ("best_of", best_of)):
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise InvalidRequest(f"{name} must be in 1..{MAX_CHOICES}, got {value!r}", param=name)
    n = 1 if n is None else n
    if best_of is not None and best_of < n:
        raise InvalidRequest(f"best_of must be >= n, got best_of {best_of} and n {n}",
                             param="best_of")
    return SampleCounts(n, n if best_of is None else best_of)


def sample_seed(seed: int | None, sample: int) -> int | None:
    """Sample `sample`'s seed: seed + sample, kept a 64-bit signed integer (the proto's and the
    generator's range); None stays None."""
    if seed is None:
        return None
    return (seed + sample + 2**63) % 2**64 - 2**63


def start_samples(gateway: Gateway, prompts: Sequence[list[int]], counts: SampleCounts,
                  sampling: dict[str, Any], kind: str, owner: str) -> list[GenerationStream]:
    """Validate and submit `counts.best_of` generations of each prompt, prompt-major (stream
    `prompt * best_of + sample`). `sampling`: Gateway.spec's keyword arguments, `seed` the
    request's (sample i gets seed + i). A prompt's first sample reads it, the others fork it.
    All are validated before any is submitted; if a later one is refused (a full queue), the
    earlier ones are cancelled. With counts.ranked and no `logprobs` asked, the samples compute
    log-probabilities (logprobs 0) for `best_samples` to rank them by."""
    samples = counts.best_of
    if len(prompts) * samples > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompts x {samples} samples is more than "
                             f"{MAX_CHOICES} generations in one request",
                             param="best_of" if counts.ranked else "n")
    sampling = dict(sampling)
    if counts.ranked and sampling.get("logprobs") is None:
        sampling["logprobs"] = 0  # best_of ranks by the sampled tokens' log-probabilities
    seed = sampling.pop("seed", None)
    specs = [gateway.spec(ids, **sampling, seed=sample_seed(seed, i))
             for ids in prompts for i in range(samples)]
    streams: list[GenerationStream] = []
    try:
        for index, spec in enumerate(specs):
            first = index - index % samples
            fork_of = streams[first].request_id if index > first else None
            streams.append(gateway.start(spec, gateway.new_request_id(kind), owner,
                                         fork_of=fork_of))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


def best_samples(cumulative_logprobs: Sequence[float], counts: SampleCounts) -> list[int]:
    """The streams whose outputs are returned, in choice order (`cumulative_logprobs`: one per
    stream, prompt-major): all of them, or with best_of > n each prompt's n of highest
    cumulative log-probability (ties: the first)."""
    if not counts.ranked:
        return list(range(len(cumulative_logprobs)))
    chosen: list[int] = []
    for first in range(0, len(cumulative_logprobs), counts.best_of):
        group = range(first, first + counts.best_of)
        chosen += sorted(group, key=lambda i: -cumulative_logprobs[i])[:counts.n]
    return chosen
