"""Generation.choose, best_of's pick, against sums written out by hand."""

from __future__ import annotations

import torch

from dspark.logprobs import TokenLogprobs
from services.scheduler.rest_api import Generation, Output


def output(values: list[float]) -> Output:
    logprobs = TokenLogprobs(torch.tensor(values), torch.zeros(len(values), 0, dtype=torch.long),
                             torch.zeros(len(values), 0))
    return Output("", None, [(list(range(len(values))), logprobs)])


def test_best_of_picks_each_prompts_highest_cumulative_logprobs_in_order():
    # two prompts, best_of 3, n 2: sums -3, -1, -2 | -0.5, -4, -0.25
    outputs = [output([-1, -2]), output([-1.0]), output([-0.5, -1.5]),
               output([-0.5]), output([-2, -2]), output([-0.125, -0.125])]
    generation = Generation([None] * 6, [4, 2], samples=3, n=2, echo=[], report_logprobs=False)
    assert generation.choose(outputs) == [1, 2, 5, 3]


def test_without_best_of_every_output_in_order():
    generation = Generation([None] * 4, [4, 2], samples=2, n=2, echo=[], report_logprobs=False)
    assert generation.choose([output([-9.0])] * 4) == [0, 1, 2, 3]
