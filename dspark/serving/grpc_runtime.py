"""What every service process does the same way: structured logs, a gRPC server with the standard
health service, and graceful shutdown on SIGTERM / SIGINT.

Shutdown order: health flips to NOT_SERVING (load balancers and the scheduler stop sending new
work), then `server.stop(grace)` lets in-flight calls (a round being drafted or verified) finish
for up to `grace` seconds before the rest are cancelled.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dspark.serving.auth import InternalTokenInterceptor, with_internal_token

# Threads for the gRPC server's handlers. The model calls are serialised by each servicer's own
# lock; the threads only let health checks and streams be answered while a call is running.
SERVER_THREADS = 16
# Messages carry tensors (a dense [gamma, V] draft distribution of a 49k vocabulary is ~1.5 MB).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# The public Generation API carries prompts, not tensors: a request beyond 4 MiB is refused by
# gRPC itself (RESOURCE_EXHAUSTED) before anything is parsed, far above the prompt cap
# (SchedulerConfig.max_prompt_chars).
PUBLIC_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# A restarting service is retried within a second: gRPC's default reconnect backoff grows to
# two minutes, far too long for a drafter or verifier that is back after a few seconds.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, message and any `extra` fields."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                 "service": self.service, "msg": record.getMessage()}
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def service_logger(service: str) -> logging.Logger:
    logger = logging.getLogger(f"dspark.{service}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(service))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def log_event(logger: logging.Logger, message: str, **fields) -> None:
    logger.info(message, extra={"fields": fields})


def channel(address: str, internal_token: str = "") -> grpc.Channel:
    """A channel to a service; with a token, every call carries it (dspark.serving.auth)."""
    return with_internal_token(grpc.insecure_channel(address, options=CHANNEL_OPTIONS),
                               internal_token)


def new_server(interceptors: tuple = (), threads: int = SERVER_THREADS,
               max_message_bytes: int = MAX_MESSAGE_BYTES
               ) -> tuple[grpc.Server, health.HealthServicer]:
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads),
                         interceptors=interceptors, options=options)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Listen on host:port (port 0: any free port); returns the port actually bound."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return bound


def set_serving(health_servicer: health.HealthServicer, services: list[str], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *services]:
        health_servicer.set(name, status)


def start_server(servicer, add_to_server, service_name: str, host: str, port: int,
                 internal_token: str = "") -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server with `servicer` (added by its generated `add_..._to_server`) and the health
    service marking `service_name` SERVING; returns (server, health, bound port). With a token,
    every call but health checks must carry it (dspark.serving.auth)."""
    server, health_servicer = new_server(interceptors=(InternalTokenInterceptor(internal_token),))
    add_to_server(servicer, server)
    bound = bind(server, host, port)
    server.start()
    set_serving(health_servicer, [service_name], True)
    return server, health_servicer, bound


def wait_for_signal() -> None:
    """Block the main thread until SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def drain(server: grpc.Server, health_servicer: health.HealthServicer, services: list[str],
          grace_seconds: float, logger: logging.Logger,
          before_stop: Callable[[], None] | None = None) -> None:
    set_serving(health_servicer, services, False)
    if before_stop is not None:
        before_stop()
    start = time.monotonic()
    server.stop(grace_seconds).wait()
    log_event(logger, "stopped", drained_seconds=round(time.monotonic() - start, 3))


def is_serving(address: str, timeout: float = 1.0) -> bool:
    """Ask a service's standard health endpoint."""
    try:
        with channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
