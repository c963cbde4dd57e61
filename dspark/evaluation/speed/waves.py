"""One wave of a row: its prompts submitted together and run to completion, on our engine (the
time breakdown summed from each step's `RoundStats.seconds`) or on transformers `generate`; what
the waves did is added to a `Tally`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from dspark.evaluation.speed.rows import RowKind

if TYPE_CHECKING:
    from dspark.engine import Engine
    from dspark.step_result import StageSeconds

BREAKDOWN_KEYS = ("prefill", "drafter_context", "draft", "admission", "target_forward",
                  "sampling_commit")


@dataclass
class Tally:
    """What one row did on one dataset at one (temperature, concurrency)."""

    tokens: int = 0
    seconds: float = 0.0
    streams: int = 0
    rounds: int = 0
    """Verification rounds summed over requests (engine rows)."""
    drafts_accepted: int = 0
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per BREAKDOWN_KEYS (engine rows), summed over waves."""
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def add_breakdown(self, seconds: dict[str, float]) -> None:
        for k, v in seconds.items():
            self.breakdown[k] = self.breakdown.get(k, 0.0) + v


def truncate_at_stop(tokens: Sequence[int], stops: Sequence[int], max_tokens: int) -> list[int]:
    """Generated tokens up to and including the first stop token, at most max_tokens."""
    out = []
    for t in list(tokens)[:max_tokens]:
        out.append(int(t))
        if t in stops:
            break
    return out


def run_engine_wave(engine: Engine, prompts: Sequence[Sequence[int]], temperature: float,
                    max_tokens: int, stops: Sequence[int], seed: int, tally: Tally | None) -> None:
    """All prompts submitted at once, run to completion; adds to `tally` (None: warm-up)."""
    from dspark.sampling import SamplingParams
    from dspark.step_result import StageSeconds

    assert not engine.has_unfinished()
    seconds_by_stage = StageSeconds()
    start = time.perf_counter()
    requests = [engine.request(engine.add_request(
        p, SamplingParams(temperature=temperature, seed=seed + i), max_tokens, stops))
        for i, p in enumerate(prompts)]
    for result in engine.steps():
        seconds_by_stage.add(result.stats.seconds)
    seconds = time.perf_counter() - start
    if tally is None:
        return
    tally.seconds += seconds
    tally.streams += len(requests)
    tally.add_breakdown(breakdown(seconds_by_stage))
    for r in requests:
        tally.tokens += len(r.output_ids)
        tally.rounds += r.metrics.rounds
        tally.drafts_accepted += r.metrics.drafts_accepted
        tally.outputs.append(list(r.output_ids))


def breakdown(seconds: StageSeconds) -> dict[str, float]:
    """The engine's stage seconds under BREAKDOWN_KEYS."""
    return {"prefill": seconds.prefill, "drafter_context": seconds.drafter_context,
            "draft": seconds.draft, "admission": seconds.admission,
            "target_forward": seconds.verify, "sampling_commit": seconds.verify_call}


def hf_generation_config(temperature: float, max_tokens: int, stops: Sequence[int], pad_id: int,
                         lookup_tokens: int | None, max_ngram: int):
    from transformers import GenerationConfig

    kwargs = dict(max_new_tokens=max_tokens, eos_token_id=list(stops), pad_token_id=pad_id)
    if temperature > 0:  # the full distribution: no top-k / top-p truncation, like our rows
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if lookup_tokens is not None:
        kwargs.update(prompt_lookup_num_tokens=lookup_tokens, max_matching_ngram_size=max_ngram)
    return GenerationConfig(**kwargs)


def hf_generate(model, prompts: Sequence[Sequence[int]], config, pad_id: int) -> list[list[int]]:
    """One batched transformers `generate` (left padding); the generated ids of each prompt."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(model.device),
                             attention_mask=attention_mask.to(model.device),
                             generation_config=config)
    return out[:, width:].tolist()  # [num_prompts, generated]


def run_hf_wave(model, kind: RowKind, prompts: Sequence[Sequence[int]], temperature: float,
                max_tokens: int, stops: Sequence[int], pad_id: int, seed: int, lookup_tokens: int,
                max_ngram: int, tally: Tally | None) -> None:
    config = hf_generation_config(temperature, max_tokens, stops, pad_id,
                                  lookup_tokens if kind is RowKind.HF_PROMPT_LOOKUP else None,
                                  max_ngram)
    start = time.perf_counter()
    torch.manual_seed(seed)
    if kind is RowKind.HF_PROMPT_LOOKUP:  # transformers: assisted decoding is batch-1 only
        outputs = [hf_generate(model, [p], config, pad_id)[0] for p in prompts]
    else:
        outputs = hf_generate(model, prompts, config, pad_id)
    seconds = time.perf_counter() - start
    if tally is None:
        return
    outputs = [truncate_at_stop(o, stops, max_tokens) for o in outputs]
    tally.seconds += seconds
    tally.streams += len(prompts)
    tally.tokens += sum(map(len, outputs))
    tally.outputs += outputs
