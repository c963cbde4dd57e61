"""The services stack (verifier, drafter, scheduler as processes, gRPC between them) against the
embedded engine (the same components in one process), at 1, 8 and 16 concurrent streams.

Both sides run the same Engine loop with the same target, drafter, admission policy and cost
table; only the transport differs. For each stream count, the embedded engine generates greedy
`--new-tokens` tokens for every stream (all submitted at once), then the stack does the same
through gRPC `Generate` (one client thread per stream). Throughput = output tokens of all streams
/ wall time; per-user speed = a stream's tokens after its first / time from its first token to
its last (median over streams). Ratios services/embedded are measured in the same run (DESIGN.md
section 9); the goal is >= 0.8 throughput at 16 streams. The "same" column checks that
every stream's greedy tokens are identical on both sides.

Prints a markdown table and ends with one JSON line. Usage:
    .venv/bin/python bench/services.py [--tiny] [--streams 1,8,16] [--new-tokens 64]
        [--model-dir DIR] [--drafter-dir DIR] [--policy async_topk] [--dtype float32]
`--tiny` uses a tiny random model (seconds; checks the plumbing, not the real overheads).
The stack is also measured with two cohorts (`--cohorts 2`: one cohort drafts while the other
verifies); "overlap gain" = its throughput / the one-cohort stack's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dspark.serving.local_stack import ServiceProcess, free_port, wait_grpc, wait_http  # noqa: E402

GOAL_RATIO_AT_16 = 0.8


def prompts_for(tokenizer, count: int, tiny: bool) -> list[list[int]]:
    if tiny:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(4, 64, (8 + i % 5,), generator=g).tolist() for i in range(count)]
    topics = ["the history of tea", "how rainbows form", "a recipe for bread", "why the sky is blue",
              "the rules of chess", "how a bicycle works", "the water cycle", "volcanoes"]
    texts = [f"Write a short paragraph about {topics[i % len(topics)]}." for i in range(count)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                          add_generation_prompt=True, return_dict=True)["input_ids"]
            for t in texts]


def summarize(starts: list[float], firsts: list[float], ends: list[float], counts: list[int],
              t0: float) -> dict:
    wall = max(ends) - t0
    per_user = [(n - 1) / (e - f) for n, f, e in zip(counts, firsts, ends) if n > 1 and e > f]
    return {"throughput": sum(counts) / wall, "per_user": statistics.median(per_user or [0.0]),
            "seconds": wall}


def run_embedded(args, models, prompts: list[list[int]], table_path: Path) -> tuple[dict, list]:
    from dspark.cost_table import CostTable
    from dspark.engine import Engine, EngineConfig
    from dspark.evaluation.loading import load_method_drafter, load_target
    from dspark.models.drafter_config import DrafterConfig
    from dspark.sampling import SamplingParams
    from dspark.verifier import TargetVerifier

    layers = tuple(DrafterConfig.load(models["drafter"]).target_layer_ids) if models["drafter"] else ()
    runner = load_target(models["target"], layers, kv_cache_tokens=65536, dtype=args.dtype)
    drafter = load_method_drafter(models["drafter"], runner, apply_calibration=True) \
        if models["drafter"] else None
    engine = Engine(TargetVerifier(runner), drafter, CostTable.load(table_path),
                    EngineConfig(policy=args.policy, max_running=args.max_running))
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(temperature=0), args.new_tokens) for p in prompts]
    first, end, tokens = {}, {}, {i: [] for i in ids}
    for out in engine.stream():
        now = time.perf_counter()
        first.setdefault(out.request_id, now)
        tokens[out.request_id] += out.new_token_ids
        if out.finished:
            end[out.request_id] = now
    stats = summarize([t0] * len(ids), [first[i] for i in ids], [end[i] for i in ids],
                      [len(tokens[i]) for i in ids], t0)
    return stats, [tokens[i] for i in ids]


def run_services(grpc_port: int, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list]:
    from dspark.serving.grpc_runtime import channel
    from dspark.serving.protos import pb, rpc

    stub = rpc.generation.GenerationStub(channel(f"127.0.0.1:{grpc_port}"))
    n = len(prompts)
    first, end, tokens = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
    go = threading.Barrier(n + 1)

    def one(i: int) -> None:
        request = pb.generation.GenerateRequest(model="dspark", prompt_token_ids=prompts[i],
                                                max_tokens=new_tokens,
                                                sampling=pb.common.SamplingParams(temperature=0))
        go.wait()
        for reply in stub.Generate(request, timeout=3600):
            now = time.perf_counter()
            if not first[i]:
                first[i] = now
            tokens[i] += list(reply.token_ids)
            end[i] = now

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return summarize([t0] * n, first, end, [len(t) for t in tokens], t0), tokens


def start_stack(args, models, table_path: Path, log_dir: Path
                ) -> tuple[list[ServiceProcess], dict[int, int]]:
    """Verifier, drafter, and one scheduler per cohort count (1 and 2) over the same services;
    returns the processes and {cohorts: gRPC port}."""
    v_port, d_port = free_port(), free_port()
    common = ["--dtype", args.dtype, "--threads", str(args.threads)]
    procs = []
    verifier = ServiceProcess("verifier", [
        "services.verifier", "--port", str(v_port), "--model-dir", str(models["target"]),
        "--cost-table", str(table_path), "--kv-cache-tokens", "65536", *common,
        *(["--drafter-dir", str(models["drafter"])] if models["drafter"]
          else ["--hidden-layer-ids", "none"])], log_dir).start()
    procs.append(verifier)
    wait_grpc(verifier, f"127.0.0.1:{v_port}")
    if models["drafter"]:
        drafter = ServiceProcess("drafter", [
            "services.drafter", "--port", str(d_port), "--model-dir", str(models["target"]),
            "--drafter-dir", str(models["drafter"]), *common], log_dir).start()
        procs.append(drafter)
        wait_grpc(drafter, f"127.0.0.1:{d_port}")
    ports = {}
    for cohorts in (1, 2):
        h_port, g_port = free_port(), free_port()
        scheduler = ServiceProcess(f"scheduler_{cohorts}", [
            "services.scheduler", "--http-port", str(h_port), "--grpc-port", str(g_port),
            "--verifier", f"127.0.0.1:{v_port}",
            "--drafter", f"127.0.0.1:{d_port}" if models["drafter"] else "",
            "--model-dir", str(models["target"]), "--policy", args.policy,
            "--cohorts", str(cohorts), "--max-running", str(args.max_running),
            "--max-tokens-limit", str(args.new_tokens)], log_dir).start()
        procs.append(scheduler)
        wait_http(scheduler, h_port)
        ports[cohorts] = g_port
    return procs, ports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random model (plumbing check)")
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--drafter-dir", default="", help="'none' = target only")
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--policy", default="async_topk")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="dspark-bench-services-"))
    if args.tiny:
        from dspark.serving.tiny_models import build_tiny_models

        tiny = build_tiny_models(work / "tiny")
        models = {"target": tiny.target_dir, "drafter": tiny.drafter_dir}
        table_path = tiny.cost_table
    else:
        from dspark.evaluation.loading import load_target
        from dspark.fetch import ensure_model
        from dspark.generate import DEFAULT_DRAFTER, startup_cost_table

        target = Path(args.model_dir) if args.model_dir else ensure_model()
        drafter = args.drafter_dir or (str(DEFAULT_DRAFTER) if DEFAULT_DRAFTER.is_dir() else "")
        models = {"target": target, "drafter": None if drafter in ("", "none") else Path(drafter)}
        table_path = work / "cost_table.json"
        startup_cost_table(load_target(target, (), kv_cache_tokens=4096, dtype=args.dtype)).save(
            table_path)
    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    streams = [int(s) for s in args.streams.split(",")]
    procs, grpc_ports = start_stack(args, models, table_path, work)
    rows = []
    try:
        for n in streams:
            prompts = prompts_for(tokenizer, n, args.tiny)
            emb, emb_tokens = run_embedded(args, models, prompts, table_path)
            svc, svc_tokens = run_services(grpc_ports[1], prompts, args.new_tokens)
            two, two_tokens = run_services(grpc_ports[2], prompts, args.new_tokens)
            rows.append({"streams": n, "embedded": emb, "services": svc, "services_2_cohorts": two,
                         "throughput_ratio": svc["throughput"] / emb["throughput"],
                         "per_user_ratio": svc["per_user"] / emb["per_user"] if emb["per_user"] else 0,
                         "overlap_gain": two["throughput"] / svc["throughput"],
                         "same_tokens": emb_tokens == svc_tokens == two_tokens})
    finally:
        for p in reversed(procs):
            p.stop()

    print(f"\nservices stack vs embedded engine ({'tiny random model' if args.tiny else models['target'].name}, "
          f"drafter {models['drafter'].name if models['drafter'] else 'none'}, policy {args.policy}, "
          f"{args.new_tokens} tokens/stream, {args.dtype})\n")
    print("| streams | embedded tok/s | services tok/s | ratio | embedded per-user | "
          "services per-user | ratio | 2 cohorts tok/s | overlap gain | same |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, s, t = r["embedded"], r["services"], r["services_2_cohorts"]
        print(f"| {r['streams']} | {e['throughput']:.1f} | {s['throughput']:.1f} | "
              f"{r['throughput_ratio']:.2f} | {e['per_user']:.1f} | {s['per_user']:.1f} | "
              f"{r['per_user_ratio']:.2f} | {t['throughput']:.1f} | {r['overlap_gain']:.2f} | "
              f"{'yes' if r['same_tokens'] else 'NO'} |")
    at16 = [r["throughput_ratio"] for r in rows if r["streams"] == 16]
    print(json.dumps({"bench": "services", "tiny": args.tiny, "policy": args.policy,
                      "new_tokens": args.new_tokens, "rows": rows,
                      "goal_ratio_at_16": GOAL_RATIO_AT_16,
                      "meets_goal": bool(at16 and at16[0] >= GOAL_RATIO_AT_16)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
