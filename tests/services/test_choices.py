"""best_of's pick (samples.best_samples, REST's Generation.choose) against sums written out by
hand; the validation of n and best_of and the seeds of the samples (services.scheduler.samples)."""

from __future__ import annotations

import pytest
import torch

from dspark.logprobs import TokenLogprobs
from services.scheduler.gateway import InvalidRequest
from services.scheduler.rest_api import Generation, Output
from services.scheduler.samples import SampleCounts, best_samples, sample_counts, sample_seed


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


def test_best_samples_ranks_each_prompt_alone():
    # best_of 2, n 1, three prompts: sums -1, -0.5 | -2, -3 | -4, -4 (a tie: the first)
    assert best_samples([-1, -0.5, -2, -3, -4, -4], SampleCounts(n=1, best_of=2)) == [1, 2, 4]


@pytest.mark.parametrize("n,best_of,expected", [
    (None, None, SampleCounts(1, 1)), (3, None, SampleCounts(3, 3)),
    (None, 4, SampleCounts(1, 4)), (2, 2, SampleCounts(2, 2)), (128, 128, SampleCounts(128, 128)),
])
def test_sample_counts_defaults(n, best_of, expected):
    assert sample_counts(n, best_of) == expected


@pytest.mark.parametrize("n,best_of,param,words", [
    (0, None, "n", "n must be in 1..128, got 0"), (129, None, "n", "n must be in 1..128"),
    (None, 0, "best_of", "best_of must be in 1..128, got 0"),
    (3, 2, "best_of", "best_of must be >= n, got best_of 2 and n 3"),
])
def test_sample_counts_refused(n, best_of, param, words):
    with pytest.raises(InvalidRequest) as e:
        sample_counts(n, best_of)
    assert e.value.param == param and words in e.value.message and e.value.status == 400


def test_sample_seeds_are_seed_plus_i_within_int64():
    assert [sample_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert sample_seed(None, 2) is None
    assert sample_seed(2**63 - 1, 1) == -2**63  # wraps as the generator's 64 bits do
