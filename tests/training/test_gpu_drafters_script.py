"""scripts/gpu_drafters.py, the one-call GPU recipe for data and drafters, run on the CPU at tiny
sizes: smoke mode and a full run (data, three drafters, pack) end in files a CPU machine can use."""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_drafters.py"


@pytest.fixture(scope="module")
def tiny_target(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer with a tiny random model of 30 layers (the recipe copies layers 28-29)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, folder / name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=30, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("prompts")
    with open(folder / "math_gsm8k.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"id": f"g{i}", "domain": "math", "source": "gsm8k",
                                "prompt": f"What is {i} plus {i}?"}) + "\n")
    return folder


def run_script(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


SMALL = ("--num-prompts", "6", "--gen-batch", "4", "--max-new-tokens", "6", "--train-batch", "2",
         "--anchors", "4")


def test_smoke_times_every_stage(tiny_target, prompts, tmp_path):
    out = run_script("--smoke", "--tokenizer-dir", str(tiny_target), "--prompts", str(prompts),
                     "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
                     "--smoke-steps", "2", *SMALL, cwd=tmp_path)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["smoke"] and summary["data"]["answers"] == 6
    assert set(summary["step_ms"]) == {"dspark-markov", "dflash", "eagle"}
    assert all(v > 0 for v in summary["step_ms"].values())
    assert "ms per step" in out


def test_full_run_packs_drafters_and_data(tiny_target, prompts, tmp_path):
    from dspark.models.drafter_io import read_checkpoint

    run_script("--target-dir", str(tiny_target), "--tokenizer-dir", str(tiny_target),
               "--prompts", str(prompts), "--work", str(tmp_path / "work"),
               "--out", str(tmp_path / "out"), "--min-steps", "3", "--max-steps", "3", *SMALL,
               cwd=tmp_path)
    parts = sorted((tmp_path / "out").glob("bundle.tar.part*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    with tarfile.open(fileobj=BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        tar.extractall(tmp_path / "got", filter="data")
    runs = tmp_path / "got" / "runs"
    summary = json.loads((runs / "summary.json").read_text())
    assert summary["steps"] == 3 and not any(k.endswith("_error") for k in summary)
    records = [json.loads(line) for line in
               lzma.open(runs / "smollm2_answers_gpu.jsonl.xz", "rt").read().splitlines()]
    assert len(records) == 6 and all(1 <= len(r["answer_ids"]) <= 6 for r in records)
    for name in ("dspark-markov", "dflash", "eagle"):
        log = [json.loads(line) for line in (runs / name / "train_log.jsonl").read_text().splitlines()]
        assert log[-1]["step"] == 3
        config, tensors = read_checkpoint(runs / name)  # the names and config DeepSpec's loader reads
        assert config.num_hidden_layers == (1 if name == "eagle" else 2) and tensors
        assert not (runs / name / "checkpoint").exists()
