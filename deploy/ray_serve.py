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
- **router**: the ingress of several cells (deployment `ingress`, a `serve.ingress` FastAPI app).
  It sends each request to the least-loaded cell's scheduler through a DeploymentHandle (ties:
  round-robin; `/v1/requests/{id}` to the cell that holds it), whose replica runs it through its
  app as an ASGI call (`call_asgi`: no HTTP hop to the scheduler's REST server), and returns the
  response with the header `x-dspark-cell`; streamed (SSE) responses are streamed through.
  Ray Serve allows one `serve.ingress` deployment per application, so the schedulers behind the
  router are plain deployments (`SchedulerReplica`).
  `GET /cells` lists the cells and their addresses (with one cell: that cell).

Resources: every replica reserves `--service-cpus` logical CPUs; the verifier and drafter reserve
`--verifier-gpus` / `--drafter-gpus` GPUs (default: 0.5 each when the cluster has GPUs, so one
cell shares one GPU; 0 on a CPU-only cluster) and then run on `cuda`. A cell is pinned to one node
through Ray's per-node resource `node:<ip>`; cells are spread round-robin over the nodes that have
GPUs (every alive node when no GPU is asked for). Nothing of a cell listens beyond loopback: the
proxy and the router reach a cell through Ray, the scheduler its verifier and drafter over
127.0.0.1.

Internal token: each deployment of the application generates one (Python's `secrets`) and hands it
to every cell's verifier, drafter and scheduler in their configs (through Ray, not the command
line or the environment), so the verifier and the drafter take calls from their scheduler only
(metadata x-dspark-internal-token), not from other processes on the node.
Multi-node set-up: deploy/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

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
    redis_prefix: str = _field("dspark:", "key prefix; cell i writes under <prefix>cell<i>: "
                                          "(one scheduler per prefix)")
    service_cpus: float = _field(1.0, "logical CPUs each service replica reserves")
    verifier_gpus: float = _field(-1.0, "GPUs each verifier reserves (-1 = 0.5 when the cluster "
                                        "has GPUs, else 0); > 0 runs it on cuda")
    drafter_gpus: float = _field(-1.0, "GPUs each drafter reserves (-1 = as --verifier-gpus)")
    threads: int = _field(1, "torch CPU threads of each verifier and drafter")

    def __post_init__(self) -> None:
        if self.cells < 1:
            raise ValueError(f"cells must be >= 1, got {self.cells}")
        if self.service_cpus <= 0:
            raise ValueError("service_cpus must be > 0")
        if self.num_cpus < 0 or self.threads < 1:
            raise ValueError("num_cpus must be >= 0, threads >= 1")
        # The service configs validate the rest (policy, ports, sizes) when they are built.
        self.cell_configs()

    def gpus(self, cluster_gpus: float) -> tuple[float, float]:
        """(verifier GPUs, drafter GPUs) per cell, resolving -1 against the cluster."""
        verifier = self.verifier_gpus if self.verifier_gpus >= 0 else (0.5 if cluster_gpus else 0)
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
            api_keys=self.api_keys, redis_url=self.redis_url, drafter="",
            internal_token=internal_token)
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
        import torch

        from services.scheduler.main import start

        torch.set_num_threads(1)  # the scheduler only routes tensors; the model work is elsewhere
        self.cell = cell
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
        return {"cell": self.cell, "verifier": self.verifier_address,
                "drafter": self.scheduler.config.drafter or None,
                "http": self.base_url,
                "grpc": f"{self.scheduler.config.host}:{self.scheduler.grpc_port}",
                "running": self.scheduler.loop.num_running()}

    async def list_cells(self) -> dict:
        """`GET /cells`: this cell alone."""
        return {"cells": [self.info()]}

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


@serve.deployment
@serve.ingress()
class Ingress:
    """The router of several cells: each request goes to the cell with the fewest requests in
    flight here."""

    def __init__(self, *cells) -> None:
        self.cells = list(cells)
        self.in_flight = [0] * len(cells)
        self.next_cell = 0  # round-robin among equally loaded cells

    def __serve_build_asgi_app__(self):
        """`GET /cells`, and every other request forwarded to a cell. The router has no docs of
        its own (FastAPI's are off), so /docs and /openapi.json are forwarded too: the
        scheduler's."""
        from fastapi import FastAPI

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/cells", self.list_cells, methods=["GET"])
        app.add_route("/{path:path}", self.route, methods=list(ROUTED_METHODS))
        return app

    async def list_cells(self) -> dict:
        """`GET /cells`: every cell's addresses and requests running."""
        return {"cells": [await c.info.remote() for c in self.cells]}

    def _pick(self) -> int:
        n = len(self.cells)
        order = [(self.next_cell + k) % n for k in range(n)]
        cell = min(order, key=lambda i: self.in_flight[i])
        self.next_cell = (cell + 1) % n
        return cell

    async def _owner(self, path: str, headers: dict) -> int:
        """The cell whose store holds request `/v1/requests/{id}[/resume]` (each cell's scheduler
        keeps its own requests): the first that does not answer 404; cell 0 when none does
        (it then answers the 404 itself)."""
        request_path = path.removesuffix("/resume")
        for cell, handle in enumerate(self.cells):
            status, _, _ = await handle.forward.remote("GET", request_path, headers, b"")
            if status != 404:
                return cell
        return 0

    async def route(self, request):
        """A request for a cell (a Starlette request): sent to the least-loaded one, or to its
        owner for `/v1/requests/...`; its response comes back unchanged plus `x-dspark-cell`."""
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        if request.url.path.startswith("/v1/requests/"):
            cell = await self._owner(request.url.path, headers)
        else:
            cell = self._pick()
        call = (request.method, path, headers, body)
        if wants_stream(request.method, body):
            return await self._stream(cell, *call)
        return await self._reply(cell, *call)

    async def _reply(self, cell: int, method: str, path: str, headers: dict, body: bytes):
        """The cell's whole response, counted in flight until it came."""
        from starlette.responses import Response

        self.in_flight[cell] += 1
        try:
            status, content_type, data = await self.cells[cell].forward.remote(
                method, path, headers, body)
        finally:
            self.in_flight[cell] -= 1
        return Response(data, status_code=status, media_type=content_type or None,
                        headers={"x-dspark-cell": str(cell)})

    async def _stream(self, cell: int, method: str, path: str, headers: dict, body: bytes):
        """The cell's response streamed through as it comes, counted in flight until it ends."""
        from starlette.responses import StreamingResponse

        self.in_flight[cell] += 1
        chunks = self.cells[cell].options(stream=True).forward_stream.remote(
            method, path, headers, body)
        try:
            status, content_type = await chunks.__anext__()
        except BaseException:
            self.in_flight[cell] -= 1
            raise

        async def relay():
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                self.in_flight[cell] -= 1

        return StreamingResponse(relay(), status_code=status, media_type=content_type or None,
                                 headers={"x-dspark-cell": str(cell)})


# ------------------------------------------------------------------------------------------------
# Building and running the application


def cell_nodes(cells: int, need_gpu: bool) -> list[str]:
    """The node IP each cell is pinned to: round-robin over alive nodes (with GPUs if needed)."""
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]
             and (not need_gpu or n["Resources"].get("GPU", 0) > 0)]
    if not nodes:
        raise SystemExit("no alive Ray node" + (" with a GPU" if need_gpu else ""))
    ips = sorted(n["NodeManagerAddress"] for n in nodes)
    return [ips[i % len(ips)] for i in range(cells)]


def new_internal_token() -> str:
    """A fresh internal token for one deployment of the application."""
    return secrets.token_urlsafe(32)


def build_app(config: RayServeConfig):
    """The application graph: `cells` x (verifier, drafter, scheduler); its ingress is the
    cell's scheduler with one cell, the router over them with several. Needs a connected Ray (to
    see its nodes and GPUs)."""
    import ray

    resources = ray.cluster_resources()
    verifier_gpus, drafter_gpus = config.gpus(resources.get("GPU", 0))
    services = 3 if config.with_drafter else 2
    need = {"CPU": config.cells * services * config.service_cpus,
            "GPU": config.cells * (verifier_gpus + (drafter_gpus if config.with_drafter else 0))}
    short = {k: (v, resources.get(k, 0)) for k, v in need.items() if v > resources.get(k, 0) + 1e-9}
    if short:  # Serve would wait for them forever
        raise ValueError("the Ray cluster is too small for this deployment: " + ", ".join(
            f"{k} {want:g} needed, {have:g} there" for k, (want, have) in short.items())
            + " (fewer --cells, smaller --service-cpus / --verifier-gpus / --drafter-gpus, or "
              "more nodes)")
    verifier_cfg, drafter_cfg, scheduler_cfg = config.cell_configs(
        verifier_gpus, drafter_gpus, internal_token=new_internal_token())
    nodes = cell_nodes(config.cells, verifier_gpus > 0 or drafter_gpus > 0)
    scheduler = SchedulerIngress if config.cells == 1 else SchedulerReplica
    schedulers = []
    for i, ip in enumerate(nodes):
        # A sliver of the node's own resource pins every replica of the cell to that node.
        pin = {f"node:{ip}": 0.001}
        verifier = VerifierReplica.options(
            name=f"cell{i}-verifier", num_replicas=1,
            ray_actor_options={"num_cpus": config.service_cpus, "num_gpus": verifier_gpus,
                               "resources": pin}).bind(verifier_cfg)
        drafter = None
        if config.with_drafter:
            drafter = DrafterReplica.options(
                name=f"cell{i}-drafter", num_replicas=1,
                ray_actor_options={"num_cpus": config.service_cpus, "num_gpus": drafter_gpus,
                                   "resources": pin}).bind(drafter_cfg)
        schedulers.append(scheduler.options(
            name=f"cell{i}-scheduler", num_replicas=1,
            # Requests wait in the engine loop, not in Ray's queue: let them all through.
            max_ongoing_requests=10_000,
            ray_actor_options={"num_cpus": config.service_cpus, "resources": pin}
        ).bind(i, verifier, drafter,
               dataclasses.replace(scheduler_cfg, redis_prefix=f"{config.redis_prefix}cell{i}:")))
    if config.cells == 1:  # the proxy hands HTTP to the scheduler's app itself: no router hop
        return schedulers[0]
    return Ingress.options(name="ingress", max_ongoing_requests=10_000,
                           ray_actor_options={"num_cpus": 0}).bind(*schedulers)


def deploy(config: RayServeConfig) -> str:
    """Deploy on the connected Ray (starting Serve's HTTP proxy); returns the ingress URL once
    every cell is ready."""
    import ray

    # The deployment classes live in this file, which Ray's workers cannot import by name: ship
    # them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    app = build_app(config)
    serve.start(http_options={"host": config.http_host, "port": config.http_port})
    # Returns once every replica's constructor has finished (services loaded and serving);
    # raises if one failed.
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    host = "127.0.0.1" if config.http_host in ("0.0.0.0", "::") else config.http_host
    return f"http://{host}:{config.http_port}"


def shutdown() -> None:
    """Take the application down (each replica's services drain and close) and leave Ray."""
    import ray

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


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


def main(argv: list[str] | None = None) -> int:
    import ray

    from dspark.serving.grpc_runtime import wait_for_signal

    config = parse_args(argv)
    if config.address:
        ray.init(address=config.address)
    else:
        ray.init(num_cpus=config.num_cpus or None, include_dashboard=False)
    try:
        url = deploy(config)
        print(f"DSpark Serve on Ray Serve: {config.cells} cell(s), ingress {url} "
              f"(POST {url}/v1/chat/completions, GET {url}/cells); Ctrl-C stops it", flush=True)
        wait_for_signal()
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
