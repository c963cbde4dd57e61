"""The services stack on loopback for the tests: a tiny random target (with a word-level
tokenizer "t0".."t63"), an untrained DSpark drafter checkpoint, real service processes, real
Redis at 127.0.0.1:6379.

Processes cost seconds to start on a shared 2-core machine, so one verifier serves every test
(session scope) and each scenario starts only the schedulers and drafters it must kill.
"""

from __future__ import annotations

import contextlib
import json
import signal
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

import pytest

from dspark.serving.local_stack import ServiceProcess, free_port, wait_grpc, wait_http
from dspark.serving.tiny_models import LAYER_IDS, TinyModels, build_tiny_models

API_KEY = "test-key-123"
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return build_tiny_models(tmp_path_factory.mktemp("services"))


def tracing_args(models: TinyModels, name: str) -> list[str]:
    return ["--trace-exporter", "file", "--trace-file", str(models.work / f"trace_{name}.jsonl")]


@dataclass
class Stack:
    """Addresses of a running stack and handles to kill parts of it."""

    models: TinyModels
    verifier_address: str
    drafter_address: str
    http_port: int
    grpc_port: int
    processes: dict[str, ServiceProcess]
    redis_prefix: str
    api_key: str = API_KEY

    def post(self, path: str, body: dict | None = None, key: str | None = "default",
             raw: bytes | None = None) -> tuple[int, dict]:
        """(HTTP status, JSON reply) of POSTing `body` as JSON (or the bytes `raw`) to the REST
        API at `path`, with `key` as the bearer token ("default": the stack's key; None: none)."""
        data = raw if raw is not None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", data=data,
                                         method="POST", headers={"Content-Type": "application/json"})
        if key is not None:
            request.add_header("Authorization",
                               f"Bearer {self.api_key if key == 'default' else key}")
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


def start_verifier(models: TinyModels, name: str = "verifier", port: int | None = None,
                   env: dict[str, str] | None = None, kv_cache_tokens: int = 8192
                   ) -> tuple[ServiceProcess, str]:
    port = port or free_port()
    proc = ServiceProcess(name, [
        "services.verifier", "--port", str(port), "--model-dir", str(models.target_dir),
        "--drafter-dir", str(models.drafter_dir), "--kv-cache-tokens", str(kv_cache_tokens),
        "--max-context-tokens", "256", "--cost-table", str(models.cost_table),
        *tracing_args(models, name)], log_dir=models.work, env=env or {}).start()
    return proc, f"127.0.0.1:{port}"


def start_drafter(models: TinyModels, name: str = "drafter", port: int | None = None,
                  env: dict[str, str] | None = None) -> tuple[ServiceProcess, str]:
    port = port or free_port()
    proc = ServiceProcess(name, [
        "services.drafter", "--port", str(port), "--model-dir", str(models.target_dir),
        "--drafter-dir", str(models.drafter_dir), *tracing_args(models, name)],
        log_dir=models.work, env=env or {}).start()
    return proc, f"127.0.0.1:{port}"


def start_scheduler(models: TinyModels, verifier: str, drafter: str, name: str = "scheduler",
                    extra: tuple[str, ...] = (), http_port: int | None = None,
                    grpc_port: int | None = None, env: dict[str, str] | None = None
                    ) -> tuple[ServiceProcess, int, int]:
    http_port, grpc_port = http_port or free_port(), grpc_port or free_port()
    proc = ServiceProcess(name, [
        "services.scheduler", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--verifier", verifier, "--drafter", drafter, "--model-dir", str(models.target_dir),
        "--model-name", "tiny", "--max-tokens-limit", "64", "--policy", "async_topk",
        "--drafter-retry-seconds", "0.3", "--draft-timeout-seconds", "5",
        # The smooth test cost table stays as it is: measured tiny-model steps would make it a
        # noisy staircase and the admission erratic (the tests check speculation happens).
        "--update-cost-table", "false",
        *tracing_args(models, name), *extra], log_dir=models.work, env=env or {}).start()
    return proc, http_port, grpc_port


class Launcher:
    """Starts services of the tiny stack (for tests that kill and restart them)."""

    def __init__(self, models: TinyModels) -> None:
        self.models = models

    def verifier(self, name: str = "verifier", port: int | None = None, **kwargs):
        return start_verifier(self.models, name, port, **kwargs)

    def drafter(self, name: str = "drafter", port: int | None = None, **kwargs):
        return start_drafter(self.models, name, port, **kwargs)

    def scheduler(self, verifier: str, drafter: str, name: str = "scheduler", **kwargs):
        return start_scheduler(self.models, verifier, drafter, name, **kwargs)

    @contextlib.contextmanager
    def restartable_verifier(self, name: str):
        """A verifier process and a RemoteVerifier to it, as (remote, crash_and_restart):
        crash_and_restart() kills the process with no clean shutdown (SIGSTOP, then SIGKILL) and
        starts a fresh one on the same port, which the remote must restore its requests into."""
        from dspark.serving.remote_verifier import RemoteVerifier

        proc, address = self.verifier(name)
        port = int(address.rsplit(":", 1)[1])
        procs = [proc]
        remote = RemoteVerifier(address, wait_seconds=60)

        def crash_and_restart() -> None:
            procs[-1].proc.send_signal(signal.SIGSTOP)
            procs[-1].stop(signal.SIGKILL)
            procs.append(self.verifier(f"{name}_restarted", port=port)[0])

        try:
            wait_grpc(proc, address)
            yield remote, crash_and_restart
        finally:
            remote.close()
            procs[-1].stop()


@pytest.fixture(scope="session")
def launcher(tiny_models) -> Launcher:
    return Launcher(tiny_models)


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL


@dataclass
class RunningService:
    process: ServiceProcess
    address: str


@pytest.fixture(scope="session")
def shared_verifier(tiny_models) -> RunningService:
    proc, address = start_verifier(tiny_models)
    try:
        wait_grpc(proc, address)
        yield RunningService(proc, address)
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def stack(tiny_models, shared_verifier) -> Stack:
    """Verifier + drafter + scheduler (Redis store, API key, traces to files)."""
    drafter, drafter_address = start_drafter(tiny_models)
    prefix = f"dspark-test-{uuid.uuid4().hex[:8]}:"
    scheduler, http_port, grpc_port = start_scheduler(
        tiny_models, shared_verifier.address, drafter_address,
        extra=("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--api-keys", API_KEY))
    procs = {"drafter": drafter, "scheduler": scheduler}
    try:
        wait_grpc(drafter, drafter_address)
        wait_http(scheduler, http_port)
        yield Stack(tiny_models, shared_verifier.address, drafter_address, http_port, grpc_port,
                    procs, prefix)
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="session")
def embedded_greedy(tiny_models):
    """Greedy outputs of the embedded engine (same target, drafter, policy, cost table)."""
    from dspark.cost_table import CostTable
    from dspark.engine import Engine, EngineConfig
    from dspark.loading import load_method_drafter, load_target
    from dspark.sampling import SamplingParams
    from dspark.verifier import TargetVerifier

    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
            drafter = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
            engine = Engine(TargetVerifier(runner), drafter, CostTable.load(tiny_models.cost_table),
                            EngineConfig(policy="async_topk", update_cost_table=False))
            done = engine.generate([prompt_ids], SamplingParams(temperature=0), max_tokens)
            cache[key] = done[0].output_ids
        return cache[key]

    return run


@pytest.fixture
def read_spans(tiny_models):
    """All spans the services exported so far, from their JSON-lines files."""

    def read() -> list[dict]:
        spans = []
        for path in tiny_models.work.glob("trace_*.jsonl"):
            spans += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return spans

    return read
