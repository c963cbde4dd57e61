"""The device check's payload (scripts/gpu_payload.py through scripts/gpu_check.py) rehearsed on
the CPU with the tiny models: `pack` cuts the target into parts that each fit the size bound,
every file's sha256 in the manifest; `run1` on part1, `stash` on the middle parts and `run2` on
the last part gather the parts in one folder, check the digests, join the chunks and run every
check; a corrupted file, a part missing from the machine and a payload over the bound fail."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.py"
LIMIT_MIB = 0.5  # the tiny target's 4 layers and the drafter do not fit one "call" of this size


def gpu_check(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sys.path.insert(0, str(REPO_ROOT))
    from loadtest.tiny_models import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


def pack(tiny, out: Path, limit_mib: float = LIMIT_MIB, *extra) -> subprocess.CompletedProcess:
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"t{i} t{i + 1} t{i + 2}"]}) + "\n"
                               for i in range(5, 13)))
    return gpu_check("pack", "--safetensors", "--target-dir", tiny.target_dir, "--drafter-dir",
                     tiny.drafter_dir, "--prompts-file", prompts, "--out", out, "--chunk-mib",
                     0.05, "--limit-mib", limit_mib, "--tracked-bytes", 0, *extra, timeout=300)


def test_pack_cuts_the_payload_into_parts_within_the_bound(tiny, tmp_path):
    proc = pack(tiny, tmp_path / "check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = sorted((tmp_path / "check").iterdir())
    assert len(parts) >= 2, parts
    manifest = json.loads((parts[0] / "MANIFEST.json").read_text())
    assert manifest["sizes"]["calls_needed"] == len(parts) and manifest["sizes"]["fits"]
    listed = set()
    for part in parts:
        files = [f for f in part.rglob("*") if f.is_file()]
        assert sum(f.stat().st_size for f in files) <= LIMIT_MIB * 2**20
        for f in files:
            rel = f.relative_to(part).as_posix()
            if rel != "MANIFEST.json":
                assert hashlib.sha256(f.read_bytes()).hexdigest() == manifest["files"][rel], rel
                listed.add(rel)
    assert listed == set(manifest["files"])
    weights = manifest["joined"]["target/model.safetensors"]
    joined = b"".join((tmp_path / "check" / next(p for p, r in manifest["parts"].items() if c in r)
                       / c).read_bytes() for c in weights["chunks"])
    assert joined == (tiny.target_dir / "model.safetensors").read_bytes()
    assert all("ids" in json.loads(x) for x in (parts[0] / "prompts.jsonl").read_text().split("\n")
               if x)


def test_pack_refuses_a_payload_over_the_bound(tiny, tmp_path):
    proc = pack(tiny, tmp_path / "check", limit_mib=0.01)
    assert proc.returncode == 2 and "cannot fit one device call" in proc.stderr, proc.stderr[-2000:]


def test_run1_fails_on_a_corrupted_file(tiny, tmp_path):
    assert pack(tiny, tmp_path / "check").returncode == 0
    part1 = tmp_path / "check" / "part1"
    chunk = sorted(part1.rglob("*.part*"))[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 1
    chunk.write_bytes(bytes(data))
    proc = gpu_check("run1", "--payload", part1, "--stash", tmp_path / "stash", "--device", "cpu",
                     "--out", tmp_path / "out")
    assert proc.returncode != 0
    results = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert "digests do not match" in results["payload part1"]["error"], results
    assert chunk.relative_to(part1).as_posix() in results["payload part1"]["error"]


def test_pack_run1_run2_rehearse_on_the_cpu(tiny, tmp_path):
    # Every .safetensors compressed (the tiny models' random float32 weights would not be by
    # default), so that the parts carry xz chunks that run 1 and run 2 join and decompress.
    assert pack(tiny, tmp_path / "check", LIMIT_MIB, "--compress-min-saving", -1).returncode == 0
    parts = sorted((tmp_path / "check").iterdir())
    stash = tmp_path / "stash"

    # The last part alone (a machine gone cold between the calls) cannot be assembled.
    cold = gpu_check("run2", "--payload", parts[-1], "--stash", tmp_path / "cold", "--device",
                     "cpu", "--out", tmp_path / "cold-out", "--streams", "1", "--users", "1")
    assert cold.returncode != 0
    cold_results = json.loads((tmp_path / "cold-out" / "gpu.json").read_text())
    assert "not on this machine" in cold_results["payload assembled"]["error"]

    proc = gpu_check("run1", "--payload", parts[0], "--stash", stash, "--device", "cpu", "--out",
                     tmp_path / "run1")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    run1 = json.loads((tmp_path / "run1" / "gpu.json").read_text())
    assert run1["payload part1"]["ok"] and run1["repository files"]["ok"]
    assert run1["smoke (random target of the real shape)"]["T=0.0"]["tokens"] > 0
    for part in parts[1:-1]:
        assert gpu_check("stash", "--payload", part, "--stash", stash, "--device", "cpu", "--out",
                         tmp_path / part.name).returncode == 0

    proc = gpu_check("run2", "--payload", parts[-1], "--stash", stash, "--device", "cpu", "--out",
                     tmp_path / "run2", "--prompts", "3", "--max-tokens", "6", "--samples", "64",
                     "--streams", "1,2", "--users", "1,2")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    run2 = json.loads((tmp_path / "run2" / "gpu.json").read_text())
    assembled = run2["payload assembled"]
    assert assembled["digests_ok"] and "target/model.safetensors.xz" in assembled["joined"]
    assert assembled["decompressed"] == ["drafter/model.safetensors", "target/model.safetensors"]
    n = len(json.loads((parts[0] / "MANIFEST.json").read_text())["tensors"])
    assert assembled["tensors"] == f"{n}/{n} identical to the prepared target"
    assert all(v == "3/3" for k, v in run2["(a) exactness"].items() if "/" in str(v))
    assert run2["(b) T=1 distribution"]["ok"]
    assert "T=0.0 streams=2 async_topk / target-only" in run2["(c) tokens/s"]
    assert "services / embedded" in run2["(d) services in process"]["users=1"]
    assert set(run2["phases (seconds, budget)"]) >= {"(a) exactness", "(d) services in process"}
    assert run2["smoke (random target of the real shape)"] == \
        run1["smoke (random target of the real shape)"]  # run 1's figures come back with run 2's
