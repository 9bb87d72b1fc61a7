#!/usr/bin/env bash
# Prints the CMake arguments that make <build dir> a Ninja build, after clearing a cache that
# another generator left there (CMake refuses to switch generators in place).
# Usage: cmake -S . -B "$dir" "$(scripts/ninja_generator.sh "$dir")" ...
# Why Ninja where a script builds a list of targets: the Makefiles' top level builds the targets
# of a list one after the other (.NOTPARALLEL), so with targets of one source file each, one core
# of two waits; Ninja builds them side by side.
set -euo pipefail
dir="$1"
if [ -f "$dir/CMakeCache.txt" ] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$dir/CMakeCache.txt"; then
  rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
fi
echo "-GNinja"
