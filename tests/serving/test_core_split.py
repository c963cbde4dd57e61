"""How `dspark up` and the load test's stacks share the cores between the verifier and the drafter."""

from __future__ import annotations

import os

import pytest

from dspark.serving.core_split import CoreSplit, split_cores, usable_cores


@pytest.mark.parametrize("cores, use_drafter, expected", [
    (1, False, CoreSplit(1, 0)), (2, False, CoreSplit(2, 0)), (16, False, CoreSplit(16, 0)),
    (1, True, CoreSplit(1, 1)), (2, True, CoreSplit(1, 1)), (16, True, CoreSplit(15, 1))])
def test_the_drafter_gets_one_core_and_the_verifier_the_rest(cores, use_drafter, expected):
    assert split_cores(use_drafter, cores) == expected


def test_asked_thread_counts_are_kept_and_the_other_model_takes_what_is_left():
    assert split_cores(True, 8, verifier=3, drafter=2) == CoreSplit(3, 2)
    assert split_cores(True, 8, drafter=3) == CoreSplit(5, 3)
    assert split_cores(True, 8, verifier=2) == CoreSplit(2, 1)
    assert split_cores(False, 8, verifier=3, drafter=2) == CoreSplit(3, 0)


@pytest.mark.parametrize("kwargs", [{"verifier": -1}, {"drafter": -2}, {"cores": 0}])
def test_impossible_counts_are_refused(kwargs):
    with pytest.raises(ValueError):
        split_cores(True, **kwargs)


def test_usable_cores_is_this_process_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert split_cores(False) == CoreSplit(len(os.sched_getaffinity(0)), 0)
