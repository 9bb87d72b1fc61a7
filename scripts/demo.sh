#!/usr/bin/env bash
# Builds and runs the main example: a gated attention layer produced by PyTorch
# (tests/data/demo_layer.safetensors) run through gattn and compared with PyTorch's output.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
build="${BUILD_DIR:-build/demo}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGATTN_BUILD_TESTS=OFF \
      -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_ARCH_FLAGS="${GATTN_ARCH_FLAGS:--march=native}" >/dev/null
cmake --build "$build" -j "$(nproc)" --target layer_from_pytorch
"$build/examples/layer_from_pytorch" tests/data/demo_layer.safetensors
