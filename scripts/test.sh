#!/usr/bin/env bash
# Builds gattn's tests, examples and benchmarks and runs the test suite with ctest, twice: at
# the compiler's baseline instruction set (x86-64: SSE2) and with -march=native (e.g. AVX-512),
# so both the portable and the widest SIMD paths are tested.
# Environment: BUILD_DIR (default build/test; flavours go to BUILD_DIR-<flavour>),
# JOBS (default: all cores), FLAVOURS (default "baseline native"), CMAKE_ARGS (extra CMake args).
set -euo pipefail
cd "$(dirname "$0")/.."

# Drops the per-target and per-test progress lines; failures and summaries stay.
quiet() { grep -Ev '^\[ *[0-9]+%\] (Building|Linking|Built)|^ +Start +[0-9]+: |Test +#[0-9]+: .* Passed' || true; }

scripts/deps.sh test
build="${BUILD_DIR:-build/test}"
jobs="${JOBS:-$(nproc)}"
for flavour in ${FLAVOURS:-baseline native}; do
  case "$flavour" in
    baseline) arch="" ;;
    native) arch="-march=native" ;;
    *) echo "unknown flavour $flavour" >&2; exit 2 ;;
  esac
  echo "== $flavour build (GATTN_ARCH_FLAGS='$arch')"
  cmake -S . -B "$build-$flavour" -DCMAKE_BUILD_TYPE=Release -DGATTN_ARCH_FLAGS="$arch" ${CMAKE_ARGS:-} >/dev/null
  cmake --build "$build-$flavour" -j "$jobs" 2>&1 | quiet
  ctest --test-dir "$build-$flavour" -j "$jobs" --output-on-failure 2>&1 | quiet
done
