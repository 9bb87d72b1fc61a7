#!/usr/bin/env bash
# Builds and runs the main example: a gated attention layer produced by PyTorch
# (tests/data/demo_layer.safetensors) run through gattn and compared with PyTorch's output.
# Environment: BUILD_DIR (default build/demo), JOBS (default: all cores),
# GATTN_ARCH_FLAGS (default -march=native).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh library
build="${BUILD_DIR:-build/demo}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGATTN_BUILD_TESTS=OFF \
      -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_ARCH_FLAGS="${GATTN_ARCH_FLAGS--march=native}" >/dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target layer_from_pytorch >/dev/null
"$build/examples/layer_from_pytorch" tests/data/demo_layer.safetensors
