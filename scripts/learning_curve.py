"""The drafters' learning curves: held-out acceptance against anchor-blocks seen, as CSV and PNG.

Reads the `heldout_log.jsonl` that `dspark train --eval-every N` writes in each run folder and
writes one CSV row per point (method, step, anchor-blocks seen, tau and acceptance per position,
greedy and T=1) and a PNG with tau (greedy and T=1) against anchor-blocks seen, one line per run.
    .venv/bin/python scripts/learning_curve.py runs/campaign/dspark-markov [more run folders] \
        --csv docs/results/drafter_learning_curve.csv --png docs/results/drafter_learning_curve.png
A run is a folder holding heldout_log.jsonl (its name is the label) or such a log file itself (its
stem is the label: a shipped drafter keeps its earlier phases' logs as heldout_log_phaseN.jsonl):
    .venv/bin/python scripts/learning_curve.py checkpoints/dspark-markov/heldout_log_phase*.jsonl \
        checkpoints/dspark-markov --chain --csv ... --png ...
With `--chain` the runs continue one another (each started from
the drafter the one before ended with, e.g. a campaign's phases): their steps and anchor blocks
add up along one curve, and each later run's first point (the drafter it started from, already the
previous run's last) is dropped.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path


def read_points(run: Path) -> list[dict]:
    log = run if run.is_file() else run / "heldout_log.jsonl"
    lines = log.read_text().splitlines()
    return [json.loads(ln) for ln in lines if ln.strip()]


def label(run: Path) -> str:
    """A folder's name, or a log file's stem without its `heldout_log_` prefix."""
    return run.stem.removeprefix("heldout_log_") if run.is_file() else run.name


def chain(runs: list[list[dict]]) -> list[dict]:
    """One curve from runs that continue one another: a later run's steps and anchor blocks are
    offset by the end of the one before, and its first point (the same drafter) is dropped."""
    out = list(runs[0])
    for points in runs[1:]:
        step0, blocks0, seqs0 = (out[-1][k] for k in ("step", "anchor_blocks_seen", "sequences_seen"))
        for p in points:
            if p["step"] == 0:
                continue
            out.append({**p, "step": step0 + p["step"],
                        "anchor_blocks_seen": blocks0 + p["anchor_blocks_seen"],
                        "sequences_seen": seqs0 + p["sequences_seen"]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--chain", action="store_true",
                        help="the runs continue one another: one curve, steps and blocks added up")
    args = parser.parse_args()
    curves = {label(run): read_points(run) for run in args.runs}
    if args.chain:
        curves = {"+".join(curves): chain(list(curves.values()))}
    gamma = max(len(p["accept_t1"]) for points in curves.values() for p in points)
    fields = ["run", "step", "anchor_blocks_seen", "sequences_seen", "train_answer_tokens",
              "tau_greedy", "tau_t1"] + [f"accept_greedy_k{k}" for k in range(1, gamma + 1)] \
        + [f"accept_t1_k{k}" for k in range(1, gamma + 1)]
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for name, points in curves.items():
            for p in points:
                row = {k: p.get(k) for k in fields if k in p}
                row["run"] = name
                for k in range(gamma):
                    row[f"accept_greedy_k{k + 1}"] = p["accept_greedy"][k]
                    row[f"accept_t1_k{k + 1}"] = p["accept_t1"][k]
                writer.writerow(row)
    if args.png is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, points in curves.items():
            x = [p["anchor_blocks_seen"] for p in points]
            ax.plot(x, [p["tau_greedy"] for p in points], marker="o", label=f"{name}, greedy")
            ax.plot(x, [p["tau_t1"] for p in points], marker="s", ls="--", label=f"{name}, T=1")
        ax.set_xlabel("anchor blocks seen")
        ax.set_ylabel("held-out tau (teacher-forced, full block)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
    print(json.dumps({name: points[-1] for name, points in curves.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
