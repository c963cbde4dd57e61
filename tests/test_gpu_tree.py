"""The device tree (scripts/gpu_tree.py) on a small git repository: `slim` sets aside every
tracked file outside the device paths with git status clean, `restore` puts back the same bytes
and clears only its own skip-worktree marks; both repeat as no-ops, finish a half-done run, and
stop on a path found in both places."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gpu_tree  # noqa: E402

FILES = {"README.md": b"front page\n", "dspark/engine.py": b"x = 1\n",
         "scripts/gpu_check.py": b"print()\n", "checkpoints/d/model.safetensors": b"\1" * 5000,
         "data/answers/a.jsonl": b"{}\n" * 700, "docs/gpu.md": b"# gpu\n",
         "tests/test_x.py": b"def test(): pass\n"}
AWAY = {"checkpoints/d/model.safetensors", "data/answers/a.jsonl", "docs/gpu.md",
        "tests/test_x.py"}


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q")
    for rel, data in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    (tmp_path / ".gitignore").write_text("/.gpu/\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "files")
    return tmp_path


def skip_marked(repo) -> set[str]:
    return {line[2:] for line in git(repo, "ls-files", "-v").splitlines() if line[0] == "S"}


def test_slim_sets_aside_all_but_the_device_paths_and_restore_puts_them_back(repo):
    before = gpu_tree.travel_bytes(repo)
    assert before["tracked"] == sum(map(len, FILES.values())) + len("/.gpu/\n")
    assert gpu_tree.travel_bytes(repo, slim=True)["tracked"] == before["tracked"] - sum(
        len(FILES[r]) for r in AWAY)

    out = gpu_tree.slim(repo)
    assert out["set_aside"] == len(AWAY)
    assert out["bytes"] == gpu_tree.travel_bytes(repo, slim=True)
    assert not any((repo / r).exists() for r in AWAY)
    assert all((repo / r).read_bytes() == d for r, d in FILES.items() if r not in AWAY)
    assert git(repo, "status", "--porcelain") == ""
    assert skip_marked(repo) == AWAY
    assert not (repo / "data").exists()  # emptied folders go too
    assert gpu_tree.slim(repo)["set_aside"] == 0  # again: nothing to do

    out = gpu_tree.restore(repo)
    assert out["restored"] == len(AWAY)
    assert all((repo / r).read_bytes() == d for r, d in FILES.items())
    assert git(repo, "status", "--porcelain") == "" and skip_marked(repo) == set()
    assert not (repo / ".gpu" / "aside").exists()
    assert gpu_tree.restore(repo)["restored"] == 0  # again: nothing to do


def test_a_half_done_slim_finishes_and_foreign_marks_stay(repo):
    git(repo, "update-index", "--skip-worktree", "README.md")  # someone else's mark
    gpu_tree.slim(repo)
    # A slim stopped half-way: one file back in the tree, still marked.
    (repo / "docs").mkdir()
    (repo / ".gpu/aside/docs/gpu.md").rename(repo / "docs/gpu.md")
    assert gpu_tree.slim(repo)["set_aside"] == 1
    gpu_tree.restore(repo)
    assert all((repo / r).read_bytes() == d for r, d in FILES.items())
    assert skip_marked(repo) == {"README.md"}


def test_a_path_in_both_places_stops_slim_and_restore(repo):
    gpu_tree.slim(repo)
    (repo / "docs").mkdir()
    (repo / "docs/gpu.md").write_bytes(b"edited while set aside\n")
    with pytest.raises(gpu_tree.TreeError, match="docs/gpu.md"):
        gpu_tree.restore(repo)
    with pytest.raises(gpu_tree.TreeError, match="docs/gpu.md"):
        gpu_tree.slim(repo)
    assert (repo / "docs/gpu.md").read_bytes() == b"edited while set aside\n"
    assert (repo / ".gpu/aside/docs/gpu.md").read_bytes() == FILES["docs/gpu.md"]


def test_bytes_counts_untracked_files_and_carried_paths(repo):
    (repo / "notes.txt").write_bytes(b"n" * 300)  # untracked, not ignored: it travels
    (repo / ".gpu" / "part1").mkdir(parents=True)
    (repo / ".gpu" / "part1" / "chunk").write_bytes(b"c" * 1000)  # ignored: only when carried
    plain = gpu_tree.travel_bytes(repo, slim=True)
    carried = gpu_tree.travel_bytes(repo, (repo / ".gpu" / "part1",), slim=True)
    assert plain["untracked"] == 300 and plain["carry"] == 0
    assert carried["total"] == plain["total"] + 1000
