"""Soak test: the tiny stack under Locust at twice its capacity while its parts fail.

The stack: verifier, drafter and scheduler processes (internal token, API key, Redis store on a
Redis of its own) on loopback; the scheduler admits `max_running` requests plus `max_waiting`
queued ones, so `users = 2 * (max_running + max_waiting)` Locust users keep it beyond capacity.
During the run: the drafter is killed (SIGKILL) and restarted, the verifier is killed and
restarted, and Redis is killed and restarted, each on its own port, at fixed fractions of the run.

Afterwards every response is judged against the greedy reference of its prompt (the embedded
engine, alone):
- completed: HTTP 200, finished, tokens identical to the reference;
- refused: 429 or 503 before any token;
- failed mid-stream: an error event after some tokens (those tokens must be a prefix of the
  reference: nothing wrong was ever sent);
- bad: anything else (a wrong token, a 5xx other than 503, a dropped connection, a client that
  waited past its timeout). The run passes with zero bad and zero mid-stream failures.

    .venv/bin/python -m loadtest.soak --seconds 600

prints the counts and ends with one JSON line. tests/services/test_soak.py runs a short one.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dspark.serving.local_stack import REPO_ROOT, ServiceProcess, free_port, wait_grpc, wait_http

PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [8, 8, 8], [40, 41, 42, 43, 44],
           [60, 1, 60, 1]]
API_KEY = "soak-key-0123456789"
INTERNAL_TOKEN = "soak-internal-token-0123456789"
# When during the run (fraction of its length) each part is killed, and how long it stays down.
FAULTS = (("drafter", 0.2, 3.0), ("verifier", 0.45, 2.0), ("redis", 0.7, 2.0))


@dataclass
class SoakSettings:
    seconds: float
    max_running: int
    max_waiting: int
    max_tokens: int
    timeout_seconds: float
    work: Path

    @property
    def users(self) -> int:
        return 2 * (self.max_running + self.max_waiting)


class Redis:
    """A redis-server of the soak's own (killing the shared one would disturb others)."""

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.work = work
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Redis":
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind",
             "127.0.0.1", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd=self.work)
        for _ in range(200):
            try:
                import redis

                redis.Redis(port=self.port, socket_timeout=0.2).ping()
                return self
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class SoakStack:
    def __init__(self, s: SoakSettings, models) -> None:
        self.s, self.models = s, models
        self.verifier_port, self.drafter_port = free_port(), free_port()
        self.http_port, self.grpc_port = free_port(), free_port()
        self.redis = Redis(s.work)
        self.procs: dict[str, ServiceProcess] = {}

    def _verifier(self) -> ServiceProcess:
        m = self.models
        return ServiceProcess("verifier", [
            "services.verifier", "--port", str(self.verifier_port), "--model-dir",
            str(m.target_dir), "--drafter-dir", str(m.drafter_dir), "--kv-cache-tokens", "8192",
            "--max-context-tokens", "256", "--cost-table", str(m.cost_table)], self.s.work,
            env={"DSPARK_VERIFIER_INTERNAL_TOKEN": INTERNAL_TOKEN})

    def _drafter(self) -> ServiceProcess:
        m = self.models
        return ServiceProcess("drafter", [
            "services.drafter", "--port", str(self.drafter_port), "--model-dir",
            str(m.target_dir), "--drafter-dir", str(m.drafter_dir)], self.s.work,
            env={"DSPARK_DRAFTER_INTERNAL_TOKEN": INTERNAL_TOKEN})

    def start(self) -> None:
        self.redis.start()
        self.procs["verifier"] = self._verifier().start()
        self.procs["drafter"] = self._drafter().start()
        wait_grpc(self.procs["verifier"], f"127.0.0.1:{self.verifier_port}")
        wait_grpc(self.procs["drafter"], f"127.0.0.1:{self.drafter_port}")
        self.procs["scheduler"] = ServiceProcess("scheduler", [
            "services.scheduler", "--http-port", str(self.http_port), "--grpc-port",
            str(self.grpc_port), "--verifier", f"127.0.0.1:{self.verifier_port}", "--drafter",
            f"127.0.0.1:{self.drafter_port}", "--model-dir", str(self.models.target_dir),
            "--model-name", "tiny", "--max-tokens-limit", "64", "--policy", "async_topk",
            "--update-cost-table", "false", "--drafter-retry-seconds", "0.3",
            "--max-running", str(self.s.max_running), "--max-waiting", str(self.s.max_waiting),
            "--redis-url", self.redis.url, "--redis-prefix", "soak:"], self.s.work,
            env={"DSPARK_SCHEDULER_INTERNAL_TOKEN": INTERNAL_TOKEN,
                 "DSPARK_SCHEDULER_API_KEYS": API_KEY}).start()
        wait_http(self.procs["scheduler"], self.http_port)

    def fault(self, part: str, down_seconds: float) -> None:
        """Kill `part` (SIGKILL), wait, start it again on the same port."""
        if part == "redis":
            self.redis.kill()
            time.sleep(down_seconds)
            self.redis.start()
            return
        self.procs[part].stop(signal.SIGKILL, timeout=10)
        time.sleep(down_seconds)
        self.procs[part] = (self._verifier() if part == "verifier" else self._drafter()).start()
        port = self.verifier_port if part == "verifier" else self.drafter_port
        wait_grpc(self.procs[part], f"127.0.0.1:{port}")

    def stop(self) -> None:
        for name in ("scheduler", "drafter", "verifier"):
            if name in self.procs:
                self.procs[name].stop(timeout=20)
        self.redis.kill()


def greedy_references(models, max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output from the embedded engine, alone."""
    from dspark.cost_table import CostTable
    from dspark.engine import AdmissionConfig, EngineConfig
    from dspark.loading import build_engine, load_method_drafter, load_target
    from dspark.sampling import SamplingParams
    from loadtest.tiny_models import LAYER_IDS

    out = []
    for prompt in PROMPTS:
        runner = load_target(models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
        drafter = load_method_drafter(models.drafter_dir, runner, apply_calibration=True)
        engine = build_engine(runner, drafter, CostTable.load(models.cost_table),
                              EngineConfig(AdmissionConfig(policy="async_topk"),
                                           update_cost_table=False))
        out.append(engine.generate([prompt], SamplingParams(temperature=0), max_tokens)[0]
                   .output_ids)
    return out


def judge(outcomes: list[dict], references: list[list[int]], timeout_seconds: float
          ) -> tuple[collections.Counter, list[dict]]:
    """Counts per verdict, and the outcomes judged bad."""
    counts: collections.Counter = collections.Counter()
    bad = []
    for o in outcomes:
        reference = references[o["prompt"]]
        if o["timed_out"] or o["seconds"] > timeout_seconds:
            verdict = "bad: waited past its timeout"
        elif o["status"] in (429, 503) and not o["tokens"]:
            verdict = f"refused {o['status']}"
        elif o["status"] == 200 and o["error"] is None and o["finish_reason"] is not None:
            verdict = "completed" if o["tokens"] == reference else "bad: wrong tokens"
        elif o["status"] == 200 and o["error"] is not None:
            verdict = ("failed mid-stream" if o["tokens"] == reference[:len(o["tokens"])]
                       else "bad: wrong tokens before a failure")
        else:
            verdict = f"bad: status {o['status']}, error {o['error']}"
        counts[verdict] += 1
        if verdict.startswith("bad") or verdict == "failed mid-stream":
            bad.append(o)
    return counts, bad


def run(s: SoakSettings) -> dict:
    from loadtest.tiny_models import build_tiny_models

    s.work.mkdir(parents=True, exist_ok=True)
    models = build_tiny_models(s.work / "models")
    references = greedy_references(models, s.max_tokens)
    stack = SoakStack(s, models)
    results = s.work / "soak_results.jsonl"
    results.unlink(missing_ok=True)
    faults_done = []
    try:
        stack.start()
        env = {**os.environ, "DSPARK_SOAK_PROMPTS": json.dumps(PROMPTS),
               "DSPARK_SOAK_MAX_TOKENS": str(s.max_tokens), "DSPARK_SOAK_API_KEY": API_KEY,
               "DSPARK_SOAK_TIMEOUT_SECONDS": str(s.timeout_seconds),
               "DSPARK_SOAK_RESULTS": str(results)}
        locust = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest/soak_locustfile.py"),
             "--headless", "-u", str(s.users), "-r", str(s.users), "-t", f"{int(s.seconds)}s",
             "--stop-timeout", str(int(s.timeout_seconds)), "--host",
             f"http://127.0.0.1:{stack.http_port}", "--only-summary", "--loglevel", "WARNING"],
            env=env, cwd=REPO_ROOT, stdout=open(s.work / "locust.log", "w"),
            stderr=subprocess.STDOUT)
        start = time.monotonic()
        for part, at, down in FAULTS:
            time.sleep(max(0.0, start + at * s.seconds - time.monotonic()))
            stack.fault(part, down)
            faults_done.append(part)
        locust.wait(timeout=s.seconds + s.timeout_seconds + 120)
    finally:
        stack.stop()
    outcomes = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    counts, bad = judge(outcomes, references, s.timeout_seconds)
    return {"seconds": s.seconds, "users": s.users, "max_running": s.max_running,
            "max_waiting": s.max_waiting, "requests": len(outcomes), "faults": faults_done,
            "counts": dict(counts), "bad": bad[:20]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--max-running", type=int, default=4)
    parser.add_argument("--max-waiting", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--timeout-seconds", type=float, default=120)
    parser.add_argument("--work", default="")
    args = parser.parse_args(argv)
    settings = SoakSettings(args.seconds, args.max_running, args.max_waiting, args.max_tokens,
                            args.timeout_seconds,
                            Path(args.work or tempfile.mkdtemp(prefix="dspark-soak-")))
    summary = run(settings)
    for verdict, n in sorted(summary["counts"].items()):
        print(f"{verdict:40} {n:7d}")
    print(json.dumps(summary))
    ok = all(not v.startswith("bad") and v != "failed mid-stream" for v in summary["counts"])
    return 0 if ok and summary["counts"].get("completed", 0) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
