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
#
# Needs root, debootstrap and a Debian mirror (DEBIAN_MIRROR, default deb.debian.org). The images
# are tagged, so later builds reuse them until --force or `docker rmi`.
set -euo pipefail

PY_IMAGE="${DSPARK_BASE_IMAGE:-dspark-base:bookworm}"
REDIS_IMAGE="${DSPARK_REDIS_BASE_IMAGE:-dspark-redis-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# make_image NAME PACKAGES: debootstrap a minbase root with PACKAGES, import it as NAME.
make_image() {
  local name="$1" packages="$2" root
  root="$(mktemp -d /tmp/dspark-rootfs.XXXXXX)"
  # debootstrap mounts proc/sys inside the root while it works: never delete through a mount.
  trap 'umount -q "$root/proc" "$root/sys" 2>/dev/null || true; rm -rf --one-file-system "$root"' RETURN
  echo "debootstrap $SUITE ($packages) -> $name" >&2
  debootstrap --variant=minbase --include="$packages" "$SUITE" "$root" "$MIRROR" >/dev/null
  # Smaller image: apt's package lists, caches and docs are not needed at run time.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
         "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
  tar -C "$root" -c . | docker import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' \
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
