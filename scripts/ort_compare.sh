#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# gattn's float SDPA beside ONNX Runtime's attention contrib ops on this machine: installs npm's
# onnxruntime-node (pinned) into build/ort, builds bench_sdpa with the given instruction-set
# flags, then runs scripts/ort_compare.mjs (prefill N = 2048 and one-token decoding over 8k and
# 32k keys, 8 query heads, d = 128, float32, one thread, one process per contender per round)
# and prints Markdown tables of medians and per-round ratios. See docs/benchmarks.md.
#
#   scripts/ort_compare.sh [avx2|native] [rounds]      (default: avx2 5)
#
# `avx2` runs ONNX Runtime on MLAS's AVX2 kernels too, from a copy of the package with MLAS's
# AVX-512 setup skipped (see scripts/ort_compare.mjs); ORT_MLAS=native keeps its own choice.
#
# Environment: BUILD_DIR (default build/ort-<flavour>), ORT_VERSION (default 1.31.1), ORT_MLAS.
# Needs Node.js ≥ 18 and npm with access to the npm registry, CMake, a C++17 compiler, Eigen,
# xsimd and Google Benchmark (as for the other benchmarks).
set -eu

flavour=${1:-avx2}
rounds=${2:-5}
ort_version=${ORT_VERSION:-1.31.1}
case "$flavour" in
  avx2) arch="-mavx2 -mfma"; mlas=${ORT_MLAS:-avx2} ;;
  native) arch="-march=native"; mlas=${ORT_MLAS:-native} ;;
  *) echo "ort_compare.sh: flavour must be avx2 or native, got '$flavour'" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build/ort-$flavour}
ort=$root/build/ort

if [ ! -f "$ort/node_modules/onnxruntime-node/package.json" ] ||
   ! grep -q "\"version\": \"$ort_version\"" "$ort/node_modules/onnxruntime-node/package.json"; then
  # ONNXRUNTIME_NODE_INSTALL=skip: the CPU library ships in the npm package; skip the optional
  # download of the CUDA provider.
  ONNXRUNTIME_NODE_INSTALL=skip npm install --prefix "$ort" --no-audit --no-fund --no-save \
    "onnxruntime-node@$ort_version"
fi

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "-DGATTN_ARCH_FLAGS=$arch" -DGATTN_BUILD_TESTS=OFF \
  -DGATTN_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build" -j2 --target bench_sdpa >/dev/null

node "$root/scripts/ort_compare.mjs" --bench "$build/bench/bench_sdpa" --ort "$ort" --mlas "$mlas" --rounds "$rounds"
