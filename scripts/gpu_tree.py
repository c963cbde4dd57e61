"""The device tree: the checkout cut down to what the prepared device check runs on a GPU machine.

The device tool copies the checkout the session started in (tracked files present in the working
tree, untracked files git does not ignore, `shared/` inside it, and the ignored paths a call
names in `carry`) and refuses more than 64 MiB a call. The repository's tracked files alone are
over that (checkpoints, data/answers), so before the device calls `slim` sets aside every
tracked file outside DEVICE_PATHS, and `restore` puts them back afterwards:

  slim     each such file is marked skip-worktree (so `git status` stays clean and no git command
           takes it for deleted) and moved to .gpu/aside/<path> (git-ignored, so it does not
           travel); the paths marked are written to .gpu/aside/SLIM.json before anything moves;
  restore  every file under .gpu/aside moved back and its mark cleared (only the marks SLIM.json
           lists: a skip-worktree mark set by someone else stays);
  bytes    what one device call carries from this checkout, with `--carry` paths, and after a
           slim (`--slim` measures that without moving anything).

Both commands are idempotent and resumable: a file's state is where it lies, so a slim or restore
that was stopped half-way finishes when run again, and a second slim or restore does nothing.
A path in both places (changed while set aside) stops them with its name; nothing is overwritten.
Restore before any git command that changes the working tree (checkout, merge, pull).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASIDE = Path(".gpu") / "aside"
STATE = "SLIM.json"
DEVICE_PATHS = ("dspark/", "services/", "protos/", "scripts/", "loadtest/")
"""What the device check imports (scripts/gpu_check.py: the package, the services, their protos,
the tiny models of the CPU rehearsal); the files at the repository's root stay too."""


class TreeError(RuntimeError):
    """The working tree is not in a state that slim or restore can change safely."""


def git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], input=stdin, check=True,
                          capture_output=True).stdout


def tracked(repo: Path = REPO) -> list[str]:
    return [os.fsdecode(n) for n in git(repo, "ls-files", "-z").split(b"\0") if n]


def untracked(repo: Path = REPO) -> list[str]:
    """Untracked files that git does not ignore: they travel too."""
    out = git(repo, "ls-files", "-z", "--others", "--exclude-standard")
    return [os.fsdecode(n) for n in out.split(b"\0") if n]


def on_device(rel: str) -> bool:
    return "/" not in rel or rel.startswith(DEVICE_PATHS)


def file_bytes(path: Path) -> int:
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def travel_bytes(repo: Path = REPO, carry: tuple[Path, ...] = (), slim: bool = False) -> dict:
    """The bytes a device call would carry: the tracked and untracked-not-ignored files present
    in the working tree (only those a slim keeps, with `slim`), shared/ and the carried paths."""
    kept = [r for r in tracked(repo) if not slim or on_device(r)]
    out = {"tracked": sum(file_bytes(repo / r) for r in kept),
           "untracked": sum(file_bytes(repo / r) for r in untracked(repo)),
           "shared": file_bytes(repo / "shared") if (repo / "shared").is_dir() else 0,
           "carry": sum(file_bytes(Path(c)) for c in carry)}
    # shared/ counted once: its tracked or untracked files are in the first two already.
    out["shared"] = max(0, out["shared"] - sum(
        file_bytes(repo / r) for r in kept + untracked(repo) if r.startswith("shared/")))
    out["total"] = sum(out.values())
    return out


def set_skip_worktree(repo: Path, paths: list[str], on: bool) -> None:
    if paths:
        git(repo, "update-index", "--skip-worktree" if on else "--no-skip-worktree", "-z",
            "--stdin", stdin=b"".join(os.fsencode(p) + b"\0" for p in paths))


def slim(repo: Path = REPO) -> dict:
    """Set aside every tracked file outside DEVICE_PATHS (see the module's docstring)."""
    aside = repo / ASIDE
    away = [r for r in tracked(repo) if not on_device(r)]
    both = [r for r in away if (repo / r).exists() and (aside / r).exists()]
    if both:
        raise TreeError(f"in the tree and set aside both, left as they are: {both[:10]}; "
                        f"keep one copy of each, then slim or restore again")
    aside.mkdir(parents=True, exist_ok=True)
    state = aside / STATE
    marked = set(json.loads(state.read_text())["marked"]) if state.is_file() else set()
    state.write_text(json.dumps({"marked": sorted(marked | set(away))}) + "\n")
    set_skip_worktree(repo, away, True)
    moved = 0
    for rel in away:
        if (repo / rel).exists() or (repo / rel).is_symlink():
            (aside / rel).parent.mkdir(parents=True, exist_ok=True)
            os.rename(repo / rel, aside / rel)
            moved += 1
            prune_empty(repo, (repo / rel).parent)
    return {"set_aside": moved, "already_aside": len(away) - moved,
            "bytes": travel_bytes(repo)}


def restore(repo: Path = REPO) -> dict:
    """Put back every file slim set aside and clear the marks it set."""
    aside = repo / ASIDE
    state = aside / STATE
    if not state.is_file():
        return {"restored": 0, "note": "nothing set aside"}
    files = sorted(p for p in aside.rglob("*") if (p.is_file() or p.is_symlink()) and p != state)
    rels = [p.relative_to(aside).as_posix() for p in files]
    both = [r for r in rels if (repo / r).exists()]
    if both:
        raise TreeError(f"in the tree and set aside both, left as they are: {both[:10]}; "
                        f"keep one copy of each, then restore again")
    for src, rel in zip(files, rels):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, repo / rel)
    marked = json.loads(state.read_text())["marked"]
    set_skip_worktree(repo, [r for r in marked if r in set(tracked(repo))], False)
    state.unlink()
    for folder in sorted((p for p in aside.rglob("*") if p.is_dir()), reverse=True):
        prune_empty(aside, folder)
    if not any(aside.iterdir()):
        aside.rmdir()
    return {"restored": len(files), "bytes": travel_bytes(repo)}


def prune_empty(root: Path, folder: Path) -> None:
    """Remove `folder` and its parents below `root` while they are empty."""
    while folder != root and root in folder.parents and folder.is_dir() \
            and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["slim", "restore", "bytes"])
    p.add_argument("--repo", type=Path, default=REPO)
    p.add_argument("--carry", type=Path, action="append", default=[],
                   help="bytes: a path the call names in `carry`")
    p.add_argument("--slim", action="store_true", help="bytes: as after `slim`")
    args = p.parse_args(argv)
    args.repo = args.repo.resolve()
    try:
        if args.command == "slim":
            out = slim(args.repo)
        elif args.command == "restore":
            out = restore(args.repo)
        else:
            out = travel_bytes(args.repo, tuple(args.carry), args.slim)
            out["limit"] = 64 << 20
            out["fits"] = out["total"] <= out["limit"]
    except TreeError as e:
        print(f"{args.command}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0 if out.get("fits", True) else 2


if __name__ == "__main__":
    sys.exit(main())
