"""DSpark Serve as a Ray Serve application: cells of (verifier, drafter, scheduler) behind one
ingress.

    python deploy/ray_serve.py --cells 2 [--address auto] [--http-port 8000] [--verifier-gpus 0.5]

Glossary:
- **cell**: one verifier, its drafter and its scheduler, all three on one node and wired to each
  other by loopback addresses. It is the unit that scales out: `--cells N` deploys N of them.
- **replica**: each service of a cell is a Ray Serve deployment with one replica
  (`cell<i>-verifier`, `cell<i>-drafter`, `cell<i>-scheduler`) that runs the *real* service in
  its own process: the gRPC verifier / drafter servers (`services.<name>.main.start`) and the
  scheduler's engine loop, REST and gRPC servers (`services.scheduler.main.start`).
- **ingress**: the deployment that takes the HTTP requests of Ray Serve's proxy (`--http-host`/
  `--http-port`). Every scheduler replica holds the scheduler's own FastAPI app
  (services.scheduler.rest_api) plus `GET /cells`, to run in its event loop. With one cell the
  ingress is that replica, as a `serve.ingress` deployment (`SchedulerIngress`): the proxy hands
  each request straight to the scheduler's app (its /docs and /openapi.json included).
- **router**: the ingress of several cells, or of a cell count that changes (application
  `dspark`, deployment `ingress`, a `serve.ingress` FastAPI app on the head node). Each cell is
  then its own application `dspark-cell<i>` rooted at its scheduler (no HTTP route; a plain
  deployment, `SchedulerReplica`: Ray Serve allows one `serve.ingress` per application). The
  router sends each request to the healthy cell with the fewest requests in flight through a
  DeploymentHandle (ties: round-robin; `/v1/requests/{id}[/resume]` to the cell that runs it,
  else one that holds its record), whose replica runs it through its app as an ASGI call
  (`call_asgi`: no HTTP hop to the scheduler's REST server), and returns the response with the
  header `x-dspark-cell`; streamed (SSE) responses are streamed through. It checks every cell's
  health; a lost cell (its node died) leaves the routing and its streams end with a `cell_lost`
  event. `GET /cells` lists the cells: node, addresses, health, requests in flight.
- **cell controller** (`CellController`, on the driver): removes lost cells, replaces them where
  a node has room, and with `--min-cells`/`--max-cells` follows the load (requests in flight per
  cell), draining a cell before it removes it.

Resources: every replica reserves `--service-cpus` logical CPUs; the verifier and drafter reserve
`--verifier-gpus` / `--drafter-gpus` GPUs (default: one each when the cluster has GPUs, as
deploy/docker-compose.gpu.yml places them; `--verifier-gpus 0.5` (the drafter follows) puts a
cell's two on one shared GPU; 0 on a CPU-only cluster) and then run on `cuda`, the GPU Ray
assigns to the replica. A cell is pinned to one node
by a label selector on the node's id (`ray.io/node-id`); cells go to the nodes with the custom
resource `dspark_cell` (one slot per cell) when some have it, least used first, else round-robin
over the alive nodes (with GPUs when GPUs are asked for). Nothing of a cell listens beyond
loopback: the proxy and the router reach a cell through Ray, the scheduler its verifier and
drafter over 127.0.0.1.

Request state: every cell's scheduler writes to the same Redis under the same prefix, so any live
cell can fetch and resume (`/v1/requests/{id}/resume`) a request that a lost cell was running.

Internal token: each cell gets its own (Python's `secrets`), handed to its verifier, drafter and
scheduler in their configs (through Ray, not the command line or the environment), so the
verifier and the drafter take calls from their scheduler only (metadata x-dspark-internal-token),
not from other processes on the node.
Multi-node set-up: deploy/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ray import serve

# `python deploy/ray_serve.py` from anywhere: the checkout goes on sys.path before dspark (and so
# dspark.paths.REPO_ROOT) can be imported, hence its own path here.
if (_checkout := str(Path(__file__).resolve().parents[1])) not in sys.path:
    sys.path.insert(0, _checkout)

from dspark.drafter_choice import NONE, parse_drafter_dir  # noqa: E402
from dspark.serving.config import (  # noqa: E402
    DrafterServiceConfig,
    SchedulerConfig,
    VerifierServiceConfig,
    add_arguments,
    engine_field,
    from_args,
)

ENV_PREFIX = "DSPARK_RAY"
APP_NAME = "dspark"
# The headers a client's request keeps on its way to a cell's scheduler (auth, body type).
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
# The methods the router forwards (a Starlette route takes only GET unless told).
ROUTED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _field(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RayServeConfig:
    """The Ray Serve application: how many cells, what each service loads, what it reserves."""

    cells: int = _field(1, "cells to deploy (verifier + drafter + scheduler each)")
    address: str = _field("", "Ray cluster to join ('auto' = the one `ray start` made on this "
                              "node); empty = start a local Ray")
    num_cpus: int = _field(0, "logical CPUs of a local Ray (0 = all cores; ignored with --address)")
    http_host: str = _field("127.0.0.1", "where Ray Serve's HTTP proxy listens (0.0.0.0 to "
                                         "serve other machines)")
    http_port: int = _field(8000, "Ray Serve's HTTP port (the ingress)")
    model_dir: str = _field("", "target model folder (default: the prepared SmolLM2); must exist "
                                "at the same path on every node")
    drafter_dir: str = _field("", "drafter checkpoint (default: the shipped one); 'none' = target "
                                  "only")
    cost_table: str = _field("", "SPS(B) table JSON for the verifiers; default: measured at start")
    model_name: str = _field("dspark", "the model name clients send")
    policy: str = engine_field(
        "policy", "async_topk | sync_greedy | none | fixed:N | threshold:H", from_engine=str)
    dtype: str = _field("float32", "float32 | bfloat16 (verifier and drafter)")
    kv_cache_tokens: int = _field(65536, "each verifier's KV cache capacity in tokens")
    max_context_tokens: int = _field(4096, "longest prompt + output of one request")
    max_tokens_limit: int = _field(2048, "largest max_tokens a client may ask for")
    max_running: int = engine_field(
        "max_running", "requests verified together in one round (per cell)")
    update_cost_table: bool = engine_field(
        "update_cost_table", "schedulers refresh SPS(B) from measured steps")
    api_keys: str = _field("", "comma-separated accepted Bearer keys; empty = no auth")
    redis_url: str = _field("", "redis://host:port/db for request state; empty = in memory")
    redis_prefix: str = _field("dspark:", "key prefix, shared by every cell: a request stored "
                                          "by one cell can be fetched and resumed on any")
    service_cpus: float = _field(1.0, "logical CPUs each service replica reserves")
    verifier_gpus: float = _field(-1.0, "GPUs each verifier reserves (-1 = 1 when the cluster "
                                        "has GPUs, else 0; 0.5 with a drafter's 0.5 shares one "
                                        "GPU); > 0 runs it on cuda")
    drafter_gpus: float = _field(-1.0, "GPUs each drafter reserves (-1 = as --verifier-gpus)")
    threads: int = _field(1, "torch CPU threads of each verifier and drafter")
    proxy_location: str = _field("EveryNode", "where Ray Serve runs HTTP proxies: EveryNode | "
                                              "HeadOnly (several Ray nodes on one host share "
                                              "one port: HeadOnly)")
    min_cells: int = _field(0, "autoscaling: fewest cells (0 = no autoscaling: --cells stay)")
    max_cells: int = _field(0, "autoscaling: most cells (with --min-cells)")
    target_ongoing_requests: float = _field(
        4.0, "autoscaling: requests in flight per cell the controller aims at")
    upscale_delay_s: float = _field(3.0, "autoscaling: load above target this long adds a cell")
    downscale_delay_s: float = _field(15.0, "autoscaling: load below target this long drains a "
                                            "cell")
    health_period_s: float = _field(1.0, "the router checks every cell this often")
    health_timeout_s: float = _field(3.0, "a cell's health check fails after this long")
    health_failures: int = _field(2, "failed checks in a row that take a cell out of routing")
    controller_period_s: float = _field(1.0, "the cell controller's step period")

    def __post_init__(self) -> None:
        if self.cells < 1:
            raise ValueError(f"cells must be >= 1, got {self.cells}")
        if self.service_cpus <= 0:
            raise ValueError("service_cpus must be > 0")
        if self.num_cpus < 0 or self.threads < 1:
            raise ValueError("num_cpus must be >= 0, threads >= 1")
        if self.proxy_location not in ("EveryNode", "HeadOnly"):
            raise ValueError(f"proxy_location must be EveryNode or HeadOnly, got "
                             f"{self.proxy_location!r}")
        if self.autoscaling and not 1 <= self.min_cells <= self.cells <= self.max_cells:
            raise ValueError("autoscaling needs 1 <= min_cells <= cells <= max_cells, got "
                             f"{self.min_cells} <= {self.cells} <= {self.max_cells}")
        if self.target_ongoing_requests <= 0 or self.health_failures < 1:
            raise ValueError("target_ongoing_requests must be > 0, health_failures >= 1")
        # The service configs validate the rest (policy, ports, sizes) when they are built.
        self.cell_configs()

    @property
    def autoscaling(self) -> bool:
        return self.max_cells > 0 or self.min_cells > 0

    @property
    def routed(self) -> bool:
        """Whether the cells sit behind the router (several cells, or a count that changes)."""
        return self.cells > 1 or self.autoscaling

    def gpus(self, cluster_gpus: float) -> tuple[float, float]:
        """(verifier GPUs, drafter GPUs) per cell, resolving -1 against the cluster."""
        # As deploy/docker-compose.gpu.yml: one GPU each by default; 0.5 each shares one.
        verifier = self.verifier_gpus if self.verifier_gpus >= 0 else (1.0 if cluster_gpus else 0)
        drafter = self.drafter_gpus if self.drafter_gpus >= 0 else verifier
        return verifier, drafter

    def cell_configs(self, verifier_gpus: float = 0.0, drafter_gpus: float = 0.0,
                     internal_token: str = ""
                     ) -> tuple[VerifierServiceConfig, DrafterServiceConfig, SchedulerConfig]:
        """The three services' configs of one cell; ports 0 = any free one on loopback (the
        scheduler's verifier and drafter addresses are filled in by its replica).
        `internal_token`: what the verifier and the drafter demand and the scheduler sends."""
        drafter_dir = self.drafter_dir if self.with_drafter else ""
        verifier = VerifierServiceConfig(
            host="127.0.0.1", port=0, model_dir=self.model_dir, drafter_dir=drafter_dir,
            hidden_layer_ids="" if self.with_drafter else NONE, dtype=self.dtype,
            device="cuda" if verifier_gpus > 0 else "cpu", kv_cache_tokens=self.kv_cache_tokens,
            max_context_tokens=self.max_context_tokens, cost_table=self.cost_table,
            threads=self.threads, internal_token=internal_token)
        drafter = DrafterServiceConfig(
            host="127.0.0.1", port=0, model_dir=self.model_dir, drafter_dir=drafter_dir,
            dtype=self.dtype, device="cuda" if drafter_gpus > 0 else "cpu", threads=self.threads,
            internal_token=internal_token)
        scheduler = SchedulerConfig(
            host="127.0.0.1", http_port=0, grpc_port=0, model_dir=self.model_dir,
            model_name=self.model_name, policy=self.policy, max_running=self.max_running,
            max_tokens_limit=self.max_tokens_limit, update_cost_table=self.update_cost_table,
            api_keys=self.api_keys, redis_url=self.redis_url, redis_prefix=self.redis_prefix,
            drafter="", internal_token=internal_token)
        return verifier, drafter, scheduler

    @property
    def with_drafter(self) -> bool:
        """False for drafter_dir `none`; empty leaves each verifier and drafter its default (the
        shipped checkpoint), found on its own node."""
        return not self.drafter_dir or parse_drafter_dir(self.drafter_dir) is not None


# ------------------------------------------------------------------------------------------------
# The deployments


class _GrpcServiceReplica:
    """A verifier or drafter replica: the real gRPC service, started in this replica's process."""

    service = ""
    """"verifier" or "drafter": the module services.<service>.main that is started."""
    grpc_service = ""
    """Its gRPC service name, for the health status."""

    def __init__(self, config) -> None:
        import importlib
        import os

        from dspark.serving import grpc_runtime
        from dspark.serving.tracing import setup_tracing

        main = importlib.import_module(f"services.{self.service}.main")
        self.config = config
        self.logger = grpc_runtime.service_logger(self.service)
        self.tracing = setup_tracing(self.service, config)
        self.server, self.health, self.servicer, port = main.start(config, self.tracing.tracer)
        self.address = f"{config.host}:{port}"
        grpc_runtime.log_event(self.logger, "serving", address=self.address, pid=os.getpid(),
                               runtime="ray-serve")

    def get_address(self) -> str:
        return self.address

    def get_node_id(self) -> str:
        """The Ray node this replica runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def __del__(self) -> None:  # Ray Serve calls this when the replica is shut down
        from dspark.serving import grpc_runtime

        server = getattr(self, "server", None)
        if server is not None:
            self.server = None  # drain once
            grpc_runtime.drain(server, self.health, [self.grpc_service],
                               self.config.grace_seconds, self.logger)
            self.tracing.shutdown()


@serve.deployment
class VerifierReplica(_GrpcServiceReplica):
    service = "verifier"
    grpc_service = "dspark.v1.Verifier"


@serve.deployment
class DrafterReplica(_GrpcServiceReplica):
    service = "drafter"
    grpc_service = "dspark.v1.Drafter"


async def call_asgi(app, method: str, path: str, headers: dict, body: bytes):
    """Run one HTTP request through an ASGI app in this event loop, without a socket.

    Yields (status, content type) first, then the body's bytes as the app sends them (SSE
    events one by one). Closing the generator early (the client went away) tells the app
    `http.disconnect`, which aborts its request."""
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
             + [(b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, sent.put))
    try:
        while True:
            message = asyncio.ensure_future(sent.get())
            await asyncio.wait({message, task}, return_when=asyncio.FIRST_COMPLETED)
            if not message.done():  # the app returned (or failed) with nothing more to send
                message.cancel()
                task.result()
                return
            message = message.result()
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                yield message["status"], content_type.decode()
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        await task


@serve.deployment
class SchedulerReplica:
    """A cell's scheduler: the real engine loop over its verifier and drafter, with its REST and
    gRPC servers on loopback. `rest_app` is the scheduler's own FastAPI app, run in this
    replica's event loop: `forward` / `forward_stream` run the router's requests through it (no
    HTTP hop to its REST server), and as `SchedulerIngress` Ray's proxy serves it directly."""

    async def __init__(self, cell: int, verifier, drafter, config: SchedulerConfig) -> None:
        import ray
        import torch

        from services.scheduler.main import start

        torch.set_num_threads(1)  # the scheduler only routes tensors; the model work is elsewhere
        self.cell = cell
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.verifier_address = await verifier.get_address.remote()
        drafter_address = await drafter.get_address.remote() if drafter is not None else ""
        config = dataclasses.replace(config, verifier=self.verifier_address,
                                     drafter=drafter_address)
        self.scheduler = await asyncio.to_thread(start, config)
        self.base_url = f"http://{config.host}:{self.scheduler.http_port}"
        self.rest_app = self.scheduler.make_app()
        # A one-cell application's ingress is this replica: it answers /cells as the router does.
        self.rest_app.add_api_route("/cells", self.list_cells, methods=["GET"], tags=["ray-serve"])

    def __serve_build_asgi_app__(self):
        """The app Ray's proxy serves when this replica is the ingress (`SchedulerIngress`); Ray
        Serve calls it after `__init__`."""
        return self.rest_app

    def info(self) -> dict:
        return {"cell": self.cell, "node_id": self.node_id, "node_ip": self.node_ip,
                "verifier": self.verifier_address,
                "drafter": self.scheduler.config.drafter or None,
                "http": self.base_url,
                "grpc": f"{self.scheduler.config.host}:{self.scheduler.grpc_port}",
                "running": self.scheduler.loop.num_running()}

    async def list_cells(self) -> dict:
        """`GET /cells`: this cell alone."""
        return {"cells": [self.info()]}

    def is_live(self, request_id: str) -> bool:
        """Whether this cell's engine loop runs the request now (a stored `running` request that
        no cell runs is interrupted, and any cell may resume it)."""
        return self.scheduler.loop.is_live(request_id)

    async def forward(self, method: str, path: str, headers: dict, body: bytes
                      ) -> tuple[int, str, bytes]:
        """(status, content type, body) of the request against this cell's REST API."""
        reply = call_asgi(self.rest_app, method, path, headers, body)
        status, content_type = await anext(reply)
        return status, content_type, b"".join([chunk async for chunk in reply])

    async def forward_stream(self, method: str, path: str, headers: dict, body: bytes):
        """Yields (status, content type) first, then the body's bytes as they come (SSE)."""
        reply = call_asgi(self.rest_app, method, path, headers, body)
        try:
            async for item in reply:
                yield item
        finally:
            await reply.aclose()

    def __del__(self) -> None:  # Ray Serve calls this when the replica is shut down
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            self.scheduler = None
            scheduler.stop()  # drains in-flight requests, closes REST, gRPC and the proxies


# The scheduler replica of a one-cell application, which is its ingress. Behind the router the
# schedulers stay plain deployments: Ray Serve refuses more than one in an application.
SchedulerIngress = serve.deployment(serve.ingress()(SchedulerReplica.func_or_class))


def wants_stream(method: str, body: bytes) -> bool:
    """Whether a request asks for server-sent events: a POST with `"stream": true` in its JSON."""
    if method != "POST" or not body:
        return False
    try:
        parsed = json.loads(body)
    except ValueError:
        return False  # the scheduler answers invalid JSON with its own 400
    return isinstance(parsed, dict) and parsed.get("stream") is True


LOST_STREAM_EVENT = ("data: " + json.dumps({"error": {
    "message": "the cell serving this request was lost; POST /v1/requests/{id}/resume continues it "
               "from its stored tokens on another cell", "type": "cell_lost", "code": 503}})
    + "\n\n").encode()
"""The last event of a stream whose cell was lost (its node died) before the stream ended."""


CELL_INFO_FIELDS = ("cell", "node_id", "node_ip", "verifier", "drafter", "http", "grpc", "running")
"""What a cell's `info` answers (SchedulerReplica.info), and `GET /cells` shows for each cell."""


@dataclass
class _RoutedCell:
    """The router's view of one cell application."""

    app: str
    handle: object
    index: str
    """The cell's number (its application is `dspark-cell<index>`): the x-dspark-cell header."""
    in_flight: int = 0
    healthy: bool = True
    """False after `health_failures` failed checks in a row: no new requests, its streams end."""
    draining: bool = False
    """Scale-in: no new requests; the streams it runs go on until they end."""
    failures: int = 0
    info: dict = field(default_factory=dict)
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    unhealthy_since: float | None = None


def cell_handle(app: str):
    """The DeploymentHandle of a cell application's scheduler (its ingress deployment)."""
    return serve.get_app_handle(app)


def error_response(status: int, message: str, kind: str):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers={"retry-after": "1"})


@serve.deployment
@serve.ingress()
class Ingress:
    """The router of several cells (each its own Serve application, `dspark-cell<i>`): each
    request goes to the healthy cell with the fewest requests in flight here. A background task
    checks every cell (`info`, with a timeout); `health_failures` failures in a row take a cell out
    of routing and end the streams it was serving with a `cell_lost` event, so that their clients
    resume them on another cell. The cell controller adds, drains and removes cells
    (`add_cell`, `drain_cell`, `remove_cell`) and reads the load (`load`)."""

    async def __init__(self, cell_apps: list[str], health_period_s: float = 1.0,
                       health_timeout_s: float = 3.0, health_failures: int = 2) -> None:
        import time

        self.clock = time.monotonic
        self.cells: dict[str, _RoutedCell] = {}
        self.order: list[str] = []  # round-robin among equally loaded cells
        self.next_cell = 0
        self.health_period_s = health_period_s
        self.health_timeout_s = health_timeout_s
        self.health_failures = health_failures
        self.resume_locks: dict[str, asyncio.Lock] = {}
        for app in cell_apps:
            self._add(app)
        # Each cell checked once before the router serves, as a cell added later is, so that
        # `GET /cells` names its node and addresses from the first request on.
        await asyncio.gather(*(self._check(c) for c in self.cells.values()))
        self._checker = asyncio.get_running_loop().create_task(self._check_forever())

    def __serve_build_asgi_app__(self):
        """`GET /cells`, and every other request forwarded to a cell. The router has no docs of
        its own (FastAPI's are off), so /docs and /openapi.json are forwarded too: the
        scheduler's."""
        from fastapi import FastAPI

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/cells", self.list_cells, methods=["GET"])
        app.add_route("/{path:path}", self.route, methods=list(ROUTED_METHODS))
        return app

    # -- the controller's side ----------------------------------------------------------------
    def _add(self, app: str) -> _RoutedCell:
        if app not in self.cells:
            self.cells[app] = _RoutedCell(app, cell_handle(app),
                                          app.removeprefix(f"{APP_NAME}-cell"))
            self.order.append(app)
        return self.cells[app]

    async def add_cell(self, app: str) -> None:
        """Route to a cell application from now on; returns once it has been checked once (so
        that `GET /cells` shows its node and addresses)."""
        await self._check(self._add(app))

    def drain_cell(self, app: str) -> int:
        """No new requests for the cell; returns how many it still runs for the router."""
        cell = self.cells[app]
        cell.draining = True
        return cell.in_flight

    def remove_cell(self, app: str) -> None:
        cell = self.cells.pop(app, None)
        if cell is not None:
            self.order.remove(app)
            cell.lost.set()  # whatever it still streamed ends now

    def load(self) -> dict:
        """Per cell application: in flight, healthy, draining, seconds unhealthy, its node."""
        now = self.clock()
        return {app: {"in_flight": c.in_flight, "healthy": c.healthy, "draining": c.draining,
                      "unhealthy_s": None if c.unhealthy_since is None
                      else now - c.unhealthy_since,
                      "node_id": c.info.get("node_id"), "cell": c.info.get("cell")}
                for app, c in self.cells.items()}

    # -- health ----------------------------------------------------------------------------
    async def _check(self, cell: _RoutedCell) -> None:
        try:
            cell.info = await asyncio.wait_for(cell.handle.info.remote(), self.health_timeout_s)
        except Exception:  # timed out, its actor died, its replica is pending on a lost node
            cell.failures += 1
            if cell.failures >= self.health_failures and cell.healthy:
                cell.healthy = False
                cell.unhealthy_since = self.clock()
                cell.lost.set()
            return
        cell.failures = 0
        if not cell.healthy:  # it answers again (a slow cell, not a lost one)
            cell.healthy, cell.unhealthy_since, cell.lost = True, None, asyncio.Event()

    async def _check_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._check(c) for c in list(self.cells.values())))
            await asyncio.sleep(self.health_period_s)

    async def list_cells(self) -> dict:
        """`GET /cells`: every cell's addresses, node, health and requests in flight here; a cell
        whose check has not answered yet has the same fields, null."""
        return {"cells": [{**dict.fromkeys(CELL_INFO_FIELDS),
                           "cell": int(c.index) if c.index.isdigit() else c.index, **c.info,
                           "app": c.app, "healthy": c.healthy, "draining": c.draining,
                           "in_flight": c.in_flight} for c in self.cells.values()]}

    # -- routing ---------------------------------------------------------------------------
    def _open_cells(self) -> list[_RoutedCell]:
        return [self.cells[a] for a in self.order if self.cells[a].healthy
                and not self.cells[a].draining]

    def _pick(self) -> _RoutedCell | None:
        open_cells = self._open_cells()
        if not open_cells:
            return None
        n = len(open_cells)
        order = [open_cells[(self.next_cell + k) % n] for k in range(n)]
        cell = min(order, key=lambda c: c.in_flight)
        self.next_cell = (open_cells.index(cell) + 1) % n
        return cell

    async def _holder(self, request_id: str, headers: dict) -> _RoutedCell | None:
        """The healthy cell for `/v1/requests/{id}[/resume]`: the one whose engine loop runs it
        now, else the first that holds its record (every cell, with a shared Redis: any of them
        reads it, and resumes it when interrupted; with in-memory stores only the cell that ran
        it), else the least loaded (which answers the 404)."""
        cells = [c for c in self.cells.values() if c.healthy]
        answers = await asyncio.gather(
            *(asyncio.wait_for(c.handle.is_live.remote(request_id), self.health_timeout_s)
              for c in cells), return_exceptions=True)
        running = next((c for c, live in zip(cells, answers) if live is True), None)
        if running is not None:
            return running
        for cell in [c for c in self._open_cells()] + [c for c in cells if c.draining]:
            try:
                status, _, _ = await asyncio.wait_for(cell.handle.forward.remote(
                    "GET", f"/v1/requests/{request_id}", headers, b""), self.health_timeout_s)
            except Exception:
                continue
            if status != 404:
                return cell
        return self._pick()

    async def route(self, request):
        """A request for a cell (a Starlette request): sent to the least-loaded healthy one, or,
        for `/v1/requests/{id}[/resume]`, to the cell that runs it (else any healthy one: it
        reads the stored request, and resumes an interrupted one); its response comes back
        unchanged plus `x-dspark-cell`."""
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        call = (request.method, path, headers, body)
        if not request.url.path.startswith("/v1/requests/"):
            return await self._send(self._pick(), *call)
        request_id = request.url.path.removeprefix("/v1/requests/").removesuffix("/resume")
        if not request.url.path.endswith("/resume"):
            return await self._send(await self._holder(request_id, headers), *call)
        # One resume at a time per id through this router: two would find it not running on any
        # cell and run it twice.
        lock = self.resume_locks.setdefault(request_id, asyncio.Lock())
        async with lock:  # held until the cell answered or its stream started: it then runs it
            cell = await self._holder(request_id, headers)
            response = await self._send(cell, *call)
        if not lock.locked():
            self.resume_locks.pop(request_id, None)
        return response

    async def _send(self, cell: _RoutedCell | None, method: str, path: str, headers: dict,
                    body: bytes):
        """The cell's response; a cell that fails before answering anything (its node lost,
        not yet noticed) gets the request sent once more to another open cell."""
        if cell is None:
            return error_response(503, "no cell is serving; retry shortly", "no_cell")
        send = self._stream if wants_stream(method, body) else self._reply
        try:
            return await send(cell, method, path, headers, body)
        except _CellFailed as failed:
            self._check_soon(cell)
            other = self._pick()
            if other is not None and other is not cell and not path.startswith("/v1/requests/"):
                try:
                    return await send(other, method, path, headers, body)
                except _CellFailed as again:
                    self._check_soon(other)
                    failed = again
            return error_response(503, f"the cell serving this request failed "
                                       f"({failed.cause}); retry, or resume it by id",
                                  "cell_lost")

    def _check_soon(self, cell: _RoutedCell) -> None:
        asyncio.get_running_loop().create_task(self._check(cell))

    async def _reply(self, cell: _RoutedCell, method: str, path: str, headers: dict,
                     body: bytes):
        """The cell's whole response, counted in flight until it came."""
        from starlette.responses import Response

        cell.in_flight += 1
        try:
            status, content_type, data = await _unless_lost(
                cell, cell.handle.forward.remote(method, path, headers, body))
        except Exception as e:
            raise _CellFailed(type(e).__name__) from e
        finally:
            cell.in_flight -= 1
        return Response(data, status_code=status, media_type=content_type or None,
                        headers={"x-dspark-cell": cell.index})

    async def _stream(self, cell: _RoutedCell, method: str, path: str, headers: dict,
                      body: bytes):
        """The cell's response streamed through as it comes, counted in flight until it ends;
        a cell lost meanwhile ends it with LOST_STREAM_EVENT."""
        from starlette.responses import StreamingResponse

        cell.in_flight += 1
        chunks = cell.handle.options(stream=True).forward_stream.remote(
            method, path, headers, body)
        try:
            status, content_type = await _unless_lost(cell, chunks.__anext__())
        except Exception as e:
            cell.in_flight -= 1
            chunks.cancel()
            raise _CellFailed(type(e).__name__) from e

        async def relay():
            try:
                while True:
                    try:
                        chunk = await _unless_lost(cell, chunks.__anext__())
                    except StopAsyncIteration:
                        return
                    except Exception:
                        chunks.cancel()
                        self._check_soon(cell)
                        yield LOST_STREAM_EVENT
                        return
                    yield chunk
            finally:
                cell.in_flight -= 1

        return StreamingResponse(relay(), status_code=status, media_type=content_type or None,
                                 headers={"x-dspark-cell": cell.index})


class _CellFailed(Exception):
    """A cell failed a request before answering anything."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


async def _unless_lost(cell: _RoutedCell, awaitable):
    """Await a cell's answer, or raise ConnectionError as soon as the cell is declared lost."""
    answer = asyncio.ensure_future(awaitable)
    lost = asyncio.ensure_future(cell.lost.wait())
    try:
        await asyncio.wait({answer, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
    if not answer.done():
        answer.cancel()
        raise ConnectionError(f"cell {cell.app} lost")
    return answer.result()


# ------------------------------------------------------------------------------------------------
# Placement, building and running the application

CELL_RESOURCE = "dspark_cell"
"""A node started with `--resources '{"dspark_cell": N}'` hosts up to N cells (each scheduler
reserves one); when no node has it, cells go round-robin over every eligible node."""
NODE_LABEL = "ray.io/node-id"
"""Ray's label of every node: a replica's label_selector on it pins the replica to that node
(several Ray nodes on one host share an IP, so `node:<ip>` would not tell them apart)."""
HEAD_RESOURCE = "node:__internal_head__"


def cell_app_name(index: int) -> str:
    return f"{APP_NAME}-cell{index}"


def eligible_nodes(need_gpu: bool) -> list[dict]:
    """Alive nodes that may host cells: those with CELL_RESOURCE if any has it, else every alive
    node (with a GPU when one is needed), sorted by node id."""
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]
             and (not need_gpu or n["Resources"].get("GPU", 0) > 0)]
    slotted = [n for n in alive if n["Resources"].get(CELL_RESOURCE, 0) >= 1]
    return sorted(slotted or alive, key=lambda n: n["NodeID"])


def place_cells(count: int, need_gpu: bool, taken: list[str] = ()) -> list[dict]:
    """The node (ray.nodes() entry) of each of `count` new cells, given the node ids of the cells
    already placed (`taken`): the least-used node first, within each node's CELL_RESOURCE slots.
    Fewer than `count` when the nodes are full."""
    nodes = eligible_nodes(need_gpu)
    used = {n["NodeID"]: 0 for n in nodes}
    for node_id in taken:
        if node_id in used:
            used[node_id] += 1
    placed = []
    for _ in range(count):
        free = [n for n in nodes if CELL_RESOURCE not in n["Resources"]
                or used[n["NodeID"]] < n["Resources"][CELL_RESOURCE]]
        if not free:
            break
        node = min(free, key=lambda n: used[n["NodeID"]])  # stable: ties by node id
        used[node["NodeID"]] += 1
        placed.append(node)
    return placed


def new_internal_token() -> str:
    """A fresh internal token for one cell."""
    return secrets.token_urlsafe(32)


def check_cluster(config: RayServeConfig, cells: int) -> tuple[float, float]:
    """(verifier GPUs, drafter GPUs) per cell; refuses a cluster too small for `cells`, where
    Serve would wait for the resources forever."""
    import ray

    resources = ray.cluster_resources()
    verifier_gpus, drafter_gpus = config.gpus(resources.get("GPU", 0))
    services = 3 if config.with_drafter else 2
    need = {"CPU": cells * services * config.service_cpus,
            "GPU": cells * (verifier_gpus + (drafter_gpus if config.with_drafter else 0))}
    short = {k: (v, resources.get(k, 0)) for k, v in need.items() if v > resources.get(k, 0) + 1e-9}
    if short:
        raise ValueError("the Ray cluster is too small for this deployment: " + ", ".join(
            f"{k} {want:g} needed, {have:g} there" for k, (want, have) in short.items())
            + " (fewer --cells, smaller --service-cpus / --verifier-gpus / --drafter-gpus, or "
              "more nodes)")
    return verifier_gpus, drafter_gpus


def build_cell(config: RayServeConfig, index: int, node: dict | None, verifier_gpus: float,
               drafter_gpus: float, ingress: bool = False):
    """One cell's application graph, rooted at its scheduler: verifier, drafter and scheduler
    replicas pinned to `node` (None: anywhere) and sharing a fresh internal token. `ingress`: the
    scheduler is the HTTP ingress (a one-cell application without the router)."""
    verifier_cfg, drafter_cfg, scheduler_cfg = config.cell_configs(
        verifier_gpus, drafter_gpus, internal_token=new_internal_token())
    pin: dict = {}
    scheduler_resources: dict = {}
    if node is not None:
        pin["label_selector"] = {NODE_LABEL: node["NodeID"]}
        if CELL_RESOURCE in node["Resources"]:
            scheduler_resources[CELL_RESOURCE] = 1
    verifier = VerifierReplica.options(
        name=f"cell{index}-verifier", num_replicas=1,
        ray_actor_options={"num_cpus": config.service_cpus, "num_gpus": verifier_gpus, **pin}
    ).bind(verifier_cfg)
    drafter = None
    if config.with_drafter:
        drafter = DrafterReplica.options(
            name=f"cell{index}-drafter", num_replicas=1,
            ray_actor_options={"num_cpus": config.service_cpus, "num_gpus": drafter_gpus, **pin}
        ).bind(drafter_cfg)
    scheduler = SchedulerIngress if ingress else SchedulerReplica
    return scheduler.options(
        name=f"cell{index}-scheduler", num_replicas=1,
        # Requests wait in the engine loop, not in Ray's queue: let them all through.
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": config.service_cpus, "resources": scheduler_resources,
                           **pin}
    ).bind(index, verifier, drafter, scheduler_cfg)


def build_router(config: RayServeConfig, cell_apps: list[str]):
    """The router application, pinned to the head node (where the controller and, with
    HeadOnly, the proxy run)."""
    return Ingress.options(
        name="ingress", max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}}
    ).bind(cell_apps, config.health_period_s, config.health_timeout_s, config.health_failures)


def build_app(config: RayServeConfig) -> list[tuple[str, object]]:
    """The applications to run, (name, application graph) each: with one cell and no
    autoscaling, that cell as `dspark` (its scheduler is the ingress); else one application per
    cell (`dspark-cell<i>`, no HTTP route) and the router as `dspark`. Needs a connected Ray (to
    see its nodes and GPUs)."""
    verifier_gpus, drafter_gpus = check_cluster(config, config.cells)
    nodes = place_cells(config.cells, verifier_gpus > 0 or drafter_gpus > 0)
    if len(nodes) < config.cells:
        raise ValueError(f"the alive nodes{' with a GPU' if verifier_gpus or drafter_gpus else ''}"
                         f" have room ({CELL_RESOURCE} slots) for {len(nodes)} cells, "
                         f"{config.cells} asked for")
    if not config.routed:
        return [(APP_NAME, build_cell(config, 0, nodes[0], verifier_gpus, drafter_gpus,
                                      ingress=True))]
    cells = [(cell_app_name(i), build_cell(config, i, node, verifier_gpus, drafter_gpus))
             for i, node in enumerate(nodes)]
    return cells + [(APP_NAME, build_router(config, [name for name, _ in cells]))]


def run_apps(apps: list[tuple[str, object]], route: str | None = None,
             timeout_s: float = 900.0, node_ids: Sequence[str] = ()) -> None:
    """Deploy applications together (their replicas start in parallel) and return once all
    run; the router (APP_NAME) takes HTTP at `route`, the cells have no route. Raises if one
    fails to deploy, if one of `node_ids` (the nodes the applications are pinned to) dies before
    they run (their replicas would wait for it forever), or if they are not all running after
    `timeout_s` (a replica whose constructor hangs would otherwise hold the caller forever)."""
    import time

    import ray

    serve.run_many([serve.RunTarget(target=app, name=name,
                                    route_prefix=route if name == APP_NAME else None)
                    for name, app in apps], wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications
        states = {name: status[name] for name, _ in apps if name in status}
        failed = [n for n, a in states.items() if a.status in ("DEPLOY_FAILED", "UNHEALTHY")]
        if failed:
            raise RuntimeError(f"application {failed[0]} failed to deploy: "
                               f"{states[failed[0]].message}")
        if len(states) == len(apps) and all(a.status == "RUNNING" for a in states.values()):
            return
        if node_ids:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            dead = [n for n in node_ids if n not in alive]
            if dead:
                raise RuntimeError(f"node {dead[0]} died before {', '.join(n for n, _ in apps)} "
                                   "started on it")
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not running after {timeout_s:g} s: " + ", ".join(
                f"{n} {a.status}" for n, a in states.items()))
        time.sleep(0.5)


def deploy(config: RayServeConfig) -> str:
    """Deploy on the connected Ray (starting Serve's HTTP proxy); returns the ingress URL once
    every cell is ready."""
    # The deployment classes live in this file, which Ray's workers cannot import by name: ship
    # them by value.
    ray_register_by_value()
    apps = build_app(config)
    serve.start(proxy_location=config.proxy_location,
                http_options={"host": config.http_host, "port": config.http_port})
    # Returns once every replica's constructor has finished (services loaded and serving);
    # raises if one failed.
    run_apps(apps, route="/")
    host = "127.0.0.1" if config.http_host in ("0.0.0.0", "::") else config.http_host
    return f"http://{host}:{config.http_port}"


def ray_register_by_value() -> None:
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def undeploy() -> None:
    """Remove the router and every cell application (each replica's services drain and
    close); Serve's controller and Ray stay up."""
    names = [n for n in serve.status().applications
             if n == APP_NAME or n.startswith(f"{APP_NAME}-cell")]
    for name in [APP_NAME, *sorted(set(names) - {APP_NAME})]:
        if name in names:
            serve.delete(name)


def shutdown() -> None:
    """Take the application down (each replica's services drain and close) and leave Ray."""
    import ray

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


# ------------------------------------------------------------------------------------------------
# The cell controller: cells that follow the load, lost cells removed


class CellController:
    """Keeps the router's cells in line with the load, from the driver.

    Ray Serve's replica autoscaling scales one deployment; a cell is three deployments pinned
    together on one node, so the cell count is scaled here instead, with Serve's knobs: between
    `min_cells` and `max_cells`, aiming at `target_ongoing_requests` in flight per cell (the
    router's count), a cell added after `upscale_delay_s` above it and one drained after
    `downscale_delay_s` below it. Scale-in drains: the router sends the cell nothing new, and its
    application is deleted once its last stream has ended. A cell the router has found unhealthy
    (its node lost) is removed, and replaced when a node has room. Without autoscaling the target
    is `cells`.

    `step()` does one pass and returns what it did."""

    def __init__(self, config: RayServeConfig, router=None, clock=None) -> None:
        import time

        self.config = config
        self.router = router if router is not None else serve.get_app_handle(APP_NAME)
        self.clock = clock or time.monotonic
        self.above_since: float | None = None
        self.below_since: float | None = None
        self.next_index = config.cells
        self.history: list[tuple[float, dict]] = []
        """(clock, step()) of every step that changed something."""

    def desired(self, load: dict) -> int:
        """Cells the current load asks for (clamped to min/max; `cells` without autoscaling)."""
        if not self.config.autoscaling:
            return self.config.cells
        in_flight = sum(c["in_flight"] for c in load.values() if c["healthy"])
        wanted = math.ceil(in_flight / self.config.target_ongoing_requests)
        return max(self.config.min_cells, min(self.config.max_cells, wanted))

    def step(self) -> dict:
        now = self.clock()
        load = self.router.load.remote().result(timeout_s=60)
        did: dict = {"added": [], "draining": [], "draining_in_flight": [], "removed": [],
                     "lost": []}
        for app, cell in load.items():
            if not cell["healthy"] and (cell["unhealthy_s"] or 0) >= self.config.health_period_s:
                self.router.remove_cell.remote(app).result(timeout_s=60)
                serve.delete(app, _blocking=False)
                did["lost"].append(app)
            elif cell["draining"] and cell["in_flight"] == 0:
                self.router.remove_cell.remote(app).result(timeout_s=60)
                serve.delete(app)  # its scheduler drains whatever else it runs, then stops
                did["removed"].append(app)
        active = {a: c for a, c in load.items() if c["healthy"] and not c["draining"]}
        want = self.desired(load)
        self.above_since = None if want <= len(active) else \
            now if self.above_since is None else self.above_since
        self.below_since = None if want >= len(active) else \
            now if self.below_since is None else self.below_since
        grow_after = self.config.upscale_delay_s if self.config.autoscaling else 0.0
        if self.above_since is not None and now - self.above_since >= grow_after:
            taken = [c["node_id"] for c in load.values() if not c["draining"] and c["healthy"]]
            added = self.add_cells(want - len(active), taken)
            did["added"] += added
            if added:
                self.above_since = None
        if self.below_since is not None and now - self.below_since >= self.config.downscale_delay_s:
            # The least busy cell goes (the newest among equals).
            app = min(active, key=lambda a: (active[a]["in_flight"], -(active[a]["cell"] or 0)))
            did["draining_in_flight"].append(
                self.router.drain_cell.remote(app).result(timeout_s=60))
            did["draining"].append(app)
            self.below_since = None
        did["cells"] = len(active) + len(did["added"]) - len(did["draining"])
        did["wanted"] = want
        return did

    def add_cells(self, count: int, taken: list[str]) -> list[str]:
        """Start `count` cells on nodes with room (fewer when the nodes are full); each joins the
        router once it serves."""
        import ray

        verifier_gpus, drafter_gpus = self.config.gpus(ray.cluster_resources().get("GPU", 0))
        nodes = place_cells(count, verifier_gpus > 0 or drafter_gpus > 0, taken)
        apps = []
        for node in nodes:
            index, self.next_index = self.next_index, self.next_index + 1
            apps.append((cell_app_name(index), build_cell(self.config, index, node,
                                                          verifier_gpus, drafter_gpus)))
        if apps:
            try:
                run_apps(apps, node_ids=[node["NodeID"] for node in nodes])
            except Exception:  # a cell that cannot start leaves nothing behind
                for name, _ in apps:
                    serve.delete(name, _blocking=False)
                raise
            for name, _ in apps:
                self.router.add_cell.remote(name).result(timeout_s=60)
        return [name for name, _ in apps]

    def run(self, stop) -> None:
        """step() every controller_period_s until `stop` (a threading.Event) is set."""
        while not stop.wait(self.config.controller_period_s):
            try:
                did = self.step()
            except Exception as e:  # the router busy, a cell that failed to start: next period
                print(f"cells: step failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            if any(did[k] for k in ("added", "draining", "removed", "lost")):
                self.history.append((self.clock(), did))
                print(f"cells: {json.dumps(did)}", flush=True)


# ------------------------------------------------------------------------------------------------
# Entry points


def parse_args(argv: list[str] | None = None) -> RayServeConfig:
    parser = argparse.ArgumentParser(
        prog="python deploy/ray_serve.py",
        description="DSpark Serve on Ray Serve: N cells (verifier + drafter + scheduler) behind "
                    "one HTTP ingress")
    add_arguments(parser, RayServeConfig, ENV_PREFIX)
    args = parser.parse_args(argv)
    try:
        return from_args(RayServeConfig, args)
    except ValueError as e:
        parser.error(str(e))


def config_from_serve_args(args: dict) -> RayServeConfig:
    """A RayServeConfig from a Serve config file's `args` (flag names with `_` or `-`), over
    the DSPARK_RAY_* environment (where a RayService puts its secrets)."""
    return parse_args([f"--{k.replace('_', '-')}={v}" for k, v in (args or {}).items()])


def cell_app(args: dict):
    """Serve config builder (`import_path: deploy.ray_serve:cell_app`): cell `args["cell"]` of a
    declarative deployment (a KubeRay RayService), pinned to the `cell`-th node with room."""
    args = dict(args or {})
    index = int(args.pop("cell", 0))
    config = config_from_serve_args(args)
    verifier_gpus, drafter_gpus = check_cluster(config, 1)
    nodes = place_cells(index + 1, verifier_gpus > 0 or drafter_gpus > 0)
    node = nodes[index] if index < len(nodes) else None
    return build_cell(config, index, node, verifier_gpus, drafter_gpus)


def router_app(args: dict):
    """Serve config builder (`import_path: deploy.ray_serve:router_app`): the router over
    `args["cells"]` cell applications `dspark-cell0..`."""
    args = dict(args or {})
    cells = int(args.pop("cells", 1))
    config = config_from_serve_args({**args, "cells": cells})
    return build_router(config, [cell_app_name(i) for i in range(cells)])


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    import ray

    config = parse_args(argv)
    # Ray's start-up on a busy machine: its default 30 s wait for the GCS port file can pass.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "180")
    if config.address:
        ray.init(address=config.address)
    else:
        ray.init(num_cpus=config.num_cpus or None, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = deploy(config)
        print(f"DSpark Serve on Ray Serve: {config.cells} cell(s), ingress {url} "
              f"(POST {url}/v1/chat/completions, GET {url}/cells); Ctrl-C stops it", flush=True)
        if config.routed:  # lost cells replaced, and with --min/--max-cells the load followed
            CellController(config).run(stop)
        else:
            while not stop.wait(0.5):
                pass
    finally:
        if config.address:
            undeploy()
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
