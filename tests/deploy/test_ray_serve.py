"""deploy/ray_serve.py on a local Ray (2 CPUs, no dashboard, token auth as Ray 2.5x+ sets up for a
new local cluster): two cells of the tiny stack (real verifier, drafter and scheduler replicas),
concurrent greedy requests through the Ray Serve router spread over both cells, outputs equal
to the embedded engine's token for token, each cell's verifier and drafter refusing calls without
the application's internal token, then a clean shutdown that leaves no cell port open. One cell:
its scheduler replica is the ingress, so HTTP reaches the scheduler's FastAPI app with no router
in between, and its methods still answer DeploymentHandle calls. Without a cluster: the configs
the application hands its cells share one fresh internal token.

A missing `ray` is an error here, not a skip: scripts/setup.sh installs ray[serve].
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

try:
    import ray
except ImportError as e:  # a clear failure, not a skip
    raise ImportError("ray[serve] is not installed: run `bash scripts/setup.sh`") from e

from dspark.serving.grpc_runtime import channel
from dspark.serving.local_stack import REPO_ROOT, free_port
from dspark.serving.protos import pb, rpc
from loadtest.tiny_models import LAYER_IDS, build_tiny_models

MAX_TOKENS = 12
PROMPTS = [[3, 9, 27], [5, 6], [10, 11, 12, 13], [7], [40, 41, 2], [22, 23, 24, 25, 26]]
CHAT = [{"role": "user", "content": "t5 t6 t7"}]
CHAT_IDS = [1, 5, 6, 7, 2, 3]  # CHAT in the tiny chat template: t1 <content> t2, then t3


def load_ray_serve_module():
    """deploy/ is not a package: load deploy/ray_serve.py by path (as `dspark_ray_serve`)."""
    spec = importlib.util.spec_from_file_location("dspark_ray_serve",
                                                  REPO_ROOT / "deploy" / "ray_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def embedded_greedy(models, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The embedded engine (same target, drafter, policy and cost table) under greedy."""
    from dspark.cost_table import CostTable
    from dspark.engine import AdmissionConfig, Engine, EngineConfig
    from dspark.loading import load_method_drafter, load_target
    from dspark.sampling import SamplingParams
    from dspark.verifier import TargetVerifier

    runner = load_target(models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
    drafter = load_method_drafter(models.drafter_dir, runner, apply_calibration=True)
    engine = Engine(TargetVerifier(runner), drafter, CostTable.load(models.cost_table),
                    EngineConfig(AdmissionConfig(policy="async_topk"), update_cost_table=False))
    return engine.generate([prompt_ids], SamplingParams(temperature=0), max_tokens)[0].output_ids


def post(url: str, body: dict):
    """(headers, the cell that served it, body bytes)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return reply.headers, reply.headers.get("x-dspark-cell"), reply.read()


def get_json(url: str):
    """The JSON body of a GET."""
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def streamed_token_ids(headers, data: bytes) -> list[int]:
    """The token ids of a server-sent-events response, checking that it is one: events in order,
    ending in [DONE]."""
    assert headers.get("Content-Type", "").startswith("text/event-stream")
    events = [line[len("data: "):] for line in data.decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 2
    return [t for e in events[:-1] for t in json.loads(e)["dspark"]["token_ids"]]


def tiny_config(rs, models, cells: int, http_port: int):
    """The application over the tiny models, CPU only, small enough for a 2-CPU local Ray."""
    return rs.RayServeConfig(
        cells=cells, http_port=http_port, model_dir=str(models.target_dir),
        drafter_dir=str(models.drafter_dir), cost_table=str(models.cost_table),
        model_name="tiny", policy="async_topk", kv_cache_tokens=8192, max_context_tokens=256,
        max_tokens_limit=64, update_cost_table=False, service_cpus=0.25, verifier_gpus=0,
        drafter_gpus=0)


def port_open(address: str) -> bool:
    host, port = address.replace("http://", "").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def ray_env():
    """Ray >= 2.5x turns token auth on for a new local cluster (`ray.init` sets RAY_AUTH_MODE=token
    itself) and takes the token from RAY_AUTH_TOKEN when set: a throw-away one here, so nothing is
    written to ~/.ray. One torch/OMP thread per worker. The environment is restored afterwards."""
    wanted = {"RAY_AUTH_TOKEN": uuid.uuid4().hex, "OMP_NUM_THREADS": "1",
              "RAY_USAGE_STATS_ENABLED": "0"}
    saved = {k: os.environ.get(k) for k in [*wanted, "RAY_AUTH_MODE"]}
    os.environ.pop("RAY_AUTH_MODE", None)
    os.environ.update(wanted)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def bound_init_args(app) -> tuple:
    """The arguments a deployment of the application graph was bound with (Ray Serve's
    Application -> Deployment.init_args)."""
    return app._bound_deployment.init_args


def test_every_cell_gets_the_deployments_internal_token(monkeypatch):
    """build_app on a pretend two-node cluster: every service config of every cell carries the
    same internal token, and the next deployment gets another one."""
    rs = load_ray_serve_module()
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "Resources": {"CPU": 8.0}, "NodeManagerAddress": ip}
        for ip in ("10.0.0.1", "10.0.0.2")])
    config = rs.RayServeConfig(cells=2, verifier_gpus=0, drafter_gpus=0)

    def tokens_of(app) -> set[str]:
        tokens = set()
        for scheduler_app in bound_init_args(app):  # the ingress is bound with the cells
            cell, verifier_app, drafter_app, scheduler_config = bound_init_args(scheduler_app)
            verifier_config, = bound_init_args(verifier_app)
            drafter_config, = bound_init_args(drafter_app)
            tokens |= {c.internal_token_value
                       for c in (verifier_config, drafter_config, scheduler_config)}
            assert all("internal_token=" not in repr(c)
                       for c in (verifier_config, drafter_config, scheduler_config))
        return tokens

    first, second = tokens_of(rs.build_app(config)), tokens_of(rs.build_app(config))
    assert len(first) == 1 and len(second) == 1 and first != second
    assert len(next(iter(first))) >= 32


def test_two_cells_serve_embedded_greedy_outputs_and_shut_down(tmp_path, ray_env):
    rs = load_ray_serve_module()
    models = build_tiny_models(tmp_path / "models")
    http_port = free_port()
    config = tiny_config(rs, models, cells=2, http_port=http_port)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        url = rs.deploy(config)
        assert url == f"http://127.0.0.1:{http_port}"
        cells = get_json(f"{url}/cells")["cells"]
        assert [c["cell"] for c in cells] == [0, 1]
        addresses = [a for c in cells for a in (c["verifier"], c["drafter"], c["http"], c["grpc"])]
        assert len(set(addresses)) == 8 and all(port_open(a) for a in addresses)
        # Only their scheduler may call a cell's verifier and drafter (the internal token).
        for cell in cells:
            for address, stub_class in ((cell["verifier"], rpc.verifier.VerifierStub),
                                        (cell["drafter"], rpc.drafter.DrafterStub)):
                with pytest.raises(grpc.RpcError) as e:
                    stub_class(channel(address)).Info(pb.common.InfoRequest(), timeout=30)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

        def complete(prompt):
            _, cell, data = post(f"{url}/v1/completions",
                                 {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                  "temperature": 0})
            return cell, json.loads(data)

        with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
            completions = list(pool.map(complete, PROMPTS))
            chat = pool.submit(post, f"{url}/v1/chat/completions",
                               {"model": "tiny", "messages": CHAT, "max_tokens": MAX_TOKENS,
                                "temperature": 0})
            streamed = pool.submit(post, f"{url}/v1/completions",
                                   {"model": "tiny", "prompt": PROMPTS[0],
                                    "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
            _, _, chat_data = chat.result()
            stream_headers, _, stream_data = streamed.result()

        # Every request was served by one of the two cells, and both cells served some.
        assert {cell for cell, _ in completions} == {"0", "1"}
        for prompt, (_, body) in zip(PROMPTS, completions):
            expected = embedded_greedy(models, prompt, MAX_TOKENS)
            assert body["dspark"]["token_ids"] == expected, prompt
            assert body["usage"]["completion_tokens"] == len(expected)
            assert body["choices"][0]["text"] == " ".join(f"t{i}" for i in expected)

        chat_body = json.loads(chat_data)
        assert chat_body["object"] == "chat.completion"
        assert chat_body["dspark"]["token_ids"] == embedded_greedy(models, CHAT_IDS, MAX_TOKENS)

        # Server-sent events come through the router as events, in order, ending in [DONE].
        streamed_ids = streamed_token_ids(stream_headers, stream_data)
        assert streamed_ids == embedded_greedy(models, PROMPTS[0], MAX_TOKENS)

        # Stored requests are found on whichever cell ran them.
        for _, body in completions:
            stored = get_json(f"{url}/v1/requests/{body['id']}")
            assert stored["status"] == "finished"
            assert stored["output_token_ids"] == body["dspark"]["token_ids"]

        # A client error is the scheduler's own 4xx, passed through unchanged.
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(f"{url}/v1/completions", {"model": "nope", "prompt": [1], "max_tokens": 2})
        assert refused.value.code == 404
        assert json.loads(refused.value.read())["error"]["code"] == 404
    finally:
        rs.shutdown()
    assert not ray.is_initialized()
    # The replicas drained and closed their services: no cell port and no ingress left open.
    assert not [a for a in addresses if port_open(a)]
    assert not port_open(f"127.0.0.1:{http_port}")


def test_one_cell_serves_the_scheduler_app_itself(tmp_path, ray_env):
    """One cell: the application's ingress is the cell's scheduler replica, so Ray's proxy hands
    HTTP straight to the scheduler's FastAPI app (its schema, no router, no x-dspark-cell), and
    the replica's methods still answer DeploymentHandle calls."""
    from ray import serve

    rs = load_ray_serve_module()
    models = build_tiny_models(tmp_path / "models")
    http_port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        url = rs.deploy(tiny_config(rs, models, cells=1, http_port=http_port))
        deployments = serve.status().applications[rs.APP_NAME].deployments
        assert set(deployments) == {"cell0-verifier", "cell0-drafter", "cell0-scheduler"}

        schema = get_json(f"{url}/openapi.json")
        assert schema["info"]["title"] == "DSpark Serve"
        assert {"/v1/completions", "/v1/chat/completions", "/v1/requests/{request_id}",
                "/health", "/cells"} <= set(schema["paths"])
        cell, = get_json(f"{url}/cells")["cells"]
        assert cell["cell"] == 0
        addresses = [cell["verifier"], cell["drafter"], cell["http"], cell["grpc"]]
        assert len(set(addresses)) == 4 and all(port_open(a) for a in addresses)

        _, routed_by, chat_data = post(f"{url}/v1/chat/completions",
                                       {"model": "tiny", "messages": CHAT,
                                        "max_tokens": MAX_TOKENS, "temperature": 0})
        assert routed_by is None  # no router in between
        chat_body = json.loads(chat_data)
        assert chat_body["object"] == "chat.completion"
        assert chat_body["dspark"]["token_ids"] == embedded_greedy(models, CHAT_IDS, MAX_TOKENS)
        stored = get_json(f"{url}/v1/requests/{chat_body['id']}")
        assert stored["output_token_ids"] == chat_body["dspark"]["token_ids"]

        stream_headers, _, stream_data = post(f"{url}/v1/completions",
                                              {"model": "tiny", "prompt": PROMPTS[0],
                                               "max_tokens": MAX_TOKENS, "temperature": 0,
                                               "stream": True})
        streamed_ids = streamed_token_ids(stream_headers, stream_data)
        assert streamed_ids == embedded_greedy(models, PROMPTS[0], MAX_TOKENS)

        handle = serve.get_deployment_handle("cell0-scheduler", rs.APP_NAME)
        assert handle.info.remote().result(timeout_s=60)["http"] == cell["http"]
        status, content_type, body = handle.forward.remote("GET", "/health", {}, b"").result(
            timeout_s=60)
        assert status == 200 and content_type == "application/json"
        assert json.loads(body)["status"] == "ok"
    finally:
        rs.shutdown()
    assert not ray.is_initialized()
    assert not [a for a in addresses if port_open(a)]
    assert not port_open(f"127.0.0.1:{http_port}")
