#!/usr/bin/env bash
# Builds gattn's tests, examples and benchmarks and runs the test suite with ctest.
# Usage: scripts/test.sh            (build directory: build/test, override with BUILD_DIR)
# Extra CMake arguments may be given in CMAKE_ARGS, e.g. CMAKE_ARGS="-DGATTN_ARCH_FLAGS=-march=native".
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
build="${BUILD_DIR:-build/test}"
jobs="${JOBS:-$(nproc)}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" -j "$jobs" --output-on-failure
