"""How `dspark up` and the load test's stacks share the cores between the verifier and the drafter."""

from __future__ import annotations

import os

import pytest

from dspark.serving.core_split import CoreSplit, scheduler_cohorts, split_cores, usable_cores


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_models_that_take_turns_each_get_every_core(cores):
    assert split_cores(False, cores=cores) == CoreSplit(cores, 0)
    assert split_cores(True, cohorts=1, cores=cores) == CoreSplit(cores, cores)


@pytest.mark.parametrize("cores, expected", [(1, CoreSplit(1, 1)), (2, CoreSplit(1, 1)),
                                             (16, CoreSplit(15, 1))])
def test_overlapped_cohorts_give_the_drafter_one_core_and_the_verifier_the_rest(cores, expected):
    assert split_cores(True, cohorts=2, cores=cores) == expected
    assert split_cores(False, cohorts=2, cores=cores) == CoreSplit(cores, 0)


def test_asked_thread_counts_are_kept_and_the_other_model_takes_what_is_left():
    assert split_cores(True, 2, 8, verifier=3, drafter=2) == CoreSplit(3, 2)
    assert split_cores(True, 2, 8, drafter=3) == CoreSplit(5, 3)
    assert split_cores(True, 2, 8, verifier=2) == CoreSplit(2, 1)
    assert split_cores(True, 1, 8, verifier=2) == CoreSplit(2, 8)
    assert split_cores(False, 1, 8, verifier=3, drafter=2) == CoreSplit(3, 0)


@pytest.mark.parametrize("kwargs", [{"verifier": -1}, {"drafter": -2}, {"cores": 0}])
def test_impossible_counts_are_refused(kwargs):
    with pytest.raises(ValueError):
        split_cores(True, **kwargs)


def test_usable_cores_is_this_process_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert split_cores(False) == CoreSplit(len(os.sched_getaffinity(0)), 0)


def test_scheduler_cohorts_come_from_its_flags_then_its_environment(monkeypatch):
    monkeypatch.delenv("DSPARK_SCHEDULER_COHORTS", raising=False)
    assert scheduler_cohorts([]) == 1
    assert scheduler_cohorts(["--min-gain", "1.2", "--cohorts", "3"]) == 3
    assert scheduler_cohorts(["--cohorts=2", "--policy", "none"]) == 2
    monkeypatch.setenv("DSPARK_SCHEDULER_COHORTS", "4")
    assert scheduler_cohorts(["--min-gain", "1.2"]) == 4
    assert scheduler_cohorts(["--cohorts", "2"]) == 2


def test_the_package_never_imports_the_services():
    """dspark is the layer under services/: no module of it imports from services (the
    scheduler's flags, which core_split reads, live in dspark.serving.config)."""
    import ast
    from pathlib import Path

    import dspark

    upward = []
    for path in Path(dspark.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            upward += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "services"]
    assert not upward
