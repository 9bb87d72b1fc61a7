#!/usr/bin/env bash
# Installs the Debian packages gattn's build needs, when they are missing.
# Usage: scripts/deps.sh [library|test|clang|format] [extra-package ...]
#   library: compiler, CMake, Eigen, xsimd, nlohmann_json, CLI11 (enough for the examples)
#   test:    the above plus GoogleTest, Google Benchmark, pkg-config and git (the package
#            consumer tests; the default)
#   clang:   test plus clang, its sanitizer and libFuzzer runtimes, LLVM's OpenMP runtime
#            (libomp, with the archer tool for ThreadSanitizer) and llvm-symbolizer
#   format:  git and clang-format-14 (git-clang-format) only, for scripts/format_check.sh
# Runs apt-get only as root; otherwise prints what to install and fails.
set -euo pipefail

mode="${1:-test}"
[ $# -gt 0 ] && shift
packages=(g++ cmake make libeigen3-dev libxsimd-dev nlohmann-json3-dev libcli11-dev)
case "$mode" in
  test) packages+=(libgtest-dev libbenchmark-dev pkg-config git) ;;
  clang) packages+=(libgtest-dev libbenchmark-dev pkg-config git clang libclang-rt-dev libomp-dev llvm) ;;
  format) packages=(git clang-format-14) ;;
esac
packages+=("$@")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "gattn needs these Debian packages: ${missing[*]}" >&2
  echo "install them with: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
