#!/usr/bin/env bash
# Installs gattn into a temporary prefix and builds the consumer project against it with
# find_package (once as is: no Eigen definition, once with GATTN_EIGEN_MAX_ALIGN_BYTES=64) and
# with pkg-config (gattn.pc), then builds the consumer again with gattn vendored through
# add_subdirectory and, when the source is a git checkout, fetched with FetchContent (its HEAD
# commit: what is committed, not the working tree).
# Usage: check_package.sh <gattn source dir> <scratch dir>
set -euo pipefail
src="$1"
work="$2"
rm -rf "$work"
mkdir -p "$work"
cmake -S "$src" -B "$work/gattn" -DGATTN_BUILD_TESTS=OFF -DGATTN_BUILD_BENCHMARKS=OFF \
      -DGATTN_BUILD_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$work/prefix" >/dev/null
cmake --install "$work/gattn" >/dev/null
test -f "$work/prefix/share/cmake/gattn/gattnConfig.cmake"
cmake -S "$src/tests/cmake/consumer" -B "$work/package" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/package" >/dev/null
"$work/package/consumer"
cmake -S "$src/tests/cmake/consumer" -B "$work/package-eigen-definition" -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DGATTN_EIGEN_MAX_ALIGN_BYTES=64 -DGATTN_CONSUMER_EIGEN_ALIGN=64 >/dev/null
cmake --build "$work/package-eigen-definition" >/dev/null
cmake -S "$src/tests/cmake/consumer" -B "$work/subdirectory" -DGATTN_CONSUME=subdirectory \
      -DGATTN_SOURCE_DIR="$src" >/dev/null
cmake --build "$work/subdirectory" >/dev/null
"$work/subdirectory/consumer"
pc_dir="$work/prefix/share/pkgconfig"
test -f "$pc_dir/gattn.pc"
# shellcheck disable=SC2046  # pkg-config prints several flags
"${CXX:-c++}" -std=c++17 -O1 $(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags gattn) \
    "$src/tests/cmake/consumer/main.cpp" -DGATTN_CONSUMER_EIGEN_ALIGN=0 -o "$work/pkg-config-consumer"
"$work/pkg-config-consumer"
if git -C "$src" rev-parse --verify -q HEAD >/dev/null; then
  cmake -S "$src/tests/cmake/consumer" -B "$work/fetchcontent" -DGATTN_CONSUME=fetchcontent \
        -DGATTN_SOURCE_DIR="$src" -DGATTN_GIT_TAG="$(git -C "$src" rev-parse HEAD)" >/dev/null
  cmake --build "$work/fetchcontent" >/dev/null
  "$work/fetchcontent/consumer"
fi
