"""Service processes of the tiny stack on loopback, for the tests of `dspark/serving/`
(tests/serving/) and of `services/` (tests/services/): a tiny random target (with a word-level
tokenizer "t0".."t63"), an untrained DSpark drafter checkpoint, and launchers of real verifier,
drafter and scheduler processes that trace to JSON-lines files beside the models.

Processes cost seconds to start on a shared 2-core machine, so one verifier serves every test
(session scope) and each scenario starts only the processes it must kill. tests/conftest.py
registers this module as a plugin, so its fixtures are seen everywhere under tests/.
"""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass

import pytest

from dspark.serving.local_stack import ServiceProcess, free_port, wait_grpc
from loadtest.tiny_models import TinyModels, build_tiny_models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return build_tiny_models(tmp_path_factory.mktemp("services"))


def tracing_args(models: TinyModels, name: str) -> list[str]:
    return ["--trace-exporter", "file", "--trace-file", str(models.work / f"trace_{name}.jsonl")]


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
