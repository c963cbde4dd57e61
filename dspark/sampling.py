"""Sampling parameters and the distribution they define (DESIGN.md section 5).

Temperature, top-k and top-p turn the target's logits into the distribution that speculative
decoding must preserve exactly: the verifier accepts and resamples against *this* distribution,
not against the raw softmax. The drafter applies the same function to its own logits, so that the
draft distribution it reports is exactly the one its tokens were drawn from.

Conventions (the same as vLLM's and transformers'):
- temperature 0 means greedy: the distribution is one-hot at the argmax (lowest index on ties);
- top_k 0 (or >= vocab_size) means no top-k filter; tokens whose logit ties the k-th largest are kept;
- top_p 1.0 means no nucleus filter; otherwise the smallest set of most probable tokens whose mass
  reaches top_p is kept (a token is kept if the mass strictly before it is < top_p), never empty;
- top-k is applied before top-p, both after temperature; the kept mass is renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Validated on construction."""

    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    seed: int | None = None
    """Seed of the request's own random stream (same seed, same output); None = shared stream."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A fresh generator for this request's random stream, or None when unseeded."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(int(self.seed))
        return g


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors, for batched transforms. All shapes [num_rows]."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32

    @staticmethod
    def from_params(params: Sequence[SamplingParams], repeats: torch.Tensor | None = None,
                    device: torch.device | str = "cpu") -> "SamplingTensors":
        """One row per request, or `repeats[r]` rows for request r (repeats: [num_requests])."""
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        if repeats is not None:
            repeats = repeats.cpu()
            temperature = temperature.repeat_interleave(repeats)
            top_k = top_k.repeat_interleave(repeats)
            top_p = top_p.repeat_interleave(repeats)
        return SamplingTensors(temperature.to(device), top_k.to(device), top_p.to(device))


def probs_from_logits(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """The distribution each row's sampling parameters define.

    logits: [num_rows, vocab_size] (any float dtype) -> probs [num_rows, vocab_size] float32,
    each row summing to 1 (greedy rows one-hot).
    """
    num_rows, vocab_size = logits.shape
    assert sampling.temperature.shape == (num_rows,), (sampling.temperature.shape, num_rows)
    logits = logits.float()
    greedy = sampling.temperature == 0.0  # [num_rows]
    # Greedy rows get temperature 1 here and are overwritten with one-hot below.
    temperature = torch.where(greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    scaled = logits / temperature.unsqueeze(1)  # [num_rows, vocab_size]

    top_k = sampling.top_k
    use_top_k = (top_k > 0) & (top_k < vocab_size) & ~greedy
    if bool(use_top_k.any()):
        k_max = int(top_k[use_top_k].max())
        kth_values = torch.topk(scaled[use_top_k], k_max, dim=1).values  # [n, k_max]
        kth = kth_values.gather(1, (top_k[use_top_k] - 1).unsqueeze(1))  # [n, 1]
        rows = scaled[use_top_k]
        scaled[use_top_k] = rows.masked_fill(rows < kth, float("-inf"))

    probs = torch.softmax(scaled, dim=1)  # [num_rows, vocab_size]

    use_top_p = (sampling.top_p < 1.0) & ~greedy
    if bool(use_top_p.any()):
        rows = probs[use_top_p]  # [n, vocab_size]
        sorted_probs, order = torch.sort(rows, dim=1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=1) - sorted_probs  # [n, vocab_size]
        drop_sorted = mass_before >= sampling.top_p[use_top_p].unsqueeze(1)
        drop_sorted[:, 0] = False  # never empty
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        rows = rows.masked_fill(drop, 0.0)
        probs[use_top_p] = rows / rows.sum(dim=1, keepdim=True)

    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs[greedy])
        one_hot.scatter_(1, logits[greedy].argmax(dim=1, keepdim=True), 1.0)
        probs[greedy] = one_hot
    return probs


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row from probs [num_rows, V] with uniform [num_rows] in [0, 1).

    Rows need not be normalised (the CDF is scaled by the row sum). A token of probability zero is
    never returned. Returns token ids [num_rows] int64.
    """
    num_rows, vocab_size = probs.shape
    assert uniform.shape == (num_rows,), (uniform.shape, num_rows)
    cdf = torch.cumsum(probs.float(), dim=1)  # [num_rows, V]
    target = (uniform.float() * cdf[:, -1]).unsqueeze(1)  # [num_rows, 1]
    # right=True: first index whose cdf is > target, so zero-probability tokens (flat cdf) are skipped.
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [num_rows]
    # Rounding can put target at the very top of the cdf; fall back to the last token with mass.
    last_nonzero = vocab_size - 1 - torch.argmax((probs.flip(1) > 0).to(torch.int8), dim=1)
    return torch.minimum(tokens, last_nonzero)
