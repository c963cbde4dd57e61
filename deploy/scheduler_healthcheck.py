"""The scheduler container's healthcheck: exit 0 only when the scheduler answers on REST and
gRPC and everything it serves with is up: its verifier and drafter (gRPC health SERVING) and
Redis (PING with the stack's password). Prints one line per part, so `docker inspect` shows
which one failed. Reads the scheduler's own settings from its environment (DSPARK_SCHEDULER_*,
DSPARK_REDIS_ADDRESS, DSPARK_SECRETS_DIR)."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

from dspark.serving.grpc_runtime import is_serving

TIMEOUT_SECONDS = 3.0


def rest_health(port: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                    timeout=TIMEOUT_SECONDS) as reply:
            body = json.loads(reply.read())
    except (OSError, ValueError) as e:
        return False, str(e)
    return body.get("status") == "ok", json.dumps(body)


def redis_ping(address: str, secrets_dir: Path) -> tuple[bool, str]:
    import redis

    host, _, port = address.rpartition(":")
    password_file = secrets_dir / "redis_password"
    password = password_file.read_text().strip() if password_file.is_file() else None
    try:
        client = redis.Redis(host=host, port=int(port), password=password,
                             socket_timeout=TIMEOUT_SECONDS,
                             socket_connect_timeout=TIMEOUT_SECONDS)
        return bool(client.ping()), "PONG"
    except redis.RedisError as e:
        return False, str(e)


def main() -> int:
    env = os.environ
    checks: list[tuple[str, bool, str]] = []
    ok, detail = rest_health(env.get("DSPARK_SCHEDULER_HTTP_PORT", "8000"))
    checks.append(("scheduler REST /health", ok, detail))
    grpc_port = env.get("DSPARK_SCHEDULER_GRPC_PORT", "50050")
    for name, address in (("scheduler gRPC", f"127.0.0.1:{grpc_port}"),
                          ("verifier", env.get("DSPARK_SCHEDULER_VERIFIER", "127.0.0.1:50052")),
                          ("drafter", env.get("DSPARK_SCHEDULER_DRAFTER", "127.0.0.1:50051"))):
        if address:
            ok = is_serving(address, timeout=TIMEOUT_SECONDS)
            checks.append((f"{name} {address}", ok, "SERVING" if ok else "not serving"))
    redis_address = env.get("DSPARK_REDIS_ADDRESS", "")
    if redis_address:
        ok, detail = redis_ping(redis_address,
                                Path(env.get("DSPARK_SECRETS_DIR", "/run/dspark-secrets")))
        checks.append((f"redis {redis_address}", ok, detail))
    for name, ok, detail in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
