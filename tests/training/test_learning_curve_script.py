"""scripts/learning_curve.py: a CSV row per held-out point, and `--chain` joining runs that continue
one another into one curve."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "learning_curve.py"


def point(step: int, blocks: int, sequences: int, tau: float) -> dict:
    return {"step": step, "anchor_blocks_seen": blocks, "sequences_seen": sequences,
            "train_answer_tokens": 1000, "tau_greedy": tau, "tau_t1": tau - 0.1,
            "accept_greedy": [0.5, 0.4], "accept_t1": [0.4, 0.3]}


def write_run(folder: Path, points: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "heldout_log.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    return folder


def run_script(*args: str) -> list[dict]:
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True)
    return list(csv.DictReader(open(args[args.index("--csv") + 1])))


def test_chained_runs_add_up_steps_and_blocks_and_drop_the_repeated_start(tmp_path):
    first = write_run(tmp_path / "phase4", [point(0, 0, 0, 1.7), point(100, 512, 4, 1.9)])
    second = write_run(tmp_path / "phase5", [point(0, 0, 0, 1.9), point(50, 256, 2, 2.1)])
    out = tmp_path / "curve.csv"
    rows = run_script(str(first), str(second), "--chain", "--csv", str(out))
    assert [(r["run"], int(r["step"]), int(r["anchor_blocks_seen"]), int(r["sequences_seen"]),
             float(r["tau_greedy"])) for r in rows] == [
        ("phase4+phase5", 0, 0, 0, 1.7), ("phase4+phase5", 100, 512, 4, 1.9),
        ("phase4+phase5", 150, 768, 6, 2.1)]
    assert rows[-1]["accept_t1_k2"] == "0.3"
    # without --chain: one curve per run, each as logged
    rows = run_script(str(first), str(second), "--csv", str(out))
    assert [(r["run"], int(r["step"])) for r in rows] == [
        ("phase4", 0), ("phase4", 100), ("phase5", 0), ("phase5", 50)]


def test_a_log_file_is_a_run_labelled_by_its_phase(tmp_path):
    """A shipped drafter keeps its earlier phases' logs beside its own: files chain with folders."""
    shipped = write_run(tmp_path / "dspark-markov", [point(0, 0, 0, 1.9), point(50, 256, 2, 2.1)])
    earlier = shipped / "heldout_log_phase4.jsonl"
    earlier.write_text("".join(json.dumps(p) + "\n" for p in [point(0, 0, 0, 1.7),
                                                                 point(100, 512, 4, 1.9)]))
    rows = run_script(str(earlier), str(shipped), "--chain", "--csv", str(tmp_path / "c.csv"))
    assert [(r["run"], int(r["step"]), float(r["tau_greedy"])) for r in rows] == [
        ("phase4+dspark-markov", 0, 1.7), ("phase4+dspark-markov", 100, 1.9),
        ("phase4+dspark-markov", 150, 2.1)]
