"""Creates the DSpark stack's secrets in its secrets volume before any service starts
(docker-compose.yml's `secrets` service; every start, idempotent).

- `api_keys`: the scheduler's accepted Bearer keys, one a line. Taken from DSPARK_API_KEYS
  (comma-separated) when set; else kept from an earlier start; else one key is generated and
  printed once (`docker compose logs secrets` shows it while that container exists).
- `redis_password` and `redis.conf` (`requirepass`): generated on the first start, kept after.
- `internal_token`: the shared secret the scheduler sends to the verifier and the drafter
  (metadata x-dspark-internal-token; the three read it through
  DSPARK_<SERVICE>_INTERNAL_TOKEN_FILE). Generated on the first start, kept after.

Files are mode 0600, owned by the image's user (uid 10001, shared with the Redis image).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

API_KEY_PREFIX = "dsk-"


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only, replacing it atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def ensure_api_keys(folder: Path, given: str) -> str:
    """Returns the line to print about the keys."""
    path = folder / "api_keys"
    keys = [k.strip() for k in given.split(",") if k.strip()]
    if keys:
        write_private(path, "\n".join(keys) + "\n")
        return f"API keys: {len(keys)} from DSPARK_API_KEYS"
    if path.is_file() and path.read_text().strip():
        return "API keys: kept from the secrets volume"
    key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    write_private(path, key + "\n")
    return f"API key (generated, shown only at this first start): {key}"


def ensure_redis_password(folder: Path) -> None:
    path = folder / "redis_password"
    if not (path.is_file() and path.read_text().strip()):
        write_private(path, secrets.token_hex(32) + "\n")
    password = path.read_text().strip()
    write_private(folder / "redis.conf", f"requirepass {password}\n")


def ensure_internal_token(folder: Path) -> None:
    path = folder / "internal_token"
    if not (path.is_file() and path.read_text().strip()):
        write_private(path, secrets.token_urlsafe(32) + "\n")


def main() -> int:
    folder = Path(os.environ.get("DSPARK_SECRETS_DIR", "/run/dspark-secrets"))
    if not folder.is_dir():
        print(f"error: secrets folder {folder} does not exist", file=sys.stderr)
        return 1
    print(ensure_api_keys(folder, os.environ.get("DSPARK_API_KEYS", "")))
    ensure_redis_password(folder)
    ensure_internal_token(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
