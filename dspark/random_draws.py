"""Counter-based random numbers: every uniform a request consumes is a function of a key, never of
how many numbers were drawn before it.

Why: under speculation, how many drafts a round verifies may change from one run to the next
(timing, the batch around a request), and with a sequential generator (torch.Generator) every
draw after such a round would shift, so a seeded request would not repeat. Here each uniform is
Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
generator behind cuRAND and JAX) of a counter that names what it is for:

    key     = the request's 64-bit seed (CounterGenerator.seed)
    counter = (offset, position low 32 bits, position high 32 bits, purpose)

Purposes (`Purpose`) and their keys, for a round whose anchor x0 sits at position n (docs/design.md
section 5; the anchor is the last token produced, the KV cache holds n tokens before it):
- DRAFT  (n, k): the drafter's uniform for x_k, k = 1..gamma (inverse-CDF sampling);
- ACCEPT (n, k): the accept test of x_k, k = 1..l_r;
- NEXT   (n, 0): the recovered or bonus token of the round; the first token after a prompt of P
  tokens uses (P - 1, 0), its "anchor" being the prompt's last token;
- GUMBEL (p, v): Gumbel noise of token v at absolute output position p, shared by drafter and
  target under the drafter-invariant rule (dspark.gumbel_verification).

The token and block rules key their uniforms by the round's anchor, not by the position the
token lands at: anchors strictly increase from round to round, so every round draws fresh
numbers, whatever the previous rounds looked at (a round's verdict reveals something about the
numbers it compared, e.g. the block rule's failed tests past its cut; reusing them at the same
positions in the next round would bias it). The same request with the same seed still draws the
same numbers for the same rounds, so it repeats whenever its rounds repeat (dspark.seeded_admission
makes a seeded request's rounds depend on its own prefix only).

Uniforms are the top 23 bits of a 32-bit word mapped to the odd multiples of 2^-24, exactly
representable in float32 and strictly inside (0, 1). Everything is int64 tensor arithmetic
(products of two 32-bit words wrap modulo 2^64 and keep their low 64 bits, which is all the
mul-hi/lo needs), so it runs on any device, vectorised, with no per-token Python loop.

`draw_uniforms` draws one verification round's ACCEPT and NEXT uniforms for a whole batch
(`RandomDraws`, what dspark.rejection.verify consumes).

Unseeded requests get a fresh seed when they are admitted (`fresh_seed`, from torch's global
stream), so seeded and unseeded requests take the one path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch

MASK32 = 0xFFFFFFFF
PHILOX_ROUNDS = 10
# Philox-4x32 multipliers and Weyl key increments (Random123).
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
# murmur3's 32-bit finaliser constants (for the per-token Gumbel words of one row).
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN32 = 0x9E3779B1


class Purpose(enum.IntEnum):
    """What a uniform is for: the fourth counter word, so no two purposes share a number."""

    DRAFT = 1
    ACCEPT = 2
    NEXT = 3
    GUMBEL = 4


@dataclass(frozen=True)
class CounterGenerator:
    """A request's random numbers: a seed, the key of every uniform it draws (`Purpose`)."""

    seed: int
    """Any integer; its low 64 bits are the Philox key."""
    seeded: bool = True
    """The request asked for this seed (False: drawn at admission by `fresh_seed`). Seeded
    requests are the ones whose rounds must repeat (dspark.seeded_admission)."""
    shared_noise: bool = False
    """Draft by Gumbel-max with the position-keyed noise the target samples with (GUMBEL), as
    the drafter-invariant rule needs (dspark.gumbel_verification); else inverse-CDF sampling
    with the DRAFT uniforms."""

    @staticmethod
    def for_seed(seed: int | None) -> "CounterGenerator":
        """The request's generator: its own seed, or a fresh one when it has none."""
        if seed is None:
            return CounterGenerator(fresh_seed(), seeded=False)
        return CounterGenerator(int(seed), seeded=True)

    @staticmethod
    def resolve(generator: "CounterGenerator | None", seed: int | None) -> "CounterGenerator":
        """A caller's generator, or (None: a caller that made none) one for `seed`."""
        return generator if generator is not None else CounterGenerator.for_seed(seed)


def fresh_seed() -> int:
    """A 62-bit seed from torch's global stream (torch.manual_seed makes unseeded runs
    reproducible in tests, as before)."""
    return int(torch.randint(0, 2 ** 62, (1,)))


def seed_tensor(generators: Sequence[CounterGenerator], device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    """[n] int64: each generator's seed reduced to 64 bits (two's complement)."""
    seeds = [g.seed & 0xFFFFFFFFFFFFFFFF for g in generators]
    return torch.tensor([s - (1 << 64) if s >= (1 << 63) else s for s in seeds],
                        dtype=torch.int64, device=device)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for a 32-bit constant a and words b [n] (int64)."""
    product = b * a  # wraps modulo 2^64: its 64 bits are the unsigned product's
    return (product >> 32) & MASK32, product & MASK32


def philox4x32(counter: torch.Tensor, key: torch.Tensor, rounds: int = PHILOX_ROUNDS
               ) -> torch.Tensor:
    """Philox-4x32-R: counter [n, 4], key [n, 2] (int64 holding 32-bit words) -> [n, 4] words."""
    assert counter.dim() == 2 and counter.shape[1] == 4, counter.shape
    assert key.shape == (counter.shape[0], 2), (key.shape, counter.shape)
    c0, c1, c2, c3 = (counter[:, i] & MASK32 for i in range(4))
    k0, k1 = key[:, 0] & MASK32, key[:, 1] & MASK32
    for r in range(rounds):
        if r:
            k0 = (k0 + _PHILOX_W0) & MASK32
            k1 = (k1 + _PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack([c0, c1, c2, c3], dim=1)


def unit_floats(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (int64, any shape) -> float32 uniforms on the odd multiples of 2^-24, in (0, 1)."""
    return ((words >> 9) * 2 + 1).float() * (2.0 ** -24)


def _counters(seeds: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor,
              purpose: Purpose | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Philox inputs for n keys: seeds, positions, offsets [n] int64 and one purpose or [n]
    int64 purposes -> counter [n, 4], key [n, 2]."""
    purposes = purpose if isinstance(purpose, torch.Tensor) else torch.full_like(offsets, int(purpose))
    counter = torch.stack([offsets & MASK32, positions & MASK32, (positions >> 32) & MASK32,
                           purposes], dim=1)
    key = torch.stack([seeds & MASK32, (seeds >> 32) & MASK32], dim=1)
    return counter, key


HOST_PHILOX_MAX_KEYS = 64
"""Up to this many keys on the host, `keyed_uniforms` runs Philox on Python integers
(`_philox_first_word`: ~10 us a key) instead of as torch operators (~0.25 ms a call whatever the
number of keys, ten rounds of small operators): a verification round draws one key per draft
and one per request. The same words, so the same uniforms (tests/test_random_draws.py)."""


def keyed_uniforms(seeds: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor,
                   purpose: Purpose | torch.Tensor) -> torch.Tensor:
    """One uniform per key: seeds, positions, offsets [n] int64 (one device) and one purpose or
    [n] int64 purposes -> [n] float32 in (0, 1), a function of (seed, position, offset, purpose)
    alone."""
    assert seeds.shape == positions.shape == offsets.shape, (seeds.shape, positions.shape,
                                                             offsets.shape)
    if seeds.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=seeds.device)
    if seeds.device.type == "cpu" and seeds.numel() <= HOST_PHILOX_MAX_KEYS:
        purposes = (purpose.tolist() if isinstance(purpose, torch.Tensor)
                    else [int(purpose)] * seeds.numel())
        words = [_philox_first_word(*key) for key in zip(seeds.tolist(), positions.tolist(), offsets.tolist(),
                                                         purposes)]
        return torch.tensor([((w >> 9) * 2 + 1) * 2.0 ** -24 for w in words], dtype=torch.float32)
    counter, key = _counters(seeds, positions, offsets, purpose)
    return unit_floats(philox4x32(counter, key)[:, 0])


def _philox_first_word(seed: int, position: int, offset: int, purpose: int) -> int:
    """Word 0 of Philox-4x32-10 at `_counters`' counter and key for one key (`philox4x32`'s
    arithmetic on Python integers: seed and position as int64, their 32-bit halves)."""
    c0, c1, c2, c3 = offset & MASK32, position & MASK32, (position >> 32) & MASK32, purpose & MASK32
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for r in range(PHILOX_ROUNDS):
        if r:
            k0 = (k0 + _PHILOX_W0) & MASK32
            k1 = (k1 + _PHILOX_W1) & MASK32
        p0, p1 = _PHILOX_M0 * c0, _PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser: a bijection of 32-bit words (int64 holding them)."""
    h = h ^ (h >> 16)
    h = (h * _FMIX_C1) & MASK32
    h = h ^ (h >> 13)
    h = (h * _FMIX_C2) & MASK32
    return h ^ (h >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
                 ) -> torch.Tensor:
    """Standard Gumbel noise G(seed, p, v) for each row's tokens: seeds, positions [n] int64,
    token_ids [n, k] int64 (target-vocabulary ids) -> [n, k] float32.

    Philox gives each (seed, position) row a 64-bit key (one call per row); token v's word is
    fmix32(fmix32(v * golden + key_lo) ^ key_hi), a bijection of v within the row, so the noise
    of a whole vocabulary row costs a dozen element-wise operations instead of Philox's ten
    rounds. The same (seed, p, v) gives the same noise whichever rows or columns are asked for:
    the drafter reads it at its own support, the target at the whole vocabulary.
    """
    n = seeds.shape[0]
    assert positions.shape == (n,) and token_ids.dim() == 2 and token_ids.shape[0] == n, (
        seeds.shape, positions.shape, token_ids.shape)
    counter, key = _counters(seeds, positions, torch.zeros_like(positions), Purpose.GUMBEL)
    row = philox4x32(counter, key)  # [n, 4]
    h = (token_ids * _GOLDEN32 + row[:, 0:1]) & MASK32  # [n, k]
    h = _fmix32(_fmix32(h) ^ row[:, 1:2])
    return -torch.log(-torch.log(unit_floats(h)))


@dataclass
class RandomDraws:
    """The uniforms one verification consumes."""

    accept_uniform: torch.Tensor  # [num_drafts] in [0, 1)
    sample_uniform: torch.Tensor  # [num_requests] in [0, 1)
    seeds: torch.Tensor | None = None  # [num_requests] int64 keys (seed_tensor)
    anchor_positions: torch.Tensor | None = None  # [num_requests] int64, n_r of each request

    def to(self, device: torch.device | str) -> "RandomDraws":
        """The same draws on `device` (drawn on the host, used where the logits are)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return RandomDraws(move(self.accept_uniform), move(self.sample_uniform),
                           move(self.seeds), move(self.anchor_positions))


def draw_uniforms(draft_lens: torch.Tensor,
                  generators: CounterGenerator | Sequence[CounterGenerator],
                  anchor_positions: torch.Tensor | Sequence[int],
                  greedy: bool = False) -> RandomDraws:
    """The uniforms of one verification round, keyed (dspark.random_draws): request r's accept
    uniforms are ACCEPT (n_r, k) for k = 1..l_r and its recovered/bonus uniform NEXT (n_r, 0),
    where n_r is its anchor's position, under its generator's seed. They depend on nothing
    else: not on the batch around the request, nor on what it drew before. Both kinds come from
    one Philox call over all the round's keys (each key's word is its own: the same bits as a
    call per kind).

    draft_lens [num_requests]; generators: one per request, or one for all (then the anchor
    positions must tell the requests apart); anchor_positions [num_requests].

    `greedy`: every request of the round is greedy, so no uniform is read (a greedy draft is
    accepted iff it is the argmax, u * p_draft < p_target with p_target 0 or 1 for any u in
    [0, 1), and the next token is the argmax): the uniforms are zeros and Philox is not run.
    """
    num_requests = draft_lens.shape[0]
    if isinstance(generators, CounterGenerator):
        generators = [generators] * num_requests
    if len(generators) != num_requests:
        raise ValueError(f"{len(generators)} generators for {num_requests} requests")
    device = draft_lens.device
    seeds = seed_tensor(generators, device)  # [num_requests]
    anchors = torch.as_tensor(anchor_positions, dtype=torch.int64, device=device)
    assert anchors.shape == (num_requests,), (anchors.shape, num_requests)
    num_drafts = int(draft_lens.sum())
    if greedy:
        return RandomDraws(torch.zeros(num_drafts, device=device), torch.zeros(num_requests, device=device),
                           seeds, anchors)
    req_of_draft = torch.repeat_interleave(torch.arange(num_requests, device=device), draft_lens,
                                           output_size=num_drafts)  # [num_drafts]
    first_draft = torch.cumsum(draft_lens, 0) - draft_lens  # [num_requests]
    k = torch.arange(num_drafts, device=device) - first_draft[req_of_draft] + 1  # [num_drafts]
    purposes = torch.cat([torch.full_like(k, int(Purpose.ACCEPT)), torch.full_like(anchors, int(Purpose.NEXT))])
    both = keyed_uniforms(torch.cat([seeds[req_of_draft], seeds]), torch.cat([anchors[req_of_draft], anchors]),
                          torch.cat([k, torch.zeros_like(anchors)]), purposes)  # [num_drafts + num_requests]
    return RandomDraws(both[:num_drafts], both[num_drafts:], seeds, anchors)
