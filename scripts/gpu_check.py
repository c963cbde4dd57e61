"""The prepared device check (issue 53, item 5): DSpark on one GPU, measured in at most two runs.

Run 1 (`--run 1`): the environment (device, torch, CUDA, transformers, triton), the payload's
digests against its manifest (`--manifest`, sha256 per file), and a smoke round: the engine on a
random target of the real target's shape (its config.json), greedy and T=1, with the drafter.
Run 2 (`--run 2`):
  (a) exactness: greedy DSpark token-identical to transformers' greedy `generate` in float32 with
      TF32 off, on `--prompts` prompts, under `none`, `async_topk` and `fixed:K`; and bf16
      DSpark identical to our own bf16 target-only decoding;
  (b) a seeded T=1 distribution check: the first two output tokens of one prompt under DSpark
      and under target-only decoding, `--samples` seeds each, a two-sample chi-square test;
  (c) speed: target-only against DSpark (`async_topk`, `fixed:K`) at each of `--streams`,
      greedy and T=1, and transformers `generate` and prompt-lookup decoding at 1 stream;
  (d) the verifier and drafter as gRPC services in this process (the scheduler's engine over
      RemoteVerifier / RemoteDrafter; no FastAPI, uvicorn or Redis needed) at 1 and the largest
      of `--users`, against the embedded engine.
Every figure is written with the device name and the torch and CUDA versions beside it:
`--out`/gpu.json and `--out`/gpu.md (docs/results/ when committed).

Rehearsal on a CPU (`--device cpu --tiny`): the tiny random target and drafter of the tests
(loadtest.tiny_models) stand in for SmolLM2 and the shipped drafter; every step runs, only
smaller. tests/test_gpu_check.py runs it.

On the GPU machine (no internet; torch 2.11 + CUDA 13, transformers 5.17, triton 3.6, grpcio):

    python3 scripts/gpu_check.py --run 1 --device cuda --model-dir M --drafter-dir D \\
        --manifest MANIFEST.json --out $OUT
    python3 scripts/gpu_check.py --run 2 --device cuda --model-dir M --drafter-dir D \\
        --prompts-file P.jsonl --out $OUT

Each run is sized to end within 8 minutes on one H100 (`--budget-s`, default 420: the speed
grid stops early and says so when it runs out).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dspark.devices import add_device_argument, resolve_device  # noqa: E402

TINY_PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [40], [8, 8, 8, 8, 8],
                [33, 21, 7], [4, 4, 5], [60, 61, 62, 63]]


# ------------------------------------------------------------------------------ environment
def environment(device: str) -> dict:
    """What every figure is stamped with."""
    env = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version()}
    if torch.device(device).type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
    else:
        from dspark.cpu_info import cpu_line

        env["device_name"] = cpu_line()
    for name in ("transformers", "triton", "grpc"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 (absent or without a version: say so)
            env[name] = None
    return env


def check_manifest(manifest: Path) -> dict:
    """sha256 of every file the manifest lists ({"files": {relative path: sha256}}), relative
    to the manifest's folder."""
    spec = json.loads(manifest.read_text())
    bad = []
    for rel, digest in spec["files"].items():
        path = manifest.parent / rel
        got = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        if got != digest:
            bad.append(rel)
    return {"files": len(spec["files"]), "mismatched": bad, "ok": not bad}


# ------------------------------------------------------------------------------ building
class Models:
    """The target and drafter folders, the prompts and the sizes of this check."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tmp = None
        if args.tiny:
            from loadtest.tiny_models import build_tiny_models

            self.tmp = tempfile.TemporaryDirectory()
            tiny = build_tiny_models(Path(self.tmp.name))
            self.target, self.drafter = tiny.target_dir, tiny.drafter_dir
            self.prompts = TINY_PROMPTS * (1 + args.prompts // len(TINY_PROMPTS))
        else:
            self.target, self.drafter = Path(args.model_dir), Path(args.drafter_dir)
            self.prompts = read_prompts(Path(args.prompts_file), self.target)
        self.prompts = self.prompts[:max(args.prompts, max(args.streams), max(args.users))]


def read_prompts(path: Path, model_dir: Path) -> list[list[int]]:
    """Chat-templated prompt ids from a JSONL file of {"prompt": text} (or {"turns": [...]})."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            text = record.get("prompt") or record.get("turns", [""])[0]
            out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     tokenize=True, add_generation_prompt=True))
    while len(out) < 64:
        out += out
    return out


def build(models: Models, device: str, dtype: str, policy: str, max_running: int,
          target_dir: Path | None = None):
    """The embedded engine; the cost table measured here (never a CPU table on a GPU)."""
    from dspark.cost_table import CostTable
    from dspark.engine import Engine, EngineConfig
    from dspark.loading import load_method_drafter, load_target
    from dspark.models.drafter_config import DrafterConfig
    from dspark.step_timing import startup_cost_table
    from dspark.verifier import TargetVerifier

    use_drafter = policy != "none"
    layers = tuple(DrafterConfig.load(models.drafter).target_layer_ids)
    runner = load_target(target_dir or models.target, layers, kv_cache_tokens=max_running * 2048,
                         device=device, dtype=dtype)
    drafter = load_method_drafter(models.drafter, runner, apply_calibration=True) \
        if use_drafter else None
    key = (str(target_dir or models.target), device, dtype)
    if key not in _TABLES:
        _TABLES[key] = startup_cost_table(runner).to_dict()
    table = CostTable.from_dict(_TABLES[key])
    return Engine(TargetVerifier(runner), drafter, table,
                  EngineConfig().with_values(policy=policy, max_running=max_running))


_TABLES: dict = {}


def generate(engine, prompts, temperature: float, max_tokens: int, seed: int = 0
             ) -> tuple[list[list[int]], float]:
    from dspark.sampling import SamplingParams

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(temperature=temperature, seed=seed),
                           max_tokens=max_tokens)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [r.output_ids for r in done], time.perf_counter() - start


# ------------------------------------------------------------------------------ the checks
def smoke(models: Models, device: str, dtype: str, args) -> dict:
    """One engine run on a random target of the real target's shape (its config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(tempfile.mkdtemp())
    config = AutoConfig.from_pretrained(models.target)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    out = {}
    for temperature in (0.0, 1.0):
        engine = build(models, device, dtype, "async_topk", 2, target_dir=folder)
        tokens, seconds = generate(engine, models.prompts[:2], temperature, 8)
        out[f"T={temperature}"] = {"tokens": sum(map(len, tokens)), "seconds": round(seconds, 3)}
    return out


@contextlib.contextmanager
def tf32_off():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def exactness(models: Models, device: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    prompts = models.prompts[:args.prompts]
    out = {"prompts": len(prompts), "max_tokens": args.max_tokens}
    with tf32_off(), torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).to(device)
        reference = []
        for p in prompts:
            ids = hf.generate(torch.tensor([p], device=device), max_new_tokens=args.max_tokens,
                              do_sample=False, attention_mask=torch.ones(1, len(p), dtype=torch.long,
                                                                         device=device),
                              pad_token_id=0, eos_token_id=None)
            reference.append(ids[0, len(p):].tolist())
        del hf
        for policy in ("none", "async_topk", f"fixed:{args.fixed_k}"):
            engine = build(models, device, "float32", policy, len(prompts))
            got, _ = generate(engine, prompts, 0.0, args.max_tokens)
            same = sum(g == r[:len(g)] and len(g) == args.max_tokens for g, r in zip(got, reference))
            out[f"float32 {policy}"] = f"{same}/{len(prompts)}"
    plain, _ = generate(build(models, device, "bfloat16", "none", len(prompts)), prompts, 0.0,
                        args.max_tokens)
    for policy in ("async_topk", f"fixed:{args.fixed_k}"):
        got, _ = generate(build(models, device, "bfloat16", policy, len(prompts)), prompts, 0.0,
                          args.max_tokens)
        out[f"bfloat16 {policy} vs our bfloat16 target-only"] = \
            f"{sum(g == p for g, p in zip(got, plain))}/{len(prompts)}"
    return out


def chi_square_p(table: list[list[int]]) -> tuple[float, int, float]:
    """Two-sample chi-square over the categories with counts (Wilson-Hilferty p-value):
    (statistic, degrees of freedom, p)."""
    cols = [c for c in zip(*table) if sum(c) > 0]
    rows = [sum(r) for r in table]
    total = sum(rows)
    stat = sum((o - rows[i] * sum(c) / total) ** 2 / (rows[i] * sum(c) / total)
               for c in cols for i, o in enumerate(c))
    dof = max(1, len(cols) - 1)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return stat, dof, 0.5 * math.erfc(z / math.sqrt(2))


def distribution(models: Models, device: str, dtype: str, args) -> dict:
    """The first two tokens at T=1, one seed per sample, DSpark against target-only."""
    from dspark.sampling import SamplingParams

    prompt = models.prompts[0]
    counts = {}
    for policy in ("none", f"fixed:{args.fixed_k}"):
        engine = build(models, device, dtype, policy, 64)
        seen: dict[tuple, int] = {}
        for start in range(0, args.samples, 64):
            ids = [engine.add_request(prompt, SamplingParams(temperature=1.0, seed=i),
                                      max_tokens=2)
                   for i in range(start, min(start + 64, args.samples))]
            by_id = {r.request_id: r for r in engine.waiting}
            while engine.has_unfinished():
                engine.step()
            for rid in ids:
                key = tuple(by_id[rid].output_ids)
                seen[key] = seen.get(key, 0) + 1
        counts[policy] = seen
    keys = sorted(set().union(*counts.values()))
    table = [[counts[p].get(k, 0) for k in keys] for p in counts]
    stat, dof, p = chi_square_p(table)
    return {"samples": args.samples, "outcomes": len(keys), "chi2": round(stat, 2), "dof": dof,
            "p": round(p, 4), "ok": p > 0.001}


def speed(models: Models, device: str, dtype: str, args, deadline: float) -> dict:
    rows = {}
    for temperature in (0.0, 1.0):
        for streams in args.streams:
            for policy in ("none", "async_topk", f"fixed:{args.fixed_k}"):
                if time.monotonic() > deadline:
                    rows["stopped"] = "budget spent"
                    return rows
                engine = build(models, device, dtype, policy, streams)
                prompts = models.prompts[:streams]
                generate(engine, prompts, temperature, 4)  # warm-up
                tokens, seconds = generate(engine, prompts, temperature, args.max_tokens)
                rows[f"T={temperature} streams={streams} {policy}"] = round(
                    sum(map(len, tokens)) / seconds, 1)
    rows.update(hf_peers(models, device, dtype, args))
    for key in list(rows):
        if " none" in key:
            for other in ("async_topk", f"fixed:{args.fixed_k}"):
                k = key.replace(" none", f" {other}")
                if k in rows:
                    rows[f"{k} / target-only"] = round(rows[k] / rows[key], 3)
    return rows


def hf_peers(models: Models, device: str, dtype: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models.target, dtype=getattr(torch, dtype)).to(device)
    out = {}
    p = models.prompts[0]
    ids = torch.tensor([p], device=device)
    mask = torch.ones_like(ids)
    for name, extra in (("transformers generate", {}),
                        ("transformers prompt-lookup", {"prompt_lookup_num_tokens": 10})):
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                        pad_token_id=0, **extra)
            start = time.perf_counter()
            gen = hf.generate(ids, attention_mask=mask, max_new_tokens=args.max_tokens,
                              min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0,
                              **extra)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out[f"T=0.0 streams=1 {name}"] = round((gen.shape[1] - len(p))
                                                    / (time.perf_counter() - start), 1)
    return out


def services(models: Models, device: str, dtype: str, args) -> dict:
    """The verifier and the drafter as gRPC services in this process, the engine over them."""
    from opentelemetry import trace

    from dspark.cost_table import CostTable
    from dspark.engine import Engine, EngineConfig
    from dspark.serving import grpc_runtime
    from dspark.serving.config import DrafterServiceConfig, VerifierServiceConfig
    from dspark.serving.protos import rpc
    from dspark.serving.remote_drafter import RemoteDrafter
    from dspark.serving.remote_verifier import RemoteVerifier
    from services.drafter.main import build_servicer as drafter_servicer
    from services.verifier.main import build_servicer as verifier_servicer

    tracer = trace.get_tracer("gpu_check")
    users = max(args.users)
    v = verifier_servicer(VerifierServiceConfig(
        model_dir=str(models.target), drafter_dir=str(models.drafter), device=device,
        dtype=dtype, kv_cache_tokens=users * 2048), tracer)
    d = drafter_servicer(DrafterServiceConfig(model_dir=str(models.target),
                                              drafter_dir=str(models.drafter), device=device,
                                              dtype=dtype), tracer)
    servers = []
    try:
        vs, _, vport = grpc_runtime.start_server(v, rpc.verifier.add_VerifierServicer_to_server,
                                                 "dspark.v1.Verifier", "127.0.0.1", 0)
        ds, _, dport = grpc_runtime.start_server(d, rpc.drafter.add_DrafterServicer_to_server,
                                                 "dspark.v1.Drafter", "127.0.0.1", 0)
        servers = [vs, ds]
        out = {}
        for n in sorted(set(args.users)):
            prompts = models.prompts[:n]
            remote = Engine(RemoteVerifier(f"127.0.0.1:{vport}"),
                            RemoteDrafter(f"127.0.0.1:{dport}"),
                            CostTable.from_dict(v.cost_table.to_dict()),
                            EngineConfig().with_values(policy="async_topk", max_running=n))
            generate(remote, prompts, 0.0, 4)
            tokens, seconds = generate(remote, prompts, 0.0, args.max_tokens)
            served = sum(map(len, tokens)) / seconds
            tokens, seconds = generate(build(models, device, dtype, "async_topk", n), prompts,
                                       0.0, args.max_tokens)
            embedded = sum(map(len, tokens)) / seconds
            out[f"users={n}"] = {"services tok/s": round(served, 1),
                                 "embedded tok/s": round(embedded, 1),
                                 "services / embedded": round(served / embedded, 3)}
        return out
    finally:
        for s in servers:
            s.stop(None)


# ------------------------------------------------------------------------------ report
def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(results)
    path.write_text(json.dumps(old, indent=2) + "\n")
    env = old.get("environment", {})
    stamp = (f"{env.get('device_name')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
             f"transformers {env.get('transformers')}")
    lines = ["# DSpark on one device: the prepared check", "",
             f"Device: {stamp} (every figure below is from this device and these versions).", ""]
    for section, body in old.items():
        if section == "environment":
            continue
        lines += [f"## {section}", "", "| what | value | device |", "| --- | --- | --- |"]
        for key, value in (body.items() if isinstance(body, dict) else [("", body)]):
            lines.append(f"| {key} | {json.dumps(value) if isinstance(value, dict) else value} | "
                         f"{env.get('device_name')}, torch {env.get('torch')}, "
                         f"CUDA {env.get('cuda')} |")
        lines.append("")
    (out / "gpu.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=["1", "2", "all"], default="all")
    add_device_argument(p)
    p.add_argument("--tiny", action="store_true", help="rehearsal: the tests' tiny random models")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--drafter-dir", default=None)
    p.add_argument("--prompts-file", default=None, help="JSONL of {'prompt': text}")
    p.add_argument("--manifest", type=Path, default=None, help="sha256 per file, checked in run 1")
    p.add_argument("--dtype", default=None, help="speed and services dtype (default: bfloat16 on "
                                                "CUDA, float32 on a CPU)")
    p.add_argument("--prompts", type=int, default=16, help="prompts of the exactness check")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fixed-k", type=int, default=7)
    p.add_argument("--samples", type=int, default=2000, help="seeds of the T=1 check")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--users", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    args = p.parse_args(argv)
    if not args.tiny and not (args.model_dir and args.drafter_dir):
        p.error("--model-dir and --drafter-dir (or --tiny)")
    if not args.tiny and args.run != "1" and not args.prompts_file:
        p.error("--prompts-file for run 2")
    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    deadline = time.monotonic() + args.budget_s
    models = Models(args)
    results: dict = {"environment": environment(device)}
    if args.run in ("1", "all"):
        if args.manifest is not None:
            results["digests"] = check_manifest(args.manifest)
        results["smoke (random target of the real shape)"] = smoke(models, device, dtype, args)
        write(results, args.out)
    if args.run in ("2", "all"):
        for name, step in (("(a) exactness", lambda: exactness(models, device, args)),
                           ("(b) T=1 distribution", lambda: distribution(models, device, dtype,
                                                                         args)),
                           ("(c) tokens/s", lambda: speed(models, device, dtype, args, deadline)),
                           ("(d) services in process", lambda: services(models, device, dtype,
                                                                        args))):
            start = time.monotonic()
            try:
                results[name] = step()
            except Exception as e:  # noqa: BLE001 (one failed step must not lose the others)
                results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
            write(results, args.out)
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
