"""The prepared device check: DSpark on one GPU, measured in two runs.

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
      of `--users`, against the embedded engine;
  (e) the attention implementations side by side (bench/attention_backends.py: padded SDPA,
      FlexAttention, the Triton kernel; pass times and the difference from the reference);
  (f) target-only greedy decoding with CUDA graphs (RunnerConfig.cuda_graphs) and without, at 1
      stream and the largest of `--streams`: tokens/s, the ratio, the same tokens or not;
  (g) the drafter's round captured and replayed (DSparkDrafter.use_round_graphs) against the
      eager batched round: the same drafts or not (float32), ms a round each, and DSpark
      `fixed:K` through the engine with the drafter's graphs and without.
Every figure is written with the device name and the torch and CUDA versions beside it:
`--out`/gpu.json and `--out`/gpu.md (docs/results/ when committed).

The payload (scripts/gpu_payload.py): `pack` here writes .gpu/check/part1 and part2, each a folder
one device call carries beside the device tree (scripts/gpu_tree.py `slim`: the checkout without
the tracked files the check does not run); on the machine `run1 --payload .gpu/check/part1`
checks and stashes its part (outside the repository, /tmp/dspark-payload; the drafter joined and
decompressed) and runs the smoke round, and `run2 --payload .gpu/check/part2` stashes the last
part, assembles the target (digests, chunks joined, the GGUF converted, tensors compared) and
runs (a) to (d), (f) and (g); `stash --payload partK` carries a middle part where a payload needs
more than two. docs/gpu.md, "Prepared device check", has the commands;
tests/test_gpu_payload.py rehearses them on the CPU.

Rehearsal on a CPU (`--device cpu --tiny`): the tiny random target and drafter of the tests
(loadtest.tiny_models) stand in for SmolLM2 and the shipped drafter; every step runs, only
smaller. tests/test_gpu_check.py runs it.

Every phase runs under a share of the run's budget (`--budget-s`: 150 s for run1 and 400 s for
run2 on CUDA, inside device calls of 240 and 480 s) and the results are written after each phase,
so a run stopped from outside still returns what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

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
    from importlib.metadata import PackageNotFoundError, version

    # Read from the installed metadata, not by importing: grpc imported here would be the
    # machine's own, before the carried wheels are first on sys.path.
    for key, dist in (("transformers", "transformers"), ("triton", "triton"), ("grpc", "grpcio"),
                      ("protobuf", "protobuf")):
        try:
            env[key] = version(dist)
        except PackageNotFoundError:
            env[key] = None
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
    """Chat-templated prompt ids from a JSONL file of {"prompt": text} (or {"turns": [...]}, or
    their "ids" as `pack` writes them)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tokenizer = None
    out = []
    for record in records:
        if "ids" in record:
            out.append(record["ids"])
        else:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(model_dir)
            out.append(chat_ids(tokenizer, record))
    while len(out) < 64:
        out += out
    return out


def chat_ids(tokenizer, record: dict) -> list[int]:
    text = record.get("prompt") or record.get("turns", [""])[0]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def build(models: Models, device: str, dtype: str, policy: str, max_running: int,
          target_dir: Path | None = None, round_graphs: bool | None = None):
    """The embedded engine; the cost table measured here (never a CPU table on a GPU);
    round_graphs: the drafter's (load_method_drafter; None: on for CUDA)."""
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
    drafter = load_method_drafter(models.drafter, runner, apply_calibration=True,
                                  round_graphs=round_graphs) if use_drafter else None
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


def attention_backends(device: str, args, deadline: float) -> dict:
    """bench/attention_backends.py in a subprocess until `deadline` (its rows so far if stopped):
    per batch shape and backend, the pass time and the largest difference from the reference."""
    small = ["--batches", "1,2", "--new-tokens", "4,1", "--context", "32", "--chunk", "16",
             "--layers", "2", "--repeats", "1"] if args.tiny else ["--repeats", "5"]
    cmd = [sys.executable, "-u", str(REPO / "bench" / "attention_backends.py"), "--device",
           "cuda" if device.startswith("cuda") else "cpu", *small]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              timeout=max(deadline - time.monotonic(), 1.0))
        stdout, ended = proc.stdout, proc.returncode == 0
    except subprocess.TimeoutExpired as stopped:
        stdout, ended = stopped.stdout or "", False
        if isinstance(stdout, bytes):  # TimeoutExpired keeps bytes even under text=True
            stdout = stdout.decode(errors="replace")
    lines = stdout.strip().splitlines()
    if ended and lines:
        summary = json.loads(lines[-1])
        out = {f"{r['batch']} {r['backend']}": (r.get("error") or f"{r['pass_ms']:.3f} ms per pass, "
                                                  f"max |diff| {r['max_diff']:.1e}")
               for r in summary["rows"]}
        return {**out, "fastest": summary["fastest"], "skipped": summary["skipped"]}
    return {"stopped before the end": "\n".join(lines[-40:])}


def graphed_decode(models: Models, device: str, dtype: str, args, deadline: float) -> dict:
    """Target-only greedy decoding through the engine with the decode and verification forwards
    graphed (RunnerConfig.cuda_graphs: CUDA graphs on CUDA, the same static buffers run eagerly
    elsewhere) and without, both with the PADDED attention the graphs need, at 1 stream and the
    largest of `--streams`: tokens/s each, the ratio, and whether the outputs are the same."""
    from dspark.cost_table import CostTable
    from dspark.engine import Engine, EngineConfig
    from dspark.models.drafter_config import DrafterConfig
    from dspark.models.runner import RunnerConfig, TargetRunner
    from dspark.models.transformer import AttentionImpl
    from dspark.verifier import TargetVerifier

    gamma = DrafterConfig.load(models.drafter).block_size
    table = CostTable.from_step_seconds({b: 1.0 for b in (1, 2, 4, 8, 16, 32, 64)})  # unused: no drafts
    rows: dict = {}

    def make_engine(graphs: bool, streams: int):
        runner = TargetRunner(models.target, RunnerConfig(
            device=device, dtype=dtype, kv_cache_tokens=streams * 2048,
            attention=AttentionImpl.PADDED, cuda_graphs=graphs, graph_rows_per_request=gamma + 1))
        return Engine(TargetVerifier(runner), None, table,
                      EngineConfig().with_values(policy="none", max_running=streams))

    for streams, outputs, rates, engines in with_and_without_graphs(make_engine, models, args,
                                                                    deadline, rows):
        for graphs, label in ((False, "eager"), (True, "graphs")):
            rows[f"streams={streams} {label} tokens/s"] = round(rates[graphs], 1)
        rows[f"streams={streams} graphed forwards"] = engines[True].verifier.runner.graphs.forwards
        rows[f"streams={streams} graphs / eager"] = round(rates[True] / rates[False], 3)
        rows[f"streams={streams} same tokens"] = outputs[True] == outputs[False]
    if "stopped" not in rows:
        rows["ok"] = all(v for k, v in rows.items() if k.endswith("same tokens"))
    return rows


def with_and_without_graphs(make_engine, models: Models, args, deadline: float, rows: dict):
    """For 1 stream and the largest of `--streams`: greedy decoding of that many prompts by
    make_engine(False, streams) and make_engine(True, streams), each warmed up (the first
    buckets' graphs captured) and then timed. Yields (streams, {graphs: outputs}, {graphs:
    tokens/s}, {graphs: engine}); once `deadline` has passed, sets rows["stopped"] and ends."""
    for streams in sorted({1, max(args.streams)}):
        prompts = models.prompts[:streams]
        outputs, rates, engines = {}, {}, {}
        for graphs in (False, True):
            if time.monotonic() > deadline:
                rows["stopped"] = "budget spent"
                return
            engine = engines[graphs] = make_engine(graphs, streams)
            generate(engine, prompts, 0.0, 4)
            outputs[graphs], seconds = generate(engine, prompts, 0.0, args.max_tokens)
            rates[graphs] = sum(map(len, outputs[graphs])) / seconds
        yield streams, outputs, rates, engines


def graphed_draft_round(models: Models, device: str, dtype: str, args, deadline: float) -> dict:
    """The drafter's round over its static buffers (DSparkDrafter.use_round_graphs: captured and
    replayed as CUDA graphs on CUDA, run eagerly elsewhere) against the eager BATCHED round.
    Rounds alone, on the same contexts (random target features, 60 to 250 tokens): at 1, 8 and
    the largest of `--streams` requests, greedy and seeded T=1, in float32 with TF32 off the
    same tokens or not and the largest differences of probabilities and confidences, and in
    `dtype` the milliseconds a round each and the ratio. Then DSpark (`fixed:K`) greedy through
    the engine with the drafter's graphs and without, at 1 stream and the largest: tokens/s, the
    ratio, the same tokens or not."""
    from dspark.loading import load_method_drafter, load_target
    from dspark.models.draft_types import DraftRequest
    from dspark.models.drafter import ContextAttention
    from dspark.models.drafter_config import DrafterConfig
    from dspark.sampling import SamplingParams

    config = DrafterConfig.load(models.drafter)
    layers = tuple(config.target_layer_ids)
    sizes = sorted({1, min(8, max(args.streams)), min(64, max(args.streams))})
    rows: dict = {}
    cuda = torch.device(device).type == "cuda"
    reps = 20 if cuda else 2  # rounds timed (a CPU rehearsal only checks that the phase runs)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def drafters(run_dtype: str):
        runner = load_target(models.target, layers, kv_cache_tokens=256, device=device,
                             dtype=run_dtype)
        pair = {}
        for graphs in (False, True):
            d = load_method_drafter(models.drafter, runner, apply_calibration=True,
                                    round_graphs=graphs)
            d.context_attention = ContextAttention.BATCHED
            g = torch.Generator().manual_seed(0)
            width = len(layers) * config.hidden_size
            for i in range(max(sizes)):
                n = 60 + (37 * i) % 190
                d.append_context(i, torch.randn(n, width, generator=g).to(device), torch.arange(n))
            pair[graphs] = d
        return runner, pair

    def requests(count: int, temperature: float, vocab: int):
        return [DraftRequest(i, (7 * i + 3) % vocab, 60 + (37 * i) % 190,
                             SamplingParams(temperature, seed=100 + i)) for i in range(count)]

    with tf32_off():
        runner, pair = drafters("float32")
        vocab = runner.vocab_size
        same_greedy = True
        for count in sizes:
            for temperature in (0.0, 1.0):
                if time.monotonic() > deadline:
                    rows["stopped"] = "budget spent"
                    return rows
                for d in pair.values():  # the first round of a bucket captures its graph
                    d.draft(requests(count, temperature, vocab))
                blocks = {g: d.draft(requests(count, temperature, vocab)) for g, d in pair.items()}
                same = sum(torch.equal(a.tokens, b.tokens) for a, b in zip(blocks[False], blocks[True]))
                probs = max(float((a.dense(vocab) - b.dense(vocab)).abs().max())
                            for a, b in zip(blocks[False], blocks[True]))
                conf = max(float((a.confidences - b.confidences).abs().max())
                           for a, b in zip(blocks[False], blocks[True]))
                key = f"float32 requests={count} T={temperature}"
                rows[f"{key} same tokens"] = f"{same}/{count}"
                rows[f"{key} max |diff| probs, confidences"] = f"{probs:.1e}, {conf:.1e}"
                same_greedy &= temperature > 0 or same == count
        del runner, pair
    rows["ok"] = same_greedy
    runner, pair = drafters(dtype)
    for count in sizes:
        for temperature in (0.0, 1.0):
            if time.monotonic() > deadline:
                rows["stopped"] = "budget spent"
                return rows
            ms = {}
            for graphs, d in pair.items():
                batch = requests(count, temperature, runner.vocab_size)
                d.draft(batch)  # warm-up: the bucket's graph captured
                sync()
                start = time.perf_counter()
                for _ in range(reps):
                    d.draft(batch)
                sync()
                ms[graphs] = (time.perf_counter() - start) / reps * 1e3
            key = f"{dtype} requests={count} T={temperature}"
            rows[f"{key} ms a round eager, graphs"] = f"{ms[False]:.3f}, {ms[True]:.3f}"
            rows[f"{key} eager / graphs"] = round(ms[False] / ms[True], 3)
    rows["graphed buckets"] = len(pair[True].round_graphs.buckets)
    del runner, pair
    policy = f"fixed:{args.fixed_k}"

    def make_engine(graphs: bool, streams: int):
        engine = build(models, device, dtype, policy, streams, round_graphs=graphs)
        engine.drafter.context_attention = ContextAttention.BATCHED
        return engine

    for streams, outputs, rates, _ in with_and_without_graphs(make_engine, models, args,
                                                              deadline, rows):
        key = f"engine {policy} streams={streams}"
        rows[f"{key} tokens/s eager, graphs"] = f"{rates[False]:.1f}, {rates[True]:.1f}"
        rows[f"{key} graphs / eager"] = round(rates[True] / rates[False], 3)
        rows[f"{key} same tokens"] = outputs[True] == outputs[False]
    return rows


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


RUN1_BUDGET_S = 150.0
RUN2_BUDGET_S = 400.0
CPU_REHEARSAL_BUDGET_S = 1800.0
"""The runs' budgets: run 1 inside a 4-minute call, run 2 inside an 8-minute one (the device
tool's timeout_s, 240 and 480), which leaves a 15-minute loan room for the machine's start."""


class PhaseBudgetSpent(BaseException):
    """A phase ran past its share of the run's time budget. A BaseException, so that no
    `except Exception` on the way (the runner's fallback from a CPU kernel that is still being
    built, say) takes it for an ordinary failure and runs on past the budget."""


@contextlib.contextmanager
def budget(seconds: float):
    """Interrupt the phase after `seconds` (SIGALRM: between the device's operations)."""
    def expire(signum, frame):
        raise PhaseBudgetSpent(f"its budget of {seconds:.0f} s was spent")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_phases(results: dict, phases: list, out: Path | list[Path], total_s: float) -> None:
    """Each (name, share of `total_s`, step) in turn under its budget; the results written after
    every phase, so that a run stopped from outside still leaves what it measured in `out`."""
    timings = results.setdefault("phases (seconds, budget)", {})
    for name, share, step in phases:
        start = time.monotonic()
        try:
            with budget(share * total_s):
                results[name] = step(start + 0.8 * share * total_s)
        # One failed or stopped step must not lose the others.
        except (Exception, PhaseBudgetSpent) as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        timings[name] = f"{time.monotonic() - start:.0f} / {share * total_s:.0f}"
        print(f"{name}: {timings[name]} s", file=sys.stderr, flush=True)
        for folder in out if isinstance(out, list) else [out]:
            write(results, folder)


def parser() -> argparse.ArgumentParser:
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
    p.add_argument("--budget-s", type=float, default=None,
                   help="the run's time budget, shared among its phases (default on CUDA: "
                        f"{RUN1_BUDGET_S:.0f} s for run1, {RUN2_BUDGET_S:.0f} s for run2 and "
                        f"--run; {CPU_REHEARSAL_BUDGET_S:.0f} s on a CPU)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    p.add_argument("--payload", type=Path, default=None,
                   help="run1/run2: this call's part of the payload (`pack`'s .gpu/check/partN)")
    p.add_argument("--no-wheels", action="store_true",
                   help="run1/run2: install none of the carried wheels (a CPU rehearsal whose "
                        "python has the packages and is not the device's 3.12)")
    p.add_argument("--stash", type=Path, default=None,
                   help="run1/run2: where the parts gather on the machine (/tmp/dspark-payload)")
    return p


def pack_main(argv: list[str]) -> int:
    """`gpu_check.py pack`: the payload's parts for the device calls (scripts/gpu_payload.py)."""
    import gpu_payload as gp

    from dspark.fetch import default_model_dir
    from dspark.paths import EVAL_PROMPTS_DIR

    p = argparse.ArgumentParser(prog="gpu_check.py pack", description=gp.__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / ".gpu" / "check")
    p.add_argument("--target-dir", type=Path, default=None,
                   help="the prepared target (`dspark fetch-model`'s folder)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the target's GGUF (default: the .gguf in --target-dir, else the one "
                        "`dspark fetch-model` downloads)")
    p.add_argument("--safetensors", action="store_true",
                   help="carry --target-dir's model.safetensors instead of a GGUF")
    p.add_argument("--drafter-dir", type=Path, default=REPO / "checkpoints" / "dspark-markov")
    p.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="JSONL of {'turns': [...]} instead of --eval-dir's sets")
    p.add_argument("--per-set", type=int, default=16, help="prompts of each eval set")
    p.add_argument("--wheels-dir", type=Path, default=REPO / ".gpu" / "wheels",
                   help="where the wheels for python 3.12 are downloaded (once)")
    p.add_argument("--wheel", action="append", default=None,
                   help="a package the GPU machine lacks, at this venv's version (default: "
                        f"{', '.join(MISSING_ON_DEVICE)})")
    p.add_argument("--chunk-mib", type=float, default=1.0)
    p.add_argument("--limit-mib", type=float, default=64.0)
    p.add_argument("--tracked-bytes", type=int, default=None,
                   help="the bytes every call carries besides its part (default: the device "
                        "tree's, scripts/gpu_tree.py bytes --slim)")
    p.add_argument("--compress-min-saving", type=float, default=None,
                   help="a .safetensors file travels xz-compressed when that saves at least this "
                        "fraction (default 0.1)")
    args = p.parse_args(argv)
    target = args.target_dir or default_model_dir("smollm2-135m-instruct")
    gguf = None
    wheels: list[Path] = []
    if not args.safetensors:
        gguf = args.gguf or next(iter(sorted(target.glob("*.gguf"))), None)
        if gguf is None:
            from dspark.fetch import SOURCES, _download_gguf

            work = REPO / ".gpu" / "gguf"
            work.mkdir(parents=True, exist_ok=True)
            gguf = _download_gguf(SOURCES["smollm2-135m-instruct"], work)
        wheels = device_wheels(args.wheels_dir, args.wheel or MISSING_ON_DEVICE)
    if args.prompts_file:
        prompts = [json.loads(x) for x in args.prompts_file.read_text().splitlines() if x.strip()]
    else:
        prompts = gp.eval_prompts(args.eval_dir, args.per_set)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [{**r, "ids": r.get("ids") or chat_ids(tokenizer, r)} for r in prompts]
    tracked = gp.device_tree_bytes() if args.tracked_bytes is None else args.tracked_bytes
    limit = int(args.limit_mib * gp.MIB)
    weights = gguf or target / "model.safetensors"
    print(f"limit {limit:,} bytes; the device tree {tracked:,} bytes; "
          f"the target's weights {weights.name} {weights.stat().st_size:,} bytes", file=sys.stderr)
    try:
        manifest = gp.pack(args.out, target, args.drafter_dir, prompts, gguf=gguf, wheels=wheels,
                           chunk_bytes=int(args.chunk_mib * gp.MIB), limit_bytes=limit,
                           tracked=tracked, compress_min_saving=gp.COMPRESS_MIN_SAVING
                           if args.compress_min_saving is None else args.compress_min_saving)
    except gp.PayloadError as e:
        print(f"pack: {e}", file=sys.stderr)
        return 2
    print(json.dumps(manifest["sizes"], indent=1))
    return 0 if manifest["sizes"]["fits"] else 2


MISSING_ON_DEVICE = ("gguf", "grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection",
                     "opentelemetry-api", "opentelemetry-sdk",
                     "opentelemetry-semantic-conventions", "dill")
"""What the device check imports that the GPU machine's image lacks (docs/.library KINDS list:
no gguf, grpcio health / reflection or OpenTelemetry), with grpcio and protobuf at the versions
the committed stubs in dspark/v1 were generated for (the image's may be older); their other needs
(typing-extensions, setuptools) are there. grpcio-tools stays behind: it only regenerates the
stubs (dspark/serving/protos.py), which the device never does."""


def device_wheels(folder: Path, names) -> list[Path]:
    """Each package at this venv's version as a python 3.12 manylinux wheel, downloaded once."""
    from importlib.metadata import version

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        pin = f"{name}=={version(name)}"
        stem = f"{name.replace('-', '_')}-{version(name)}-"
        found = [w for w in folder.glob("*.whl") if w.name.lower().startswith(stem.lower())]
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                            "cp", *[a for plat in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                   "manylinux2014_x86_64")
                                    for a in ("--platform", plat)],
                            "-d", str(folder), pin], check=True)
            found = [w for w in folder.glob("*.whl") if w.name.lower().startswith(stem.lower())]
        if not found:
            raise SystemExit(f"pack: no python 3.12 wheel of {pin}")
        out.append(found[0])
    return out


def device_run(which: str, argv: list[str]) -> int:
    """`run1` / `stash` / `run2 --payload PART`: this call's part stashed and checked; run 1 then
    a smoke round on a random target of the real shape, run 2 the target assembled and the
    checks (`stash` alone for the parts between)."""
    import gpu_payload as gp

    args = parser().parse_args(argv)
    if args.payload is None:
        raise SystemExit(f"{which}: --payload .gpu/check/partN")
    stash_dir = args.stash or gp.DEFAULT_STASH
    device = resolve_device(args.device)
    total = args.budget_s or (RUN1_BUDGET_S if which == "run1" else RUN2_BUDGET_S)
    if not device.startswith("cuda"):
        total = args.budget_s or CPU_REHEARSAL_BUDGET_S
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    results: dict = {"environment": environment(device)}
    earlier = stash_dir / "results" / "gpu.json"  # run 1's results, kept on the machine
    if which == "run2" and earlier.is_file():
        results.update({k: v for k, v in json.loads(earlier.read_text()).items()
                        if k not in ("environment", "phases (seconds, budget)")})
    outs = [args.out] + ([stash_dir / "results"] if which == "run1" else [])
    write(results, args.out)
    state: dict = {}

    def stash(deadline):
        return gp.stash(args.payload, stash_dir)

    def models_from(target: Path, drafter: Path):
        args.model_dir, args.drafter_dir = str(target), str(drafter)
        args.prompts_file, args.tiny = str(stash_dir / "prompts.jsonl"), False
        return Models(args)

    if which == "stash":  # a part between the first and the last: only carried and checked
        phases = [(f"payload {args.payload.name}", 1.0, stash)]
    elif which == "run1":
        def repo_files(deadline):
            manifest = json.loads((stash_dir / "MANIFEST.json").read_text())
            bad = gp.verify_repo_files(manifest)
            return {"files": len(manifest["repo_files"]), "mismatched": bad, "ok": not bad}

        def smoke_round(deadline):
            manifest = json.loads((stash_dir / "MANIFEST.json").read_text())
            drafter = stash_dir / "drafter" if manifest["drafter"] == "drafter" \
                else REPO / manifest["drafter"]
            return smoke(models_from(stash_dir / "target", drafter), device, dtype, args)

        def packages(deadline):
            out = gp.install_wheels(stash_dir, not args.no_wheels)
            import grpc
            import google.protobuf
            import opentelemetry.sdk  # noqa: F401
            from services.drafter.main import build_servicer as _d  # noqa: F401
            from services.verifier.main import build_servicer as _v  # noqa: F401

            out.update(grpc=grpc.__version__, protobuf=google.protobuf.__version__,
                       services="imported")
            return out

        phases = [(f"payload {args.payload.name}", 0.25, stash),
                  ("repository files", 0.05, repo_files),
                  ("packages", 0.15, packages),
                  ("smoke (random target of the real shape)", 0.55, smoke_round)]
    else:
        def assemble(deadline):
            state.update(gp.assemble(stash_dir, install=not args.no_wheels))
            state["models"] = models_from(Path(state["target_dir"]), Path(state["drafter_dir"]))
            return {k: v for k, v in state.items() if k != "models"}

        def need_models():
            if "models" not in state:
                raise RuntimeError("the payload was not assembled")
            return state["models"]

        def stash_and_install(deadline):
            out = gp.stash(args.payload, stash_dir)
            out["packages"] = gp.install_wheels(stash_dir, not args.no_wheels)["wheels"]
            return out

        phases = [(f"payload {args.payload.name}", 0.05, stash_and_install),
                  ("payload assembled", 0.2, assemble),
                  ("(a) exactness", 0.16, lambda d: exactness(need_models(), device, args)),
                  ("(b) T=1 distribution", 0.1,
                   lambda d: distribution(need_models(), device, dtype, args)),
                  ("(c) tokens/s", 0.22, lambda d: speed(need_models(), device, dtype, args, d)),
                  ("(d) services in process", 0.15,
                   lambda d: services(need_models(), device, dtype, args)),
                  ("(f) graphed decode", 0.06,
                   lambda d: graphed_decode(need_models(), device, dtype, args, d)),
                  ("(g) graphed drafter round", 0.06,
                   lambda d: graphed_draft_round(need_models(), device, dtype, args, d))]
    run_phases(results, phases, outs, total)
    results["environment"] = environment(device)  # with the carried wheels' versions
    for folder in outs:
        write(results, folder)
    failed = [k for k, v in results.items()
              if isinstance(v, dict) and ("error" in v or v.get("ok") is False)]
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "pack":
        return pack_main(argv[1:])
    if argv and argv[0] in ("run1", "stash", "run2"):
        return device_run(argv[0], argv[1:])
    p = parser()
    args = p.parse_args(argv)
    if not args.tiny and not (args.model_dir and args.drafter_dir):
        p.error("--model-dir and --drafter-dir (or --tiny)")
    if not args.tiny and args.run != "1" and not args.prompts_file:
        p.error("--prompts-file for run 2")
    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    total = args.budget_s or (RUN2_BUDGET_S if device.startswith("cuda")
                              else CPU_REHEARSAL_BUDGET_S)
    models = Models(args)
    results: dict = {"environment": environment(device)}
    phases = []
    if args.run in ("1", "all"):
        if args.manifest is not None:
            phases.append(("digests", 0.1, lambda d: check_manifest(args.manifest)))
        phases.append(("smoke (random target of the real shape)", 0.2,
                       lambda d: smoke(models, device, dtype, args)))
    if args.run in ("2", "all"):
        phases += [("(a) exactness", 0.2, lambda d: exactness(models, device, args)),
                   ("(b) T=1 distribution", 0.1, lambda d: distribution(models, device, dtype,
                                                                         args)),
                   ("(c) tokens/s", 0.3, lambda d: speed(models, device, dtype, args, d)),
                   ("(d) services in process", 0.15, lambda d: services(models, device, dtype,
                                                                        args)),
                   ("(e) attention backends", 0.1, lambda d: attention_backends(device, args, d)),
                   ("(f) graphed decode", 0.1, lambda d: graphed_decode(models, device, dtype,
                                                                        args, d)),
                   ("(g) graphed drafter round", 0.05,
                    lambda d: graphed_draft_round(models, device, dtype, args, d))]
    run_phases(results, phases, args.out, total)
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
