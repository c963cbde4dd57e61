#!/usr/bin/env bash
# Builds the images and runs the containerised stack for real: `docker-compose up` with every
# container on the host network (deploy/docker-compose.hostnet.yml, 127.0.0.1 only), then
# deploy/compose_check.py's steps (exact outputs against the embedded engine over REST and gRPC,
# drafter killed mid-stream, scheduler restarted with stored requests, down and up again).
#
#   bash deploy/compose_check.sh [--cold] [--report FILE]
#
# Where no registry is reachable (this project's CI) the base images come from
# deploy/make_base_image.sh (debootstrap) and the Python wheels from deploy/make_wheelhouse.sh
# (this machine's pip): set DSPARK_BASE_IMAGE / DSPARK_REDIS_BASE_IMAGE to use others. Kept
# between runs, so later runs are faster: the base images, the build cache, the wheelhouse and
# the prepared model's volume. --cold builds without the build cache.
# Needs a Docker daemon, docker-compose (1.28+) and the repository's .venv. Ends with
# `docker-compose down` (volumes kept).
set -euo pipefail
cd "$(dirname "$0")/.."

COLD=0
REPORT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cold) COLD=1 ;;
    --report) REPORT="$2"; shift ;;
    *) echo "usage: $0 [--cold] [--report FILE]" >&2; exit 2 ;;
  esac
  shift
done

PY="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PROJECT="${DSPARK_COMPOSE_PROJECT:-dsparkcheck}"
# docker-compose.yml with the host-network override, merged into one file without the published
# ports (docker-compose 1.x refuses port bindings on the host network, and an override cannot
# remove them).
MERGED="$(mktemp /tmp/dspark-compose-check.XXXXXX.yml)"
trap 'rm -f "$MERGED"' EXIT
merge() {
  docker-compose -f docker-compose.yml -f deploy/docker-compose.hostnet.yml "$@" config |
    "$PY" -c '
import sys, yaml
config = yaml.safe_load(sys.stdin)
for service in config["services"].values():
    if service.get("network_mode") == "host":
        service.pop("ports", None)
yaml.safe_dump(config, sys.stdout, sort_keys=False)' >"$MERGED"
}
compose() { docker-compose -p "$PROJECT" -f "$MERGED" "$@"; }
now() { date +%s.%N; }
elapsed() { "$PY" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

check_start="$(now)"
# One check at a time on a machine: they share the project's names and ports.
exec 9>/tmp/dspark-compose-check.lock
flock -w 1800 9 || { echo "error: another compose check holds /tmp/dspark-compose-check.lock" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "error: no Docker daemon answers" >&2; exit 1; }
command -v docker-compose >/dev/null || { echo "error: docker-compose is not installed" >&2; exit 1; }
for port in 18000 15050 15051 15052 16379; do
  if "$PY" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', int(sys.argv[1]))) != 0)" "$port"; then
    echo "error: 127.0.0.1:$port is in use; the check's stack needs it" >&2; exit 1
  fi
done

start="$(now)"
if [[ -z "${DSPARK_BASE_IMAGE:-}" ]]; then
  bash deploy/make_base_image.sh
  export DSPARK_BASE_IMAGE=dspark-base:bookworm DSPARK_REDIS_BASE_IMAGE=dspark-redis-base:bookworm
  export PROMETHEUS_IMAGE="${PROMETHEUS_IMAGE:-dspark-prometheus:bookworm}"
fi
if ! ls deploy/wheelhouse/torch-*.whl >/dev/null 2>&1 || ! ls deploy/wheelhouse/models/*.whl >/dev/null 2>&1 \
    || [[ deploy/requirements.txt -nt deploy/wheelhouse/.filled ]] || [[ constraints.txt -nt deploy/wheelhouse/.filled ]]; then
  bash deploy/make_wheelhouse.sh "$PY"
  touch deploy/wheelhouse/.filled
fi
prepare_seconds="$(elapsed "$start")"
echo "compose check: base images and wheelhouse ready in ${prepare_seconds} s" >&2
merge
# Start from no containers of the project (a run stopped half-way leaves some), fresh secrets
# (so the first start generates the API key) and an empty Redis; the model volume stays.
compose down --remove-orphans >/dev/null 2>&1 || true
docker volume rm -f "${PROJECT}_dspark-secrets" "${PROJECT}_redis-data" >/dev/null
trap 'compose down --remove-orphans >/dev/null 2>&1 || true; rm -f "$MERGED"' EXIT

build_args=()
[[ $COLD == 1 ]] && build_args+=(--no-cache)
start="$(now)"
compose build -q "${build_args[@]}"
build_seconds="$(elapsed "$start")"
image_bytes="$(docker image inspect -f '{{.Size}}' dspark-serve:latest)"
echo "compose check: built in ${build_seconds} s ($([[ $COLD == 1 ]] && echo cold || echo with the build cache));" \
     "dspark-serve:latest is ${image_bytes} bytes" >&2

# The monitoring profile's services (Prometheus, Grafana) are started too where their images are
# here (no registry to pull them from): deploy/make_base_image.sh makes a Prometheus image from
# Debian's package; Grafana has none.
monitoring_args=()
merge --profile monitoring
while read -r service image; do
  if docker image inspect "$image" >/dev/null 2>&1; then
    monitoring_args+=(--monitoring-service "$service")
  else
    echo "compose check: $service not started: its image $image is not here" >&2
  fi
done < <("$PY" -c '
import sys, yaml
services = yaml.safe_load(open(sys.argv[1]))["services"]
for name, s in services.items():
    if "monitoring" in s.get("profiles", []):
        print(name, s.get("image", ""))' "$MERGED")

report="${REPORT:-$(mktemp /tmp/dspark-compose-check.XXXXXX.json)}"
set +e
"$PY" deploy/compose_check.py --project "$PROJECT" --file "$MERGED" "${monitoring_args[@]}" --report "$report"
code=$?
set -e
"$PY" - "$report" "$(elapsed "$check_start")" "$prepare_seconds" "$build_seconds" "$image_bytes" "$COLD" <<'PYEOF'
import json, sys
path, check_seconds, prepare_seconds, build_seconds, image_bytes, cold = sys.argv[1:]
report = json.loads(open(path).read())
report["check_seconds"] = float(check_seconds)
report["base_images_and_wheelhouse_seconds"] = float(prepare_seconds)
report["build_seconds"] = float(build_seconds)
report["build_cold"] = cold == "1"
report["image_bytes"] = int(image_bytes)
open(path, "w").write(json.dumps(report, indent=2) + "\n")
PYEOF
echo "compose check: report in $report" >&2
exit $code
