#!/usr/bin/env bash
# Create .venv/ in the repo root and install DSpark Serve into it (pinned), idempotently.
# requirements.txt installs the package editable with all its extras (pyproject.toml); every
# package's version comes from constraints.txt. Re-running is cheap: the install is skipped while
# requirements.txt, constraints.txt and pyproject.toml are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

stamp=.venv/.dspark-install-stamp
want=$(cat requirements.txt constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check \
    -c constraints.txt -r requirements.txt
  echo "$want" > "$stamp"
fi
# Build the paged-attention CPU kernel now (about a minute, cached in ~/.cache/torch_extensions),
# so that the first runner a service or test starts does not pay for it; without a compiler the
# runner uses per-request SDPA instead.
.venv/bin/python -c "from dspark.models.paged_attention import cpu_kernel_available as ok; ok()" >/dev/null 2>&1 || true
