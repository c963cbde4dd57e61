"""Service processes on loopback: start one, wait until it serves, stop it cleanly.

Used by `dspark up` (the whole stack as local processes), by bench/services.py and by the tests.
A service is a child process running `python -m services.<name>`; readiness is the standard gRPC
health check (drafter, verifier) or GET /health (scheduler); stopping sends SIGTERM (the service
drains) and kills only after a timeout.
"""

from __future__ import annotations

import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dspark.paths import REPO_ROOT

_PORTS_HANDED_OUT: set[int] = set()
"""Every port `free_port` returned in this process: a stack asks for several before any service
binds one, and the kernel may offer a port it just released again."""

LOWEST_PORT = 10000


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; IANA's elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a service to bind a moment later.

    Chosen at random below the kernel's ephemeral range, so that no outgoing connection (a gRPC
    channel, a client) takes it as its local port in that moment, and never one this process
    handed out before, so that the services of one stack never share a port. Another process may
    still take it first; that is rare (one pick in about 20,000)."""
    low, _ = ephemeral_port_range()
    candidates = range(LOWEST_PORT, low) if low - LOWEST_PORT >= 1000 else None
    for _ in range(200):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", random.choice(candidates) if candidates else 0))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _PORTS_HANDED_OUT:
            _PORTS_HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port on 127.0.0.1")


@dataclass
class ServiceProcess:
    """One service as a child process; its output goes to `log_dir/<name>.log` (None: inherit)."""

    name: str
    module_args: list[str]
    """e.g. ["services.verifier", "--port", "50052"]."""
    log_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def start(self) -> "ServiceProcess":
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                           os.environ.get("PYTHONPATH")])),
               **self.env}
        out = None
        if self.log_dir is not None:
            self._log = open(self.log_dir / f"{self.name}.log", "ab")
            out = self._log
        self.proc = subprocess.Popen([sys.executable, "-m", *self.module_args], cwd=REPO_ROOT,
                                     env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        return self

    def log_text(self) -> str:
        if self.log_dir is None:
            return ""
        return (self.log_dir / f"{self.name}.log").read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise RuntimeError(f"{self.name} exited ({code}):\n{self.log_text()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Signal and wait; kill if it has not exited after `timeout` seconds."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_dir is not None and not self._log.closed:
            self._log.close()
        return self.proc.returncode


def wait_grpc(service: ServiceProcess, address: str, timeout: float = 300.0) -> None:
    from dspark.serving.grpc_runtime import is_serving

    deadline = time.monotonic() + timeout
    while not is_serving(address):
        service.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service.name} not serving at {address}:\n{service.log_text()}")
        time.sleep(0.2)


def wait_http(service: ServiceProcess, port: int, host: str = "127.0.0.1",
              timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        service.check_alive()
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass  # not up yet, or another server holds the port: the service's exit says which
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service.name} not serving on {port}:\n{service.log_text()}")
        time.sleep(0.2)
