"""Acceptance of json_schema requests through the services, with the drafter service of an older
checkout (whose drafts the grammar does not reach) against this tree's (which masks them):
tau per request, the same greedy tokens.

Two whole stacks (verifier, drafter, scheduler as processes on loopback; the shipped target and
drafter), alike but for the drafter service: the baseline's runs from `--baseline-tree` (a
checkout of an older revision, imported alone with PYTHONSAFEPATH), the other from this tree.
Every round verifies the whole block (`--policy fixed:7`), so tau measures acceptance only.
The prompts and schema are bench/draft_processing.py's json_schema case, sent one at a time
to each stack in turn (chat completions, greedy); tau = (rounds + accepted drafts) / rounds
over the requests, from each response's `dspark.spec_decode`.

Prints a markdown table and ends with one JSON line. Usage:
    .venv/bin/python bench/draft_processing_services.py --baseline-tree /path/to/old/checkout \
        [--limit 8] [--max-tokens 96] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from dspark.cpu_info import cpu_line
from dspark.serving.local_stack import ServiceProcess, free_port, wait_grpc, wait_http

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_processing import PERSON_PROMPTS, SCHEMA  # noqa: E402


def start_stack(name: str, log_dir: Path, drafter_env: dict[str, str], policy: str,
                threads: int) -> tuple[list[ServiceProcess], int]:
    """(processes, the scheduler's HTTP port) of one stack; the drafter runs with
    `drafter_env` (the baseline's: its tree alone on the import path)."""
    verifier_port, drafter_port, http_port, grpc_port = (free_port() for _ in range(4))
    common = ["--threads", str(threads)]
    verifier = ServiceProcess(f"{name}_verifier", ["services.verifier", "--port",
                                                   str(verifier_port), *common],
                              log_dir=log_dir).start()
    drafter = ServiceProcess(f"{name}_drafter", ["services.drafter", "--port", str(drafter_port),
                                                 *common], log_dir=log_dir,
                             env=drafter_env).start()
    procs = [verifier, drafter]
    wait_grpc(verifier, f"127.0.0.1:{verifier_port}", timeout=900)
    wait_grpc(drafter, f"127.0.0.1:{drafter_port}", timeout=900)
    scheduler = ServiceProcess(f"{name}_scheduler", [
        "services.scheduler", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--verifier", f"127.0.0.1:{verifier_port}", "--drafter", f"127.0.0.1:{drafter_port}",
        "--policy", policy, "--update-cost-table", "false"], log_dir=log_dir).start()
    procs.append(scheduler)
    wait_http(scheduler, http_port, timeout=900)
    return procs, http_port


def complete(port: int, prompt: str, max_tokens: int) -> dict:
    body = {"model": "dspark", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": SCHEMA}}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as r:
        return json.loads(r.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, required=True,
                        help="checkout whose drafter service is the baseline")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--policy", default="fixed:7")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    base = args.baseline_tree.resolve()
    revision = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or "?"
    prompts = PERSON_PROMPTS[:args.limit]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stacks = {}
        try:
            stacks["baseline"] = start_stack("baseline", Path(tmp), {
                "PYTHONPATH": str(base), "PYTHONSAFEPATH": "1"}, args.policy, args.threads)
            stacks["masked"] = start_stack("masked", Path(tmp), {}, args.policy, args.threads)
            outputs: dict[str, list[list[int]]] = {name: [] for name in stacks}
            totals = {name: {"rounds": 0, "accepted": 0, "tokens": 0} for name in stacks}
            for prompt in prompts:
                for name, (_, port) in stacks.items():
                    body = complete(port, prompt, args.max_tokens)
                    extras = body["dspark"]
                    metrics = extras["spec_decode"]
                    totals[name]["rounds"] += metrics["rounds"]
                    totals[name]["accepted"] += metrics["drafts_accepted"]
                    totals[name]["tokens"] += len(extras["token_ids"])
                    outputs[name].append(extras["token_ids"])
        finally:
            for procs, _ in stacks.values():
                for p in reversed(procs):
                    p.stop()
    same = outputs["baseline"] == outputs["masked"]
    for name, t in totals.items():
        results[name] = {**t, "tau": round((t["rounds"] + t["accepted"]) / t["rounds"], 4)}
    print(f"# {cpu_line()}; {args.threads} thread(s) a service; policy {args.policy}; "
          f"{len(prompts)} json_schema prompts, greedy, {args.max_tokens} tokens; baseline "
          f"drafter service from {base} ({revision})")
    print("| drafter service | tokens | rounds | tau |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        label = f"baseline ({revision}, drafts unmasked)" if name == "baseline" else "this tree"
        print(f"| {label} | {r['tokens']} | {r['rounds']} | {r['tau']:.3f} |")
    print(f"\nsame greedy tokens: {same}; ratio {results['masked']['tau'] / results['baseline']['tau']:.3f}")
    print(json.dumps({"bench": "draft_processing_services", "cpu": cpu_line(),
                      "baseline": str(base), "baseline_revision": revision,
                      "policy": args.policy, "limit": len(prompts),
                      "max_tokens": args.max_tokens, "same_tokens": same, "results": results}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
