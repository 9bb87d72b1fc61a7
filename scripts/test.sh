#!/usr/bin/env bash
# Builds gattn's tests, examples and benchmarks and runs the test suite with ctest once per
# instruction-set flavour: baseline (the compiler's default, x86-64: SSE2), avx2 (-mavx2 -mfma,
# x86 only) and native (-march=native, e.g. AVX-512), so every SIMD code path is tested.
# Environment: BUILD_DIR (default build/test; flavours go to BUILD_DIR-<flavour>),
# JOBS (default: all cores), FLAVOURS (default "baseline avx2 native" on x86-64, else
# "baseline native"), CMAKE_ARGS (extra CMake args).
set -euo pipefail
cd "$(dirname "$0")/.."

# Drops the per-target and per-test progress lines; failures and summaries stay.
quiet() { grep -Ev '^\[ *[0-9]+%\] (Building|Linking|Built)|^ +Start +[0-9]+: |Test +#[0-9]+: .* Passed' || true; }

scripts/deps.sh test
build="${BUILD_DIR:-build/test}"
jobs="${JOBS:-$(nproc)}"
default_flavours="baseline native"
[ "$(uname -m)" = x86_64 ] && default_flavours="baseline avx2 native"
for flavour in ${FLAVOURS:-$default_flavours}; do
  case "$flavour" in
    baseline) arch="" ;;
    avx2) arch="-mavx2 -mfma" ;;
    native) arch="-march=native" ;;
    *) echo "unknown flavour $flavour" >&2; exit 2 ;;
  esac
  echo "== $flavour build (GATTN_ARCH_FLAGS='$arch')"
  cmake -S . -B "$build-$flavour" -DCMAKE_BUILD_TYPE=Release -DGATTN_ARCH_FLAGS="$arch" ${CMAKE_ARGS:-} >/dev/null
  cmake --build "$build-$flavour" -j "$jobs" 2>&1 | quiet
  ctest --test-dir "$build-$flavour" -j "$jobs" --output-on-failure 2>&1 | quiet
done
