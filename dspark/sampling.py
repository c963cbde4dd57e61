"""Sampling parameters and the distribution they define (docs/design.md section 5).

Temperature, top-k and top-p turn the target's logits into the distribution that speculative
decoding must preserve exactly: the verifier accepts and resamples against *this* distribution,
not against the raw softmax. The drafter applies the same function to its own logits, so that the
draft distribution it reports is exactly the one its tokens were drawn from.

Conventions (the same as vLLM's and transformers'):
- temperature 0 means greedy: the distribution is one-hot at the argmax (lowest index on ties);
  so does any temperature below GREEDY_TEMPERATURE (1e-5, vLLM's _SAMPLING_EPS): logits / T
  overflows float32 to inf for T below about 1e-37, and softmax of inf is NaN, while at T = 1e-5
  a logit gap of 0.001 is already a factor e^100, i.e. the argmax anyway;
- top_k 0 (or >= vocab_size) means no top-k filter; tokens whose logit ties the k-th largest are kept;
- top_p 1.0 means no nucleus filter; otherwise the smallest set of most probable tokens whose mass
  reaches top_p is kept (a token is kept if the mass strictly before it is < top_p), never empty;
- min_p 0 means no filter; otherwise tokens whose probability (after temperature) is below min_p
  times the most probable token's are dropped (vLLM's min_p);
- temperature, then min_p, then top-k, then top-p (vLLM's order); the kept mass is renormalised.

The logit-space parameters (logit_bias, min_tokens, repetition / frequency / presence penalties)
depend on the tokens before each position and are applied to the logits before all of this, by
dspark.logits_processing; SamplingParams only carries and validates them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from dspark.random_draws import CounterGenerator

# Temperatures below this are greedy (see the module docstring).
GREEDY_TEMPERATURE = 1e-5
# OpenAI's ranges (vLLM checks the same): |presence_penalty|, |frequency_penalty| <= 2 and a
# logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


def argmax_first(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The index of the first maximum along `dim`: exactly `torch.argmax` (the lowest index on
    ties, a NaN counting as the maximum), through `torch.max`'s reduction, which on a CPU runs
    2.5-4.7x faster than argmax's own (torch 2.13, 2 threads: 64 x 49,152 float32 logits in
    0.9 ms against 2.3-3.0, bf16 in 1.3 ms against 5.9). Every greedy pick goes through here.
    """
    return x.max(dim=dim).indices


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Validated on construction."""

    temperature: float = 1.0
    """Softmax temperature; 0 (or below GREEDY_TEMPERATURE, stored as 0) = greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    seed: int | None = None
    """Seed of the request's random numbers (dspark.random_draws: same seed, same output); None =
    a fresh seed drawn when the request is admitted."""
    min_p: float = 0.0
    """Drop tokens less probable than min_p times the most probable one, in [0, 1]; 0 = off."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """> 0: the logit of a token of the prompt or output is divided by it when positive, else
    multiplied by it; 1 = off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, bias in [-100, 100] added to the token's logit; a mapping is
    accepted and stored as pairs sorted by token id."""
    min_tokens: int = 0
    """No stop token (`stop_token_ids`) is produced before this many output tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """The tokens min_tokens holds back: the request's EOS and stop tokens (the engine fills
    them in from its stop_token_ids when min_tokens > 0)."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                                 f"{getattr(self, name)}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got "
                             f"{self.repetition_penalty}")
        pairs = (self.logit_bias.items() if isinstance(self.logit_bias, Mapping)
                 else self.logit_bias)
        pairs = tuple(sorted((int(t), float(b)) for t, b in pairs))
        for token, bias in pairs:
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token twice")
        object.__setattr__(self, "logit_bias", pairs)
        if int(self.min_tokens) != self.min_tokens or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(sorted({int(t) for t in
                                                                 self.stop_token_ids})))

    @property
    def processes_logits(self) -> bool:
        """Some logit-space parameter is on (dspark.logits_processing applies them): a logit
        bias, min_tokens with stop tokens to hold back, or a penalty."""
        return bool(self.logit_bias or (self.min_tokens and self.stop_token_ids)
                    or self.has_penalties)

    @property
    def has_penalties(self) -> bool:
        """A repetition, frequency or presence penalty is on: the logits depend on the tokens
        of the prompt and output (dspark.logits_processing)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> CounterGenerator:
        """This request's random numbers (dspark.random_draws): keyed by its seed, or by a fresh
        seed drawn now when it has none."""
        return CounterGenerator.for_seed(self.seed)


@dataclass(frozen=True)
class SamplingKinds:
    """What kinds of rows a SamplingTensors may hold, known on the host (from the params), so
    that the transforms choose their branches without reading the device. An upper bound: a
    selection of rows keeps its parent's kinds."""

    greedy: bool
    sampled: bool
    top_k_max: int
    """The largest top_k of a sampled row (0: no row filters by top-k)."""
    top_p: bool
    """Some sampled row has top_p < 1."""
    temperature: float | None
    """The one temperature of every sampled row, None when they differ (or none is sampled)."""
    min_p: bool = False
    """Some sampled row has min_p > 0."""


    @staticmethod
    def of(params: Sequence[SamplingParams]) -> "SamplingKinds":
        sampled = [p for p in params if not p.is_greedy]
        temps = {p.temperature for p in sampled}
        return SamplingKinds(greedy=len(sampled) < len(params), sampled=bool(sampled),
                             top_k_max=max([p.top_k for p in sampled] or [0]),
                             top_p=any(p.top_p < 1.0 for p in sampled),
                             temperature=temps.pop() if len(temps) == 1 else None,
                             min_p=any(p.min_p > 0.0 for p in sampled))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors, for batched transforms. All shapes [num_rows]."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32
    kinds: SamplingKinds | None = None
    """The kinds of rows present, when known on the host (from_params); None: read them from
    the tensors (a device synchronisation per branch on a GPU)."""
    min_p: torch.Tensor | None = None
    """float32, 0 = off; None: every row's min_p is 0."""

    @staticmethod
    def from_params(params: Sequence[SamplingParams],
                    device: torch.device | str = "cpu") -> "SamplingTensors":
        """One row per request (`repeat` gives a request several rows)."""
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = (torch.tensor([p.min_p for p in params], dtype=torch.float32).to(
            device, non_blocking=True) if any(p.min_p > 0.0 for p in params) else None)
        return SamplingTensors(temperature.to(device, non_blocking=True),
                               top_k.to(device, non_blocking=True),
                               top_p.to(device, non_blocking=True), SamplingKinds.of(params),
                               min_p)

    def select(self, rows: torch.Tensor) -> "SamplingTensors":
        """The rows a bool mask or an index tensor picks."""
        return SamplingTensors(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                               self.kinds, None if self.min_p is None else self.min_p[rows])

    def repeat(self, counts: torch.Tensor, total: int | None = None) -> "SamplingTensors":
        """Row r `counts[r]` times in a row: counts [num_rows] -> [counts.sum()] rows (`total`:
        that sum when the caller knows it, which spares a device read)."""
        repeat = lambda t: (None if t is None  # noqa: E731
                            else t.repeat_interleave(counts, output_size=total))
        return SamplingTensors(repeat(self.temperature), repeat(self.top_k),
                               repeat(self.top_p), self.kinds, repeat(self.min_p))

    def filters(self, vocab_size: int) -> torch.Tensor:
        """[num_rows] bool: sampled rows that some filter (top-k, top-p, min_p) truncates."""
        out = (self.temperature != 0.0) & (((self.top_k > 0) & (self.top_k < vocab_size))
                                           | (self.top_p < 1.0))
        return out if self.min_p is None else out | ((self.temperature != 0.0) & (self.min_p > 0))


def probs_from_logits(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """The distribution each row's sampling parameters define.

    logits: [num_rows, vocab_size] (any float dtype) -> probs [num_rows, vocab_size] float32,
    each row summing to 1 (greedy rows one-hot).
    """
    num_rows, vocab_size = logits.shape
    assert sampling.temperature.shape == (num_rows,), (sampling.temperature.shape, num_rows)
    if sampling.kinds is not None:
        return _probs_by_kinds(logits, sampling, sampling.kinds)
    greedy = sampling.temperature == 0.0  # [num_rows]
    probs = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(1)
        probs[rows, argmax_first(logits[rows])] = 1.0
    if bool(greedy.all()):
        return probs
    sampled = ~greedy
    all_sampled = bool(sampled.all())
    sub = logits.float() if all_sampled else logits[sampled].float()  # [n, vocab_size]
    temperature = sampling.temperature if all_sampled else sampling.temperature[sampled]
    top_k = sampling.top_k if all_sampled else sampling.top_k[sampled]
    top_p = sampling.top_p if all_sampled else sampling.top_p[sampled]
    scaled = sub / temperature.unsqueeze(1)  # [n, vocab_size]
    if sampling.min_p is not None:
        scaled = _min_p_filter(scaled, sampling.min_p if all_sampled else sampling.min_p[sampled])

    use_top_k = (top_k > 0) & (top_k < vocab_size)
    if bool(use_top_k.any()):
        k_max = int(top_k[use_top_k].max())
        kth_values = torch.topk(scaled[use_top_k], k_max, dim=1).values  # [m, k_max]
        kth = kth_values.gather(1, (top_k[use_top_k] - 1).unsqueeze(1))  # [m, 1]
        rows = scaled[use_top_k]
        scaled[use_top_k] = rows.masked_fill(rows < kth, float("-inf"))

    sub_probs = torch.softmax(scaled, dim=1)  # [n, vocab_size]
    use_top_p = top_p < 1.0
    if bool(use_top_p.any()):
        sub_probs[use_top_p] = _top_p_filter(sub_probs[use_top_p], top_p[use_top_p])
    if all_sampled:
        return sub_probs
    probs[sampled] = sub_probs
    return probs


def _probs_by_kinds(logits: torch.Tensor, sampling: SamplingTensors,
                    kinds: SamplingKinds) -> torch.Tensor:
    """probs_from_logits with its branches chosen on the host (`kinds`): greedy rows by a
    scatter at the argmax, top-k by one top-k of the widest k over every row, a mix of greedy
    and sampled rows by a select, the nucleus (top_p < 1) by a full sort of every row off the
    CPU: no device read (on the CPU the nucleus search reads which rows it has found)."""
    num_rows, vocab_size = logits.shape
    greedy = sampling.temperature == 0.0  # [num_rows]
    one_hot = None
    if kinds.greedy:
        one_hot = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
        one_hot.scatter_(1, argmax_first(logits, dim=1).unsqueeze(1), 1.0)
        if not kinds.sampled:
            return one_hot
    # Greedy rows are computed at T = 1 and replaced by their one-hot at the end.
    temperature = (sampling.temperature if not kinds.greedy
                   else torch.where(greedy, 1.0, sampling.temperature))
    if kinds.temperature == 1.0 and not kinds.greedy:
        scaled = logits.float().clone()  # [n, V]
    else:
        scaled = logits.float() / temperature.unsqueeze(1)  # [n, V]
    if kinds.min_p and sampling.min_p is not None:
        scaled = _min_p_filter(scaled, sampling.min_p)  # greedy rows are replaced below
    if 0 < kinds.top_k_max:
        top_k = sampling.top_k
        use_top_k = ~greedy & (top_k > 0) & (top_k < vocab_size)  # [n]
        k_max = min(kinds.top_k_max, vocab_size)
        kth_values = torch.topk(scaled, k_max, dim=1).values  # [n, k_max]
        kth = kth_values.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))  # [n, 1]
        scaled = scaled.masked_fill(use_top_k.unsqueeze(1) & (scaled < kth), float("-inf"))
    probs = torch.softmax(scaled, dim=1)  # [n, V]
    if kinds.top_p:
        use_top_p = ~greedy & (sampling.top_p < 1.0)  # [n]
        if probs.device.type != "cpu":  # every row's nucleus, kept where asked: no device read
            probs = torch.where(use_top_p.unsqueeze(1), _top_p_filter_sorted(probs, sampling.top_p),
                                probs)
        elif bool(use_top_p.any()):  # on the CPU the reads are free and the partial sorts cheaper
            probs[use_top_p] = _top_p_filter(probs[use_top_p], sampling.top_p[use_top_p])
    if one_hot is not None:
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def _min_p_filter(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p: tokens whose probability is below min_p times the row's largest set to
    -inf. scaled [n, V] logits after temperature, min_p [n] (0: the row is kept whole) ->
    [n, V]."""
    probs = torch.softmax(scaled, dim=1)  # [n, V]
    floor = min_p.unsqueeze(1) * probs.amax(dim=1, keepdim=True)  # [n, 1]
    return scaled.masked_fill(probs < floor, float("-inf"))


# The nucleus is searched among the most probable tokens by partial sorts of growing width first
# (torch.topk: of 49,152 probabilities, the top 256 cost 1/16 of a full sort and the top 4,096 a
# fifth); only rows whose nucleus is wider than the widest pay for a full sort of the vocabulary.
TOP_P_CANDIDATES = (256, 4096)


def _top_p_filter_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_top_p_filter` by one full sort of every row, without reading the device (what an
    accelerator wants: the partial sorts of growing width need to know which rows are done):
    probs [n, V], top_p [n] -> [n, V]."""
    values, order = torch.sort(probs, dim=1, descending=True)  # [n, V]
    mass_before = torch.cumsum(values, dim=1) - values  # [n, V]
    keep = mass_before < top_p.unsqueeze(1)
    keep[:, 0] = True  # never empty
    kept = values * keep
    kept = kept / kept.sum(dim=1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, kept)


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus and renormalise: probs [n, V], top_p [n] -> [n, V]."""
    if probs.device.type != "cpu":
        return _top_p_filter_sorted(probs, top_p)
    n, vocab_size = probs.shape
    out = torch.zeros_like(probs)
    todo = torch.arange(n, device=probs.device)  # rows whose nucleus is not found yet
    for width in (*TOP_P_CANDIDATES, vocab_size):
        if todo.numel() == 0:
            break
        k = min(width, vocab_size)
        rows = probs[todo]  # [m, V]
        if k == vocab_size:
            values, order = torch.sort(rows, dim=1, descending=True)  # [m, V]
            found = torch.ones(todo.shape[0], dtype=torch.bool, device=probs.device)
        else:
            values, order = torch.topk(rows, k, dim=1)  # [m, k], descending
            # A token outside the candidates has mass_before >= sum(values): dropped when that
            # reaches top_p.
            found = values.sum(dim=1) >= top_p[todo]  # [m]
        if bool(found.any()):
            values, order = values[found], order[found]
            mass_before = torch.cumsum(values, dim=1) - values  # [f, k]
            keep = mass_before < top_p[todo[found]].unsqueeze(1)
            keep[:, 0] = True  # never empty
            kept = values * keep
            kept = kept / kept.sum(dim=1, keepdim=True)
            out[todo[found]] = torch.zeros_like(rows[found]).scatter_(1, order, kept)
        todo = todo[~found]
    return out


def token_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingTensors,
                            rows: torch.Tensor | None = None,
                            row_argmax: torch.Tensor | None = None) -> torch.Tensor:
    """p(token) under each row's sampling distribution, without materialising plain rows.

    logits [num_logit_rows, V]; rows [n] selects the logit row of each token (None: row i for
    token i); tokens [n]; sampling per token [n] -> [n] float32. Equal to
    probs_from_logits(logits[rows], sampling).gather(1, tokens) up to float rounding. Greedy rows
    take an argmax and plain rows a log-sum-exp, both over the whole logits matrix when one kind
    covers every row (no copy of vocabulary-sized rows); top-k / top-p / min_p rows go through
    probs_from_logits. row_argmax [num_logit_rows]: every logit row's argmax, when the caller
    has it already (greedy rows then cost no pass over the logits).
    """
    n = tokens.shape[0]
    if rows is None:
        rows = torch.arange(n, device=logits.device)
    kinds = sampling.kinds
    if kinds is not None and not kinds.sampled:  # every row greedy: no device read
        if row_argmax is None:
            row_argmax = argmax_first(logits, dim=1)  # [num_logit_rows]
        return (row_argmax[rows] == tokens).float()
    if (kinds is not None and not kinds.greedy and kinds.top_k_max == 0 and not kinds.top_p
            and not kinds.min_p and kinds.temperature is not None
            and n * 2 >= logits.shape[0]):
        # One temperature, no filter, most of the matrix: log-normalisers of every row in one
        # pass and the tokens' logits read in place (no copy of vocabulary-sized rows at T = 1).
        t = kinds.temperature
        scaled = logits.float() if t == 1.0 else logits.float() / t  # [num_logit_rows, V]
        lse = torch.logsumexp(scaled, dim=1)  # [num_logit_rows]
        return torch.exp(scaled[rows, tokens] - lse[rows])
    if kinds is not None and logits.device.type != "cpu":
        # Filters, or greedy rows beside sampled ones, on an accelerator: every row's whole
        # distribution, branches chosen by the host's kinds (no device read; on the CPU the
        # per-kind split below is cheaper).
        probs = probs_from_logits(logits.index_select(0, rows), sampling)  # [n, V]
        return probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    greedy = sampling.temperature == 0.0
    filtered = sampling.filters(logits.shape[1])
    plain = ~greedy & ~filtered
    if bool(greedy.any()):
        if row_argmax is None:
            row_argmax = argmax_first(logits, dim=1)  # [num_logit_rows]
        out[greedy] = (row_argmax[rows[greedy]] == tokens[greedy]).float()
    if bool(plain.any()):
        temps = sampling.temperature[plain]
        if bool((temps == temps[0]).all()) and int(plain.sum()) * 2 >= logits.shape[0]:
            # [num_logit_rows, V]: no gather copy, and at T = 1 (x / 1 = x) no copy at all
            scaled = logits.float() if float(temps[0]) == 1.0 else logits.float() / temps[0]
            plain_rows = rows[plain]
        else:
            scaled = logits[rows[plain]].float() / temps.unsqueeze(1)  # [m, V]
            plain_rows = torch.arange(scaled.shape[0], device=logits.device)
        lse = torch.logsumexp(scaled, dim=1)  # [*]
        picked = scaled[plain_rows, tokens[plain]]
        out[plain] = torch.exp(picked - lse[plain_rows])
    if bool(filtered.any()):
        probs = probs_from_logits(logits[rows[filtered]], sampling.select(filtered))
        out[filtered] = probs.gather(1, tokens[filtered].unsqueeze(1)).squeeze(1)
    return out


def probs_at_columns(logits: torch.Tensor, columns: torch.Tensor, sampling: SamplingTensors,
                     rows: torch.Tensor) -> torch.Tensor:
    """p(columns[i, j]) under the sampling distribution of logit row rows[i]: logits
    [num_logit_rows, V], columns [n, k] int64, sampling [n], rows [n] -> [n, k] float32.

    Equal to probs_from_logits(logits[rows], sampling).gather(1, columns) up to float rounding.
    Plain rows read k logits and one log-sum-exp per row (no distribution over V is written
    out); greedy rows are 1 at the argmax; filtered rows (top-k, top-p, min_p) go through
    probs_from_logits.
    """
    n, k = columns.shape
    if sampling.kinds is not None and logits.device.type != "cpu":
        # On an accelerator: every row's whole distribution, branches chosen by the host's kinds
        # (no device read; on the CPU the per-kind split below is cheaper).
        return probs_from_logits(logits.index_select(0, rows), sampling).gather(1, columns)
    out = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    greedy = sampling.temperature == 0.0
    filtered = sampling.filters(logits.shape[1])
    plain = ~greedy & ~filtered
    if bool(greedy.any()):
        argmax = argmax_first(logits[rows[greedy]], dim=1)  # [g]
        out[greedy] = (columns[greedy] == argmax.unsqueeze(1)).float()
    if bool(plain.any()):
        temps = sampling.temperature[plain].unsqueeze(1)  # [p, 1]
        plain_rows = rows[plain]
        if bool((temps == 1.0).all()) and plain_rows.shape[0] * 2 >= logits.shape[0]:
            # T = 1 over most of the matrix: the log-normalisers of every row in one pass and
            # the k columns read in place, no copy of vocabulary-sized rows.
            lse = torch.logsumexp(logits.float(), dim=1)[plain_rows].unsqueeze(1)  # [p, 1]
            if columns.stride(0) == 0:  # the same columns in every row: one column gather
                picked = logits.index_select(1, columns[0])[plain_rows].float()  # [p, k]
            else:
                flat = plain_rows.unsqueeze(1) * logits.shape[1] + columns[plain]  # [p, k]
                picked = logits.reshape(-1).index_select(0, flat.reshape(-1)).view(
                    flat.shape).float()
        else:
            scaled = logits[plain_rows].float() / temps  # [p, V]
            lse = torch.logsumexp(scaled, dim=1, keepdim=True)  # [p, 1]
            picked = scaled.gather(1, columns[plain])
        out[plain] = torch.exp(picked - lse)
    if bool(filtered.any()):
        out[filtered] = probs_from_logits(logits[rows[filtered]], sampling.select(filtered)
                                          ).gather(1, columns[filtered])
    return out


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
    # Rounding can put target at the very top of the cdf (index V) or, with a trailing run of
    # zeros, on a token without mass; such rows fall back to their last token with mass.
    tokens = tokens.clamp_max(vocab_size - 1)
    bad = probs.gather(1, tokens.unsqueeze(1)).squeeze(1) <= 0  # [num_rows]
    if probs.device.type == "cpu":  # reading `bad` costs nothing here; the fix-up is rare
        if bool(bad.any()):
            last_nonzero = vocab_size - 1 - torch.argmax((probs[bad].flip(1) > 0).to(torch.int8),
                                                         dim=1)
            tokens[bad] = last_nonzero
        return tokens
    # On an accelerator, without a device read: every row's last token with mass, selected.
    last_nonzero = vocab_size - 1 - torch.argmax((probs.flip(1) > 0).to(torch.int8), dim=1)
    return torch.where(bad, last_nonzero, tokens)
