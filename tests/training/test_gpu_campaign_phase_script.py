"""scripts/gpu_campaign_phase.py, the campaign's phase on a GPU, run on the CPU at tiny sizes: it
continues a drafter, sizes its schedule from timed steps, and packs a drafter folder with the
learning curve that scripts/ship_campaign_drafter.sh ships."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_campaign_phase.py"
sys.path.insert(0, str(REPO / "scripts"))

from gpu_drafters import synthetic_data  # noqa: E402


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, save_tiny_llama) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary (the 8,192-token draft vocabulary fits)."""
    folder = tmp_path_factory.mktemp("tiny_target")
    save_tiny_llama(folder, vocab_size=49152, num_hidden_layers=8)
    return folder


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("answers") / "answers.jsonl"
    synthetic_data(path, 40, 49152)  # every 10th is held out
    return path


@pytest.fixture(scope="module")
def start_drafter(tiny_target, answers, tmp_path_factory) -> Path:
    """A drafter of the campaign's configuration after one step: what the phase continues."""
    from dspark.training.train_cli import config_from_args, configure
    from dspark.training.trainer import Trainer

    out = tmp_path_factory.mktemp("start")
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args([
        "--data", str(answers), "--target", str(tiny_target), "--out", str(out),
        "--method", "markov", "--layers", "2", "--markov-rank", "64", "--gamma", "7",
        "--draft-vocab", "8192", "--inject-last-context", "--output-norm-lr-scale", "30",
        "--steps", "1", "--batch", "2", "--anchors", "4", "--device", "cpu", "--no-progress"])
    Trainer(config_from_args(args)).run()
    return out


def test_phase_continues_the_drafter_and_packs_it(tiny_target, answers, start_drafter, tmp_path):
    from dspark.models.drafter_io import read_checkpoint

    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--target-dir", str(tiny_target),
         "--tokenizer-dir", str(tiny_target), "--data", str(answers),
         "--init-from-drafter", str(start_drafter), "--work", str(tmp_path / "work"),
         "--out", str(tmp_path / "out"), "--budget-s", "600", "--batch", "2", "--anchors", "4",
         "--seed", "3", "--evals", "2", "--timing-steps", "2", "--max-steps", "9"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["planned_steps"] == 9 and summary["steps"] == 9  # the budget is not what binds
    parts = sorted((tmp_path / "out").glob("drafter.tar.part*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    with tarfile.open(fileobj=BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        tar.extractall(tmp_path / "got", filter="data")
    folder = tmp_path / "got" / "dspark-markov"
    heldout = [json.loads(ln) for ln in (folder / "heldout_log.jsonl").read_text().splitlines()]
    # the start, then --evals spread over the steps after the 3 + 2 timed ones
    assert [r["step"] for r in heldout] == [0, 7, 9]
    assert heldout[-1]["anchor_blocks_seen"] == 9 * 2 * 4
    train_log = [json.loads(ln) for ln in (folder / "train_log.jsonl").read_text().splitlines()]
    assert train_log[-1]["step"] == 9
    train_config = json.loads((folder / "train_config.json").read_text())
    assert train_config["steps"] == 9 and train_config["seed"] == 3
    assert train_config["init_from_drafter"] == str(start_drafter)
    config, tensors = read_checkpoint(folder)
    start_config, start_tensors = read_checkpoint(start_drafter)
    # the same drafter; only where its target copy lies and the saved dtype differ
    unrelated = {"_name_or_path": None, "dtype": None}
    assert {**config.to_json_dict(), **unrelated} == {**start_config.to_json_dict(), **unrelated}
    assert all(t.dtype == torch.bfloat16 for t in tensors.values() if t.is_floating_point())
    assert torch.equal(tensors["d2t"], start_tensors["d2t"])  # the draft vocabulary is kept
    moved = [name for name, t in tensors.items() if t.is_floating_point()
             and not torch.equal(t, start_tensors[name].to(torch.bfloat16))]
    assert moved, "training changed no weight"
