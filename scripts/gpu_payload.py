"""The payload of the prepared device check (scripts/gpu_check.py): what travels to the GPU
machine beside the repository, in parts that each fit one device call, and its reassembly there.

`pack` (here) writes `--out`/part1, part2, ... (each a folder the device tool's `carry` names):
  target/   the target's config and its weights: the shipped GGUF (`dspark fetch-model`'s
            source, which holds the tokenizer too) or, for a small target, its safetensors with
            the tokenizer files and chat template;
  drafter/  the drafter, unless it lies in the device tree (scripts/gpu_tree.py: the shipped
            drafter, checkpoints/dspark-markov, is set aside with the other checkpoints, so it
            travels here; one inside the device tree is listed under "repo_files" instead);
  prompts.jsonl  the eval prompts ({"turns": [...], "dataset": name, "ids": chat-templated token
            ids}), `--per-set` of each set;
  wheels/   the wheels the GPU machine lacks (python 3.12, manylinux): `gguf` for the GGUF's
            conversion, and the service path's grpcio-health-checking, grpcio-reflection and
            OpenTelemetry with the grpcio and protobuf the committed stubs were generated for;
  MANIFEST.json  in every part: sha256 and size of every file, the part each lies in, the joined
            and the compressed files' digests, the float32 tensors' digests of the prepared
            target, and the sizes: the device tree's bytes, the device tool's limit and each
            part's bytes.
A `.safetensors` file travels xz-compressed (`NAME.xz`) when that saves at least
`compress_min_saving` of it (the shipped drafter's bf16 weights: 24,276,458 bytes to 15,962,444);
the GGUF's 4-bit blocks do not compress enough to be worth minutes of xz. A file larger than
`--chunk-mib` (after compression) is cut into numbered chunks (`NAME.part000`, ...).
A part fits when the device tree's bytes + its bytes <= the limit (64 MiB); `pack` says how many
device calls the payload needs and fails when a part cannot fit at all.

On the GPU machine, each call first `stash`es its part: the files' digests are checked and the
part is copied to a folder outside the repository (`--stash`, /tmp/dspark-payload), which stays
while the machine is warm; whatever is complete is joined and decompressed and checked there
(part1 holds the drafter whole, for run 1's smoke round); the last call `assemble`s: every part
present, every digest checked, the GGUF converted to a safetensors folder as
`dspark fetch-model` does, and its tensors compared with the digests taken here.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
DEVICE_LIMIT_BYTES = 64 * MIB
"""The device tool's bound on the working tree that travels (tracked files + carried paths)."""
MARGIN_BYTES = 256 << 10
"""Slack for files that become untracked-but-not-ignored between `pack` and the calls."""
COMPRESS_MIN_SAVING = 0.1
"""A .safetensors file travels xz-compressed when that makes it at least 10% smaller."""
XZ_PRESET = 6
"""xz's default level: the drafter's 24 MB in about a minute on one core; -9 saves <1% more."""
DEFAULT_STASH = Path("/tmp/dspark-payload")
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")
DRAFTER_FILES = ("config.json", "model.safetensors", "calibration.json")
EVAL_SETS = ("gsm8k", "humaneval", "math500", "mt-bench")


class PayloadError(RuntimeError):
    """The payload is incomplete, corrupted or does not fit."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def device_tree_bytes(repo: Path = REPO) -> int:
    """What every device call carries besides its part: the working tree after
    `scripts/gpu_tree.py slim` (tracked files of the device tree, untracked-not-ignored files)."""
    import gpu_tree

    return gpu_tree.travel_bytes(repo, slim=True)["total"]


def in_device_tree(path: Path, repo: Path = REPO) -> bool:
    """A tracked file that `scripts/gpu_tree.py slim` keeps: it travels with every call."""
    import gpu_tree

    try:
        rel = path.resolve().relative_to(repo).as_posix()
    except ValueError:
        return False
    return gpu_tree.on_device(rel) and subprocess.run(
        ["git", "-C", str(repo), "ls-files", "--error-unmatch", rel],
        capture_output=True).returncode == 0


def xz_if_smaller(src: Path, dst: Path, min_saving: float) -> Path | None:
    """`src` xz-compressed into `dst` when that saves at least `min_saving` of it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as f, lzma.open(dst, "wb", preset=XZ_PRESET) as g:
        shutil.copyfileobj(f, g, 1 << 22)
    if dst.stat().st_size <= (1 - min_saving) * src.stat().st_size:
        return dst
    dst.unlink()
    return None


def tensor_digests(safetensors_file: Path) -> dict[str, str]:
    """sha256 of every tensor's float32 bytes, by name."""
    import torch
    from safetensors.torch import load_file

    return {name: hashlib.sha256(t.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()
            for name, t in sorted(load_file(str(safetensors_file)).items())}


def eval_prompts(eval_dir: Path, per_set: int) -> list[dict]:
    out = []
    for name in EVAL_SETS:
        path = eval_dir / f"{name}.jsonl"
        if not path.is_file():
            continue
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()][:per_set]
        out += [{"turns": json.loads(ln)["turns"][:1], "dataset": name} for ln in lines]
    if not out:
        raise PayloadError(f"no eval prompts in {eval_dir} ({', '.join(EVAL_SETS)}.jsonl)")
    return out


# ------------------------------------------------------------------------------------- pack
def pack(out: Path, target_dir: Path, drafter_dir: Path, prompts: list[dict],
         gguf: Path | None = None, wheels: list[Path] = (), chunk_bytes: int = 1 * MIB,
         limit_bytes: int = DEVICE_LIMIT_BYTES, tracked: int | None = None,
         compress_min_saving: float = COMPRESS_MIN_SAVING) -> dict:
    """Write the parts under `out` and return the manifest (also in every part).

    `gguf` set: the target's weights travel as that GGUF (converted on the device) and the
    prepared `target_dir`/model.safetensors gives the tensor digests; unset: `target_dir`'s
    model.safetensors travels as it is. `tracked`: the bytes every call carries besides its
    part (default: the device tree's, `device_tree_bytes`)."""
    tracked = device_tree_bytes() if tracked is None else tracked
    budget = limit_bytes - tracked - MARGIN_BYTES
    if out.exists():
        shutil.rmtree(out)
    staging = out / ".files"
    staging.mkdir(parents=True)
    try:
        return _pack(out, staging, target_dir, drafter_dir, prompts, gguf, wheels, chunk_bytes,
                     limit_bytes, tracked, budget, compress_min_saving)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _pack(out, staging, target_dir, drafter_dir, prompts, gguf, wheels, chunk_bytes,
          limit_bytes, tracked, budget, compress_min_saving) -> dict:

    files: list[tuple[str, Path]] = []  # (path in the payload, source)
    # With a GGUF, the tokenizer comes out of its conversion and the prompts travel as ids.
    for name in TARGET_FILES if gguf is None else ("config.json", "generation_config.json"):
        if (target_dir / name).is_file():
            files.append((f"target/{name}", target_dir / name))
    weights = gguf if gguf is not None else target_dir / "model.safetensors"
    files.append((f"target/{weights.name}", weights))
    repo_files = {}
    drafter_in_repo = all(in_device_tree(drafter_dir / n) for n in DRAFTER_FILES
                          if (drafter_dir / n).exists())
    for name in DRAFTER_FILES:
        src = drafter_dir / name
        if not src.is_file():
            continue
        if drafter_in_repo:
            repo_files[str(src.resolve().relative_to(REPO))] = sha256(src)
        else:
            files.append((f"drafter/{name}", src))
    (staging / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    files.append(("prompts.jsonl", staging / "prompts.jsonl"))
    files += [(f"wheels/{w.name}", w) for w in wheels]

    compressed = {}
    for i, (rel, src) in enumerate(files):
        if src.suffix == ".safetensors":
            xz = xz_if_smaller(src, staging / f"{rel}.xz", compress_min_saving)
            if xz is not None:
                compressed[rel] = {"sha256": sha256(src), "bytes": src.stat().st_size,
                                   "from": f"{rel}.xz"}
                files[i] = (f"{rel}.xz", xz)

    # Cut large files into chunks; small files first, so that part1 holds everything run 1 needs.
    pieces: list[tuple[str, Path, int, int]] = []  # (payload path, source, offset, size)
    joined = {}
    for rel, src in files:
        size = src.stat().st_size
        if size <= chunk_bytes:
            pieces.append((rel, src, 0, size))
            continue
        chunks = []
        for i, offset in enumerate(range(0, size, chunk_bytes)):
            chunks.append(f"{rel}.part{i:03d}")
            pieces.append((chunks[-1], src, offset, min(chunk_bytes, size - offset)))
        joined[rel] = {"sha256": sha256(src), "bytes": size, "chunks": chunks}
    weight_chunks = set(joined.get(f"target/{weights.name}", {}).get("chunks", []))
    pieces.sort(key=lambda p: (p[0] in weight_chunks, p[0]))

    parts: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for rel, _, _, size in pieces:
        if size > budget:
            raise PayloadError(
                f"{rel} ({size:,} bytes) cannot fit one device call: the limit is "
                f"{limit_bytes:,} bytes and the device tree takes {tracked:,} "
                f"({budget:,} left); use a smaller --chunk-mib or keep fewer files on the device")
        name = f"part{len(parts)}"
        if not parts or sizes[name] + size > budget:
            name = f"part{len(parts) + 1}"
            parts[name], sizes[name] = [], 0
        parts[name].append(rel)
        sizes[name] += size

    digests = {}
    where = {rel: part for part, rels in parts.items() for rel in rels}
    for rel, src, offset, size in pieces:
        dst = out / where[rel] / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as f, open(dst, "wb") as g:
            f.seek(offset)
            g.write(f.read(size))
        digests[rel] = sha256(dst)

    manifest = {
        "version": 1,
        "files": digests,
        "bytes": {rel: size for rel, _, _, size in pieces},
        "parts": parts,
        "joined": joined,
        "compressed": compressed,
        "repo_files": repo_files,
        "drafter": "drafter" if not drafter_in_repo
        else str(drafter_dir.resolve().relative_to(REPO)),
        "weights": f"target/{weights.name}",
        "tensors": tensor_digests(target_dir / "model.safetensors")
        if (target_dir / "model.safetensors").is_file() else {},
        "sizes": {"limit_bytes": limit_bytes, "tracked_bytes": tracked,
                  "margin_bytes": MARGIN_BYTES, "budget_bytes": budget,
                  "part_bytes": sizes, "payload_bytes": sum(sizes.values()),
                  "calls_needed": len(parts), "fits": None},
    }
    largest = max(sizes.values()) + len(json.dumps(manifest, indent=1)) + 1
    manifest["sizes"]["fits"] = tracked + largest <= limit_bytes
    text = json.dumps(manifest, indent=1) + "\n"
    for part in parts:
        (out / part / "MANIFEST.json").write_text(text)
    return manifest


# ------------------------------------------------------------------------ on the device
def stash(part_dir: Path, stash_dir: Path = DEFAULT_STASH) -> dict:
    """Check this part's files against its manifest and copy them to `stash_dir`."""
    manifest = json.loads((part_dir / "MANIFEST.json").read_text())
    part = part_dir.name
    if part not in manifest["parts"]:
        raise PayloadError(f"{part_dir} is not a part of its manifest "
                           f"({', '.join(manifest['parts'])})")
    bad = [rel for rel in manifest["parts"][part]
           if not (part_dir / rel).is_file() or sha256(part_dir / rel) != manifest["files"][rel]]
    if bad:
        raise PayloadError(f"{part}: digests do not match for {bad}")
    stash_dir.mkdir(parents=True, exist_ok=True)
    old = stash_dir / "MANIFEST.json"
    if old.is_file() and json.loads(old.read_text())["files"] != manifest["files"]:
        shutil.rmtree(stash_dir)  # another payload's parts: start over
        stash_dir.mkdir(parents=True)
    for rel in manifest["parts"][part]:
        dst = stash_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(part_dir / rel, dst)
    (stash_dir / "MANIFEST.json").write_text((part_dir / "MANIFEST.json").read_text())
    have = [p for p, rels in manifest["parts"].items()
            if all((stash_dir / r).is_file() for r in rels)]
    joined, bad = unpack_complete(stash_dir, manifest)
    if bad:
        raise PayloadError(f"joined or decompressed files do not match their digests: {bad}")
    return {"part": part, "files": len(manifest["parts"][part]), "parts_stashed": have,
            "parts": len(manifest["parts"]), "joined": joined, "ok": True}


def unpack_complete(stash_dir: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """Join every chunked file whose chunks are all here, then decompress every compressed file
    that is whole (a drafter carried in part1 is ready for run 1); returns the files made and
    those whose digest differs."""
    joined, bad = join_complete(stash_dir, manifest)
    for rel, spec in manifest.get("compressed", {}).items():
        src, dst = stash_dir / spec["from"], stash_dir / rel
        if spec["from"] in bad or not src.is_file() or (
                spec["from"] in manifest["joined"] and spec["from"] not in joined):
            continue
        if not dst.is_file() or dst.stat().st_size != spec["bytes"]:
            with lzma.open(src, "rb") as f, open(dst, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 22)
        (bad if sha256(dst) != spec["sha256"] else joined).append(rel)
    return joined, bad


def join_complete(stash_dir: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """Join every chunked file whose chunks are all here; returns the files joined and those
    whose digest differs."""
    joined, bad = [], []
    for rel, spec in manifest["joined"].items():
        if not all((stash_dir / c).is_file() for c in spec["chunks"]):
            continue
        dst = stash_dir / rel
        if not dst.is_file() or dst.stat().st_size != spec["bytes"]:
            with open(dst, "wb") as g:
                for chunk in spec["chunks"]:
                    with open(stash_dir / chunk, "rb") as f:
                        shutil.copyfileobj(f, g)
        (bad if sha256(dst) != spec["sha256"] else joined).append(rel)
    return joined, bad


def install_wheels(stash_dir: Path = DEFAULT_STASH, install: bool = True) -> dict:
    """The carried wheels installed (once) into stash/site, first on sys.path; `install` False:
    none (a rehearsal whose python has the packages already, and is not the device's 3.12)."""
    wheels = sorted((stash_dir / "wheels").glob("*.whl")) if install else []
    site = stash_dir / "site"
    marker = site / ".installed"
    names = [w.name for w in wheels]
    if wheels and (not marker.is_file() or marker.read_text().split() != names):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                        *map(str, wheels)], check=True)
        marker.write_text("\n".join(names))
    if wheels and str(site) not in sys.path:
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return {"wheels": names, "site": str(site)}


def verify_repo_files(manifest: dict, repo: Path = REPO) -> list[str]:
    """The device tree's files the payload relies on (a drafter kept there) whose digest differs."""
    return [rel for rel, digest in manifest["repo_files"].items()
            if not (repo / rel).is_file() or sha256(repo / rel) != digest]


def assemble(stash_dir: Path = DEFAULT_STASH, convert: bool = True,
             install: bool = True) -> dict:
    """Every part present and checked, chunks joined, the GGUF converted; returns where the
    target and drafter are and what was checked."""
    manifest = json.loads((stash_dir / "MANIFEST.json").read_text())
    missing = [rel for rel in manifest["files"] if not (stash_dir / rel).is_file()]
    if missing:
        parts = sorted({p for p, rels in manifest["parts"].items() for r in rels if r in missing})
        raise PayloadError(f"parts {parts} are not on this machine ({len(missing)} files): each "
                           "call stashes its part in /tmp, so the calls must follow one another "
                           "on the same warm machine")
    bad = [rel for rel, d in manifest["files"].items() if sha256(stash_dir / rel) != d]
    bad += unpack_complete(stash_dir, manifest)[1]
    bad += [f"repo:{rel}" for rel in verify_repo_files(manifest)]
    if bad:
        raise PayloadError(f"digests do not match for {bad}")
    target = stash_dir / "target"
    weights = stash_dir / manifest["weights"]
    out = {"files": len(manifest["files"]), "joined": sorted(manifest["joined"]),
           "decompressed": sorted(manifest.get("compressed", {})),
           "repo_files": len(manifest["repo_files"]), "digests_ok": True}
    if weights.suffix == ".gguf" and convert:
        target = convert_gguf(weights, stash_dir, install)
    if manifest["tensors"] and (target / "model.safetensors").is_file():
        got = tensor_digests(target / "model.safetensors")
        want = manifest["tensors"]
        differ = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
        out["tensors"] = f"{len(want) - len(differ)}/{len(want)} identical to the prepared target"
        out["tensors_differ"] = differ[:20]
    drafter = stash_dir / "drafter" if manifest["drafter"] == "drafter" \
        else REPO / manifest["drafter"]
    out.update(target_dir=str(target), drafter_dir=str(drafter),
               prompts_file=str(stash_dir / "prompts.jsonl"))
    return out


def convert_gguf(gguf: Path, stash_dir: Path, install: bool = True) -> Path:
    """`dspark fetch-model`'s conversion into stash/model (the carried `gguf` wheel installed)."""
    folder = stash_dir / "model"
    if (folder / "model.safetensors").is_file():
        return folder
    install_wheels(stash_dir, install)
    from dspark.fetch import _convert

    tmp = stash_dir / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    _convert(gguf, tmp)
    os.rename(tmp, folder)
    return folder
