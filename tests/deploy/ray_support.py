"""What the Ray tests share: one Ray cluster of three nodes on this host for the whole session
(`ray.cluster_utils.Cluster`, as Ray's own tests do), deploy/ray_serve.py loaded by path, the
embedded engine's greedy reference and small HTTP helpers.

The cluster: a head (1 CPU; Serve's controller, its one HTTP proxy and the router) and two worker
nodes with 1 CPU and one `dspark_cell` slot each, 80 MiB object stores, no dashboard. A busy
2-core machine (load ~10) once made Ray give up waiting 30 s for its GCS port file: the wait is
RAY_gcs_server_port_wait_time_s (Ray's own knob), raised here to 300 s; a node gets 180 s to
appear in the GCS (Cluster's own wait is 30 s), and a node whose raylet missed Ray's fixed 30 s
registration wait is started again. Token auth (Ray 2.5x+) with a throw-away token, so nothing goes to ~/.ray.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

import pytest

try:
    import ray
except ImportError as e:  # a clear failure, not a skip
    raise ImportError("ray[serve] is not installed: run `bash scripts/setup.sh`") from e

from dspark.serving.local_stack import REPO_ROOT, free_port
from loadtest.tiny_models import LAYER_IDS

NODE_OBJECT_STORE = 80 * 1024 * 1024
RAY_ENV = {"OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           # Ray's wait for the GCS server's port file (default 30 s) and for a node to register.
           "RAY_gcs_server_port_wait_time_s": "300"}
# GCS declares a node dead after 3 missed 1-s health checks (default 5 x 3 s).
SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def load_ray_serve_module():
    """deploy/ is not a package: load deploy/ray_serve.py by path (as `dspark_ray_serve`)."""
    if "dspark_ray_serve" in sys.modules:
        return sys.modules["dspark_ray_serve"]
    spec = importlib.util.spec_from_file_location("dspark_ray_serve",
                                                  REPO_ROOT / "deploy" / "ray_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


NODE_WAIT_S = 180
"""How long a node may take to register with the GCS here."""


def with_retries(start, what: str, attempts: int = 3):
    """start(), again when it fails: a node's raylet must register within a fixed 30 s in
    Ray's Node (not configurable), which a machine at load ~10 can miss."""
    for attempt in range(attempts):
        try:
            return start()
        except Exception as e:
            if attempt == attempts - 1:
                raise
            print(f"{what} did not start ({type(e).__name__}: {e}); starting it again")
            time.sleep(2)


@dataclass
class RayTestCluster:
    cluster: object
    """ray.cluster_utils.Cluster"""
    workers: list = field(default_factory=list)
    """The worker nodes (ray._private.node.Node), each with one dspark_cell slot."""
    http_port: int = 0
    """Serve's HTTP port for the session (Serve keeps the first one it was started with)."""

    def add_worker(self):
        def start():
            try:
                node = self.cluster.add_node(wait=False, num_cpus=1, resources={"dspark_cell": 1},
                                             object_store_memory=NODE_OBJECT_STORE)
            except Exception:
                self.kill_untracked_nodes()
                raise
            self.cluster._wait_for_node(node, timeout=NODE_WAIT_S)  # Cluster's own: 30 s
            return node

        node = with_retries(start, "a worker node")
        self.workers.append(node)
        return node

    def kill_untracked_nodes(self) -> None:
        """Kill the processes of this cluster's nodes that the Cluster does not track, and wait
        until the GCS holds none of them alive. Ray's Node raises when its raylet misses the
        fixed 30 s registration wait but leaves the raylet running: it may register later and
        offer a dspark_cell slot the tests know nothing of (a cell placed there never starts
        once the raylet goes with its collected Node)."""
        import psutil

        known = {n.node_id for n in [self.cluster.head_node, *self.cluster.worker_nodes]}
        ours = f"--gcs-address={self.cluster.gcs_address}"
        for process in psutil.process_iter(["cmdline"]):
            args = process.info["cmdline"] or []
            ids = [a.split("=", 1)[1] for a in args if a.startswith(("--node_id=", "--node-id="))]
            if ours in args and ids and ids[0] not in known:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
        wait_for(lambda: not [n for n in self.cluster.global_state.node_table()
                              if n["Alive"] and n["NodeID"] not in known],
                 60, "an untracked node to be declared dead")

    def remove_worker(self, node) -> None:
        """Kill the node's raylet and every worker process on it, as a crash would."""
        self.workers.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)


@pytest.fixture(scope="session")
def ray_cluster():
    from ray.cluster_utils import Cluster

    wanted = {**RAY_ENV, "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    saved = {k: os.environ.get(k) for k in [*wanted, "RAY_AUTH_MODE"]}
    os.environ.pop("RAY_AUTH_MODE", None)
    os.environ.update(wanted)
    cluster = Cluster()
    with_retries(lambda: cluster.add_node(
        num_cpus=1, include_dashboard=False, object_store_memory=NODE_OBJECT_STORE,
        _system_config=SYSTEM_CONFIG), "the head node")
    test_cluster = RayTestCluster(cluster, http_port=free_port())
    try:
        for _ in range(2):
            test_cluster.add_worker()
        ray.init(address=cluster.address, log_to_driver=False)
        yield test_cluster
    finally:
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tiny_config(rs, models, cells: int, http_port: int, **overrides):
    """The application over the tiny models, CPU only, small enough for 1-CPU Ray nodes; Serve's
    one proxy on the head (the nodes share this host's ports)."""
    return rs.RayServeConfig(**{
        "cells": cells, "http_port": http_port, "model_dir": str(models.target_dir),
        "drafter_dir": str(models.drafter_dir), "cost_table": str(models.cost_table),
        "model_name": "tiny", "policy": "async_topk", "kv_cache_tokens": 8192,
        "max_context_tokens": 512, "max_tokens_limit": 480, "update_cost_table": False,
        "service_cpus": 0.25, "verifier_gpus": 0, "drafter_gpus": 0,
        "proxy_location": "HeadOnly", **overrides})


def embedded_outputs(models, prompts: list[list[int]], max_tokens: int,
                    sampling=None) -> list[list[int]]:
    """The embedded engine (same target, drafter, policy and cost table), greedy unless
    `sampling` (a SamplingParams) says otherwise."""
    from dspark.cost_table import CostTable
    from dspark.engine import AdmissionConfig, Engine, EngineConfig
    from dspark.loading import load_method_drafter, load_target
    from dspark.sampling import SamplingParams
    from dspark.verifier import TargetVerifier

    runner = load_target(models.target_dir, LAYER_IDS, kv_cache_tokens=16384)
    drafter = load_method_drafter(models.drafter_dir, runner, apply_calibration=True)
    engine = Engine(TargetVerifier(runner), drafter, CostTable.load(models.cost_table),
                    EngineConfig(AdmissionConfig(policy="async_topk"), update_cost_table=False))
    outputs = engine.generate(prompts, sampling or SamplingParams(temperature=0), max_tokens)
    return [o.output_ids for o in outputs]


def post(url: str, body: dict, timeout: float = 120):
    """(headers, the cell that served it, body bytes)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return reply.headers, reply.headers.get("x-dspark-cell"), reply.read()


def get_json(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def sse_events(data: bytes) -> list[str]:
    return [line[len("data: "):] for line in data.decode().splitlines()
            if line.startswith("data: ")]


def streamed_token_ids(headers, data: bytes) -> list[int]:
    """The token ids of a server-sent-events response, checking that it is one: events in order,
    ending in [DONE]."""
    assert headers.get("Content-Type", "").startswith("text/event-stream")
    events = sse_events(data)
    assert events[-1] == "[DONE]" and len(events) >= 2
    return [t for e in events[:-1] for t in json.loads(e)["dspark"]["token_ids"]]


def port_open(address: str) -> bool:
    host, port = address.replace("http://", "").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def wait_for(predicate, timeout: float, what: str, period: float = 0.25):
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(period)


def dspark_apps() -> set[str]:
    from ray import serve

    return {n for n in serve.status().applications if n.startswith("dspark")}


__all__ = ["ray_cluster", "load_ray_serve_module", "tiny_config", "embedded_outputs", "post",
           "get_json", "streamed_token_ids", "sse_events", "port_open", "wait_for",
           "dspark_apps"]
