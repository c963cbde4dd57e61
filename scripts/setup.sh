#!/usr/bin/env bash
# Create .venv/ in the repo root and install DSpark Serve into it (pinned), idempotently.
# Re-running is cheap: the install is skipped while requirements/constraints are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

stamp=.venv/.dspark-install-stamp
want=$(cat requirements.txt constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check \
    -c constraints.txt -r requirements.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check \
    --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
# gRPC stubs from protos/ (gitignored; dspark/serving/protos.py also regenerates stale ones).
.venv/bin/python -m dspark.serving.protos >/dev/null
