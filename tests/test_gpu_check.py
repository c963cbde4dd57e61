"""The prepared device check (scripts/gpu_check.py) rehearsed on the CPU with the tiny models:
both runs end to end, every step without an error, the figures written as JSON and a table
stamped with the device and versions."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from .conftest import REPO_ROOT


def test_the_device_check_rehearses_on_the_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--tiny",
         "--prompts", "3", "--max-tokens", "6", "--samples", "64", "--streams", "1,2",
         "--users", "1,2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["environment"]["device"] == "cpu" and results["environment"]["torch"]
    exact = results["(a) exactness"]
    assert all(v == "3/3" for k, v in exact.items() if "/" in str(v)), exact
    assert results["(b) T=1 distribution"]["ok"]
    assert "T=0.0 streams=2 async_topk / target-only" in results["(c) tokens/s"]
    assert "services / embedded" in results["(d) services in process"]["users=1"]
    attention = results["(e) attention backends"]  # rows, or those it had when its time ran out
    assert "error" not in attention, attention
    assert set(attention.get("fastest", {}).values()) <= {"paged", "padded"}, attention
    graphed = results["(f) graphed decode"]
    assert graphed["ok"] and graphed["streams=2 graphed forwards"] > 0, graphed
    drafter = results["(g) graphed drafter round"]
    assert drafter["ok"] and drafter["graphed buckets"] > 0, drafter
    assert drafter["engine fixed:7 streams=2 same tokens"], drafter
    table = (tmp_path / "gpu.md").read_text()
    assert f"torch {results['environment']['torch']}" in table


def test_a_phase_that_swallows_exceptions_still_stops_at_its_budget(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import gpu_check

    def stubborn(deadline):  # as a fallback that catches every Exception while it waits
        while True:
            try:
                time.sleep(0.02)
            except Exception:  # noqa: BLE001
                pass

    results: dict = {}
    start = time.monotonic()
    gpu_check.run_phases(results, [("stubborn", 1.0, stubborn)], tmp_path, 0.3)
    assert time.monotonic() - start < 5
    assert results["stubborn"]["error"].startswith("PhaseBudgetSpent"), results
