"""The services stack (verifier, drafter, scheduler as processes, gRPC between them) against the
embedded engine (the same components in one process), at 1, 8 and 16 concurrent streams.

Both sides run the same Engine loop with the same target, drafter, admission policy and cost
table; only the transport differs. For each stream count, the embedded engine generates greedy
`--new-tokens` tokens for every stream (all submitted at once), then the stack does the same
through gRPC `Generate` (one client thread per stream). Throughput = output tokens of all streams
/ wall time; per-user speed = a stream's tokens after its first / time from its first token to
its last (median over streams). Ratios services/embedded are measured in the same run (docs/design.md
section 9); the goal is >= 0.8 throughput at 16 streams. The "same" column checks that
every stream's greedy tokens are identical on both sides.

Prints a markdown table and ends with one JSON line. Usage:
    .venv/bin/python bench/services.py [--tiny] [--streams 1,8,16] [--new-tokens 64]
        [--model-dir DIR] [--drafter-dir DIR] [--policy async_topk] [--dtype float32] [--device auto|cpu|cuda[:N]]
`--tiny` uses a tiny random model (seconds; checks the plumbing, not the real overheads).
The stack is also measured with two cohorts (`--cohorts 2`: one cohort drafts while the other
verifies); "overlap gain" = its throughput / the one-cohort stack's.

`--gateway-baseline REF` compares REST gateways instead: the scheduler of git revision REF (its
tree exported with `git archive`, run with PYTHONSAFEPATH so it imports only that tree) and this
tree's scheduler, over the same verifier and drafter, take turns serving `--streams` concurrent
streamed completions (`--repeats` times each, alternating). Reported per gateway: throughput
(output tokens / wall time) and time to first token (median and p90 over streams), medians over
the repeats; "same" checks both returned identical greedy tokens.
    .venv/bin/python bench/services.py --tiny --gateway-baseline <commit> --streams 16,64
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from dspark.devices import add_device_argument, resolve_device

# Run by path: this checkout's packages come first on sys.path, before dspark (and so
# dspark.paths.REPO_ROOT) can be imported, hence its own path here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.paths import REPO_ROOT  # noqa: E402
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
    from dspark.engine import AdmissionConfig, BatchingConfig, EngineConfig
    from dspark.loading import build_engine, load_method_drafter, load_target
    from dspark.models.drafter_config import DrafterConfig
    from dspark.sampling import SamplingParams
    from dspark.verifier import TargetVerifier

    layers = tuple(DrafterConfig.load(models["drafter"]).target_layer_ids) if models["drafter"] else ()
    runner = load_target(models["target"], layers, kv_cache_tokens=65536, dtype=args.dtype,
                         device=resolve_device(args.device))
    drafter = load_method_drafter(models["drafter"], runner, apply_calibration=True) \
        if models["drafter"] else None
    engine = build_engine(TargetVerifier(runner), drafter, CostTable.load(table_path),
                          EngineConfig(AdmissionConfig(policy=args.policy),
                                       batching=BatchingConfig(max_running=args.max_running)))
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


def run_together(n: int, one, go: threading.Barrier) -> float:
    """`one(i)` for i < n, each in its own thread, all released at once through `go` (n + 1
    parties); returns the release time once all have finished."""
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return t0


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

    t0 = run_together(n, one, go)
    return summarize([t0] * n, first, end, [len(t) for t in tokens], t0), tokens


def run_rest(http_port: int, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list]:
    """Every prompt as a streamed greedy completion through the REST API at once (a thread per
    stream); throughput and per-stream time to first token."""
    n = len(prompts)
    first, end, tokens = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
    go = threading.Barrier(n + 1)

    def one(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=3600)
        body = json.dumps({"model": "dspark", "prompt": prompts[i], "max_tokens": new_tokens,
                           "temperature": 0, "stream": True})
        go.wait()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        for line in reply:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            ids = json.loads(line[len(b"data: "):])["dspark"]["token_ids"]
            now = time.perf_counter()
            if ids and not first[i]:
                first[i] = now
            tokens[i] += ids
            end[i] = now
        conn.close()

    t0 = run_together(n, one, go)
    stats = summarize([t0] * n, first, end, [len(t) for t in tokens], t0)
    ttft = sorted(f - t0 for f in first)
    stats.update(ttft_median=statistics.median(ttft), ttft_p90=ttft[int(0.9 * (n - 1))])
    return stats, tokens


def export_tree(ref: str, into: Path) -> Path:
    """REF's tracked files under `into`, with its gRPC stubs generated."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", ref, "dspark", "services",
                              "protos"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "dspark.serving.protos"], cwd=into, check=True,
                   env={**os.environ, "PYTHONPATH": str(into), "PYTHONSAFEPATH": "1"},
                   capture_output=True)
    return into


def compare_gateways(args, models, table_path: Path, work: Path, tokenizer) -> list[dict]:
    """REST throughput and TTFT of REF's scheduler and this tree's, over the same services."""
    baseline_tree = export_tree(args.gateway_baseline, work / "baseline")
    procs, _, services = start_stack(args, models, table_path, work, cohort_counts=())
    ports = {}
    try:
        for name, env in (("baseline", {"PYTHONPATH": str(baseline_tree), "PYTHONSAFEPATH": "1"}),
                          ("current", {})):
            h_port = free_port()
            scheduler = ServiceProcess(f"scheduler_{name}", [
                "services.scheduler", "--http-port", str(h_port), "--grpc-port", str(free_port()),
                "--verifier", services["verifier"], "--drafter", services["drafter"],
                "--model-dir", str(models["target"]), "--policy", args.policy,
                "--max-running", str(args.max_running), "--max-tokens-limit",
                str(args.new_tokens)], work, env=env).start()
            procs.append(scheduler)
            wait_http(scheduler, h_port)
            ports[name] = h_port
        rows = []
        for n in [int(s) for s in args.streams.split(",")]:
            prompts = prompts_for(tokenizer, n, args.tiny)
            runs = {"baseline": [], "current": []}
            outputs = {}
            for _ in range(args.repeats):
                for name in ("baseline", "current"):  # alternating: drift hits both alike
                    stats, tokens = run_rest(ports[name], prompts, args.new_tokens)
                    runs[name].append(stats)
                    outputs.setdefault(name, tokens)
            row = {"streams": n, "same_tokens": outputs["baseline"] == outputs["current"]}
            for name, stats in runs.items():
                row[name] = {k: statistics.median(s[k] for s in stats)
                             for k in ("throughput", "ttft_median", "ttft_p90", "per_user")}
                row[name]["throughput_runs"] = [s["throughput"] for s in stats]
            row["throughput_ratio"] = row["current"]["throughput"] / row["baseline"]["throughput"]
            row["ttft_ratio"] = row["current"]["ttft_median"] / row["baseline"]["ttft_median"]
            rows.append(row)
    finally:
        for p in reversed(procs):
            p.stop()
    print(f"\nREST gateway: this tree vs {args.gateway_baseline} "
          f"({'tiny random model' if args.tiny else models['target'].name}, policy {args.policy}, "
          f"{args.new_tokens} tokens/stream, medians of {args.repeats} alternating runs)\n")
    print("| streams | baseline tok/s | current tok/s | ratio | baseline TTFT p50 / p90 ms | "
          "current TTFT p50 / p90 ms | TTFT ratio | same |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, c = r["baseline"], r["current"]
        print(f"| {r['streams']} | {b['throughput']:.1f} | {c['throughput']:.1f} | "
              f"{r['throughput_ratio']:.3f} | {1e3 * b['ttft_median']:.0f} / {1e3 * b['ttft_p90']:.0f} | "
              f"{1e3 * c['ttft_median']:.0f} / {1e3 * c['ttft_p90']:.0f} | {r['ttft_ratio']:.3f} | "
              f"{'yes' if r['same_tokens'] else 'NO'} |")
    return rows


def start_stack(args, models, table_path: Path, log_dir: Path, cohort_counts=(1, 2)
                ) -> tuple[list[ServiceProcess], dict[int, int], dict[str, str]]:
    """Verifier, drafter, and one scheduler per cohort count (1 and 2) over the same services;
    returns the processes, {cohorts: gRPC port} and the scheduler's --verifier / --drafter."""
    v_port, d_port = free_port(), free_port()
    common = ["--dtype", args.dtype, "--threads", str(args.threads), "--device", args.device]
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
    services = {"verifier": f"127.0.0.1:{v_port}",
                "drafter": f"127.0.0.1:{d_port}" if models["drafter"] else ""}
    ports = {}
    for cohorts in cohort_counts:
        h_port, g_port = free_port(), free_port()
        scheduler = ServiceProcess(f"scheduler_{cohorts}", [
            "services.scheduler", "--http-port", str(h_port), "--grpc-port", str(g_port),
            "--verifier", services["verifier"], "--drafter", services["drafter"],
            "--model-dir", str(models["target"]), "--policy", args.policy,
            "--cohorts", str(cohorts), "--max-running", str(args.max_running),
            "--max-tokens-limit", str(args.new_tokens)], log_dir).start()
        procs.append(scheduler)
        wait_http(scheduler, h_port)
        ports[cohorts] = g_port
    return procs, ports, services


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random model (plumbing check)")
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--drafter-dir", default="", help="'none' = target only")
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--policy", default="async_topk")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_device_argument(parser, help_suffix=" (the embedded engine and both services)")
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--gateway-baseline", default="",
                        help="git revision whose REST gateway to compare with this tree's "
                             "(instead of the embedded comparison)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternating runs per gateway and stream count")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="dspark-bench-services-"))
    if args.tiny:
        from loadtest.tiny_models import build_tiny_models

        tiny = build_tiny_models(work / "tiny")
        models = {"target": tiny.target_dir, "drafter": tiny.drafter_dir}
        table_path = tiny.cost_table
    else:
        from dspark.drafter_choice import drafter_dir_or_shipped
        from dspark.loading import load_target
        from dspark.fetch import ensure_model
        from dspark.step_timing import startup_cost_table

        target = Path(args.model_dir) if args.model_dir else ensure_model()
        models = {"target": target, "drafter": drafter_dir_or_shipped(args.drafter_dir)}
        table_path = work / "cost_table.json"
        startup_cost_table(load_target(target, (), kv_cache_tokens=4096, dtype=args.dtype,
                                       device=resolve_device(args.device))).save(table_path)
    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    if args.gateway_baseline:
        rows = compare_gateways(args, models, table_path, work, tokenizer)
        print(json.dumps({"bench": "services_gateway", "tiny": args.tiny,
                          "baseline": args.gateway_baseline, "policy": args.policy,
                          "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows,
                          "at_least_equal": all(r["throughput_ratio"] >= 1.0 for r in rows)}))
        return 0
    streams = [int(s) for s in args.streams.split(",")]
    procs, grpc_ports, _ = start_stack(args, models, table_path, work)
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
