#!/usr/bin/env bash
# Builds the API reference with Doxygen (Debian's doxygen) into $BUILD_DIR/docs/html (default
# build/docs). A public entity without documentation is an error (docs/Doxyfile.in). Every
# header must open with a \file comment: Doxygen does not list, nor warn about, the members of
# an undocumented file.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh library doxygen
missing=$(find include -name '*.hpp' -print0 | xargs -0 grep -L '\\file' || true)
if [ -n "$missing" ]; then
  echo "headers without a \\file comment:" >&2
  echo "$missing" >&2
  exit 1
fi
build="${BUILD_DIR:-build/docs}"
cmake -S . -B "$build" -DGATTN_BUILD_TESTS=OFF -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build" --target docs
echo "API reference: $build/docs/html/index.html"
