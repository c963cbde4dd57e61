"""A short soak (loadtest/soak.py runs ten minutes): Locust at twice the stack's capacity while
the drafter, the verifier and Redis are killed and restarted; every request either completed
with exactly its greedy reference or was refused (429/503), and no client waited past its
timeout."""

from __future__ import annotations

from loadtest.soak import SoakSettings, run


def test_short_soak_loses_nothing(tmp_path):
    summary = run(SoakSettings(seconds=36, max_running=2, max_waiting=2, max_tokens=16,
                               timeout_seconds=90, work=tmp_path))
    counts = summary["counts"]
    assert summary["faults"] == ["drafter", "verifier", "redis"]
    assert counts.get("completed", 0) >= 5, counts
    assert set(counts) <= {"completed", "refused 429", "refused 503"}, summary["bad"]
