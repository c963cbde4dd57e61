"""One services stack (verifier, drafter, scheduler) per admission policy, on loopback.

The sweep starts a fresh stack for each policy so no policy inherits another's caches, cost-table
updates or warm state. Verifier and drafter start together (each imports torch and loads its
model: the slow part), then the scheduler. Policy `none` runs without a drafter process at all,
the same as `dspark up --policy none`.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dspark.admission import AdmissionPolicy
from dspark.drafter_choice import parse_drafter_dir
from dspark.serving.core_split import scheduler_cohorts, split_cores
from dspark.serving.local_stack import ServiceProcess, free_port, wait_grpc, wait_http


@dataclass(frozen=True)
class ModelChoice:
    """Which target and drafter the stack serves; empty = the services' defaults (SmolLM2)."""

    model_dir: str = ""
    drafter_dir: str = ""
    cost_table: str = ""
    model_name: str = "dspark"
    max_context_tokens: int = 0
    """0 = the verifier's default."""
    dtype: str = "float32"
    weights: str = "auto"
    """The verifier's target linears: auto | q4 | dense (services.verifier --weights)."""
    device: str = "cpu"
    scheduler_args: tuple[str, ...] = ()
    verifier_threads: int = 0
    """torch threads of the verifier; 0 = as `dspark up` splits the cores (core_split)."""
    drafter_threads: int = 0
    """torch threads of the drafter; 0 = as `dspark up` splits the cores."""


def tiny_models(work: Path) -> ModelChoice:
    """The tests' tiny random target and untrained drafter, built into `work`."""
    from loadtest.tiny_models import build_tiny_models

    m = build_tiny_models(work)
    # As in the service tests: the smooth test cost table stays as it is, since measured
    # tiny-model steps would make it a noisy staircase and the admission erratic.
    # One thread per model: the tiny models gain nothing from more, and the tests run beside them.
    return ModelChoice(str(m.target_dir), str(m.drafter_dir), str(m.cost_table), "tiny", 1024,
                       scheduler_args=("--update-cost-table", "false"), verifier_threads=1,
                       drafter_threads=1)


def real_models(model_dir: str = "", drafter_dir: str = "", cost_table: str = "",
                dtype: str = "float32", weights: str = "auto") -> ModelChoice:
    """SmolLM2 (prepared by `dspark fetch-model`) and the shipped drafter unless named."""
    from dspark.paths import DEFAULT_DRAFTER

    return ModelChoice(model_dir, drafter_dir or str(DEFAULT_DRAFTER), cost_table, "dspark",
                       dtype=dtype, weights=weights)


@dataclass
class RunningStack:
    policy: str
    http_port: int
    grpc_port: int
    processes: list[ServiceProcess] = field(default_factory=list)

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.rest_url}/metrics", timeout=10) as r:
            return r.read().decode()

    def warm_up(self, model_name: str, max_tokens: int = 8) -> None:
        """One short request, so lazy initialisation is not charged to the first level."""
        body = json.dumps({"model": model_name, "prompt": "warm up", "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{self.rest_url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()

    def stop(self) -> None:
        for proc in reversed(self.processes):  # scheduler first: it drains, then its backends
            proc.stop(timeout=20)


@dataclass
class RemoteTarget:
    """An ingress already serving (a Ray Serve cluster) in place of a started stack: REST only;
    its /metrics are not read (behind the router they come from one cell of several), so the
    levels carry no verification length."""

    rest_url: str
    policy: str = "target"

    def __post_init__(self) -> None:
        self.rest_url = self.rest_url.rstrip("/")

    @property
    def grpc_target(self) -> str:
        return ""

    def metrics_text(self) -> str:
        return ""

    warm_up = RunningStack.warm_up

    def stop(self) -> None:
        pass


def start_stack(models: ModelChoice, policy: str, log_dir: Path,
                extra_scheduler_args: tuple[str, ...] = (), trace_file: Path | None = None
                ) -> RunningStack:
    """Start and wait for a stack serving `policy`; stops what it started if any part fails.
    With `trace_file`, all three services append their spans to it (loadtest/trace_report.py)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    trace = [] if trace_file is None else ["--trace-exporter", "file", "--trace-file",
                                           str(trace_file)]
    use_drafter = (AdmissionPolicy.parse(policy).drafts
                   and parse_drafter_dir(models.drafter_dir) is not None)
    cohorts = scheduler_cohorts([*models.scheduler_args, *extra_scheduler_args])
    threads = split_cores(use_drafter, cohorts, verifier=models.verifier_threads,
                          drafter=models.drafter_threads)
    common = ["--dtype", models.dtype, "--device", models.device]
    model = ["--model-dir", models.model_dir] if models.model_dir else []
    verifier_port, drafter_port = free_port(), free_port()
    verifier_args = ["services.verifier", "--port", str(verifier_port), *model, *common, *trace,
                     "--weights", models.weights,
                     "--threads", str(threads.verifier),
                     "--hidden-layer-ids", "" if use_drafter else "none"]
    if use_drafter:
        verifier_args += ["--drafter-dir", models.drafter_dir]
    if models.cost_table:
        verifier_args += ["--cost-table", models.cost_table]
    if models.max_context_tokens:
        verifier_args += ["--max-context-tokens", str(models.max_context_tokens)]
    stack = RunningStack(policy, free_port(), free_port())
    backends = [(ServiceProcess("verifier", verifier_args, log_dir), f"127.0.0.1:{verifier_port}")]
    if use_drafter:
        backends.append((ServiceProcess("drafter", [
            "services.drafter", "--port", str(drafter_port), "--drafter-dir", models.drafter_dir,
            *model, *common, *trace, "--threads", str(threads.drafter)], log_dir),
            f"127.0.0.1:{drafter_port}"))
    try:
        for proc, _ in backends:
            stack.processes.append(proc.start())
        for proc, address in backends:
            wait_grpc(proc, address)
        scheduler = ServiceProcess("scheduler", [
            "services.scheduler", "--http-port", str(stack.http_port), "--grpc-port",
            str(stack.grpc_port), "--verifier", f"127.0.0.1:{verifier_port}",
            "--drafter", f"127.0.0.1:{drafter_port}" if use_drafter else "",
            "--model-name", models.model_name, "--policy", policy, *model,
            *models.scheduler_args, *trace, *extra_scheduler_args], log_dir)
        stack.processes.append(scheduler.start())
        wait_http(scheduler, stack.http_port)
    except BaseException:
        stack.stop()
        raise
    return stack
