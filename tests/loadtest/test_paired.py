"""`bench/loadtest_paired.py`: two policies' stacks (tiny random models, real service processes)
under the same Locust load at the same time, and the ratio of their throughputs per repeat."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from dspark.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "bench" / "loadtest_paired.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_paired_runs_both_stacks_at_once_and_reports_the_ratio(tmp_path):
    done = run("--tiny", "--policies", "async_topk,none", "--users", "2", "--duration-s", "3",
               "--repeats", "2", "--max-tokens", "16", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    with (tmp_path / "paired.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["repeat"]) for r in rows] == [1, 2]
    for r in rows:
        assert (r["a_policy"], r["b_policy"]) == ("async_topk", "none")
        a, b = float(r["a_aggregate_tokens_per_s"]), float(r["b_aggregate_tokens_per_s"])
        assert a > 0 and b > 0 and int(r["a_responses"]) >= 1 and int(r["b_responses"]) >= 1
        assert float(r["ratio_a_over_b"]) == pytest.approx(a / b, rel=1e-3)
        assert float(r["b_verification_length"]) == 0 and float(r["b_draft_share"]) == 0
        # engine ms per round by stage, from each scheduler's /metrics
        assert float(r["a_verify_ms_per_round"]) > 0 and float(r["b_verify_ms_per_round"]) > 0
        assert float(r.get("b_draft_ms_per_round") or 0) == 0
    assert any(float(r["a_verification_length"]) > 0 for r in rows)
    # the two runs of a repeat overlap in time (Locust's per-second history of each)
    spans = {}
    for policy in ("async_topk", "none"):
        with (tmp_path / "locust" / f"{policy}_r1_stats_history.csv").open() as f:
            stamps = [int(row["Timestamp"]) for row in csv.DictReader(f)]
        spans[policy] = (min(stamps), max(stamps))
    (a0, a1), (b0, b1) = spans["async_topk"], spans["none"]
    assert min(a1, b1) - max(a0, b0) >= 1, spans  # one after the other: no second shared
    assert "ratio async_topk / none: median" in done.stdout
    assert "| ms per round | async_topk | none |" in done.stdout and "| verify |" in done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["ratios"] == [round(float(r["ratio_a_over_b"]), 4) for r in rows]


@pytest.mark.parametrize("args, message", [
    (("--policies", "none"), "two different policies"),
    (("--policies", "none,none"), "two different policies"),
    (("--users", "1,2"), "one level"),
    (("--repeats", "0"), "--repeats >= 1"),
])
def test_paired_refuses_bad_arguments(args, message):
    done = run("--tiny", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
