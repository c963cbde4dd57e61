#!/usr/bin/env bash
# Makes the local base images that deploy/Dockerfile and deploy/redis.Dockerfile build on when no
# image registry is reachable: a minimal Debian bookworm root from debootstrap, imported with
# `docker import`.
#
#   bash deploy/make_base_image.sh            # makes the missing ones of the two images below
#   bash deploy/make_base_image.sh --force    # makes both again
#
#   dspark-base:bookworm        python3 (3.11), python3-venv, ca-certificates
#   dspark-redis-base:bookworm  redis-server
#   dspark-prometheus:bookworm  Debian's prometheus, its entry point, run as user prometheus
#                               (the monitoring profile's PROMETHEUS_IMAGE; Grafana has no
#                               Debian package, so no local image of it is made)
#
# Needs root, debootstrap and a Debian mirror (DEBIAN_MIRROR, default deb.debian.org). The images
# are tagged, so later builds reuse them until --force or `docker rmi`.
set -euo pipefail

PY_IMAGE="${DSPARK_BASE_IMAGE:-dspark-base:bookworm}"
REDIS_IMAGE="${DSPARK_REDIS_BASE_IMAGE:-dspark-redis-base:bookworm}"
PROMETHEUS_IMAGE="${DSPARK_PROMETHEUS_IMAGE:-dspark-prometheus:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# make_image NAME PACKAGES [CHANGE...]: debootstrap a minbase root with PACKAGES, import it as
# NAME with the extra Dockerfile instructions CHANGE (`docker import --change`).
make_image() {
  local name="$1" packages="$2" root change
  local changes=()
  for change in "${@:3}"; do changes+=(--change "$change"); done
  root="$(mktemp -d /tmp/dspark-rootfs.XXXXXX)"
  # debootstrap mounts proc/sys inside the root while it works: never delete through a mount.
  trap 'umount -q "$root/proc" "$root/sys" 2>/dev/null || true; rm -rf --one-file-system "$root"' RETURN
  echo "debootstrap $SUITE ($packages) -> $name" >&2
  debootstrap --variant=minbase --include="$packages" "$SUITE" "$root" "$MIRROR" >/dev/null
  # Prometheus keeps its data in /prometheus (the compose file's --storage.tsdb.path).
  if [[ -x "$root/usr/bin/prometheus" ]]; then
    mkdir -p "$root/prometheus"
    chroot "$root" chown prometheus:prometheus /prometheus
  fi
  # Smaller image: apt's package lists, caches and docs are not needed at run time.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
         "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
  tar -C "$root" -c . | docker import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' "${changes[@]}" \
      - "$name" >/dev/null
  echo "made $name ($(docker image inspect -f '{{.Size}}' "$name") bytes)" >&2
}

command -v debootstrap >/dev/null || { echo "error: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
if [[ $FORCE == 1 ]] || ! have_image "$PY_IMAGE"; then
  make_image "$PY_IMAGE" python3,python3-venv,ca-certificates
fi
if [[ $FORCE == 1 ]] || ! have_image "$REDIS_IMAGE"; then
  make_image "$REDIS_IMAGE" redis-server
fi
if [[ $FORCE == 1 ]] || ! have_image "$PROMETHEUS_IMAGE"; then
  make_image "$PROMETHEUS_IMAGE" prometheus 'USER prometheus' 'WORKDIR /prometheus' \
      'ENTRYPOINT ["/usr/bin/prometheus"]'
fi
