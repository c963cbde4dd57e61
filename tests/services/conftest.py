"""The whole services stack on loopback for the tests of `services/`: verifier, drafter and
scheduler processes of the tiny stack (tests/stack_fixtures.py) with real Redis at
127.0.0.1:6379, an API key, and the embedded engine's greedy outputs to hold them to.

One stack serves every test (session scope); a scenario that kills a scheduler or a drafter
starts its own through `launcher`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

import pytest

from dspark.serving.local_stack import ServiceProcess, wait_grpc, wait_http
from loadtest.tiny_models import LAYER_IDS, TinyModels

from ..stack_fixtures import start_drafter, start_scheduler

API_KEY = "test-key-123"
REDIS_URL = "redis://127.0.0.1:6379/0"


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


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture(scope="session")
def stack(tiny_models, shared_verifier) -> Stack:
    """Verifier + drafter + scheduler (Redis store, API key, traces to files)."""
    drafter, drafter_address = start_drafter(tiny_models)
    procs = {"drafter": drafter}
    prefix = f"dspark-test-{uuid.uuid4().hex[:8]}:"
    try:
        # The drafter serving before the scheduler starts: the scheduler gives a drafter 60 s
        # to answer, which a loaded machine's drafter start-up can take.
        wait_grpc(drafter, drafter_address)
        scheduler, http_port, grpc_port = start_scheduler(
            tiny_models, shared_verifier.address, drafter_address,
            extra=("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--api-keys", API_KEY))
        procs["scheduler"] = scheduler
        wait_http(scheduler, http_port)
        yield Stack(tiny_models, shared_verifier.address, drafter_address, http_port, grpc_port,
                    procs, prefix)
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="session")
def json_stack(tmp_path_factory, save_json_tokenizer) -> Stack:
    """A scheduler, verifier and drafter whose tiny target writes with a character tokenizer
    that can spell JSON (`<|im_end|>` its end-of-sequence token), for structured output: the
    tiny stack's words "t0".."t63" cannot begin a JSON value. The weights are the tiny
    stack's (same seed); the drafter is its own, since it compiles the requests' grammars over
    this tokenizer to mask its drafts."""
    from loadtest.tiny_models import build_tiny_models

    from ..stack_fixtures import start_verifier

    models = build_tiny_models(tmp_path_factory.mktemp("json_stack"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (models.target_dir / name).unlink(missing_ok=True)
    save_json_tokenizer(models.target_dir)
    verifier, verifier_address = start_verifier(models, "json_verifier")
    drafter, drafter_address = start_drafter(models, "json_drafter")
    procs = {"verifier": verifier, "drafter": drafter}
    prefix = f"dspark-test-{uuid.uuid4().hex[:8]}:"
    try:
        wait_grpc(verifier, verifier_address)
        wait_grpc(drafter, drafter_address)
        scheduler, http_port, grpc_port = start_scheduler(
            models, verifier_address, drafter_address, name="json_scheduler",
            extra=("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--api-keys", API_KEY))
        procs["scheduler"] = scheduler
        wait_http(scheduler, http_port)
        yield Stack(models, verifier_address, drafter_address, http_port, grpc_port,
                    procs, prefix)
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="session")
def embedded_greedy(tiny_models):
    """Greedy outputs of the embedded engine (same target, drafter, policy, cost table)."""
    from dspark.cost_table import CostTable
    from dspark.engine import AdmissionConfig, Engine, EngineConfig
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
                            EngineConfig(AdmissionConfig(policy="async_topk"),
                                         update_cost_table=False))
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
