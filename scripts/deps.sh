#!/usr/bin/env bash
# Installs the Debian packages gattn's build needs, when they are missing.
# Usage: scripts/deps.sh [extra-package ...]
# Runs apt-get only as root; otherwise prints what to install and fails.
set -euo pipefail

packages=(g++ cmake make libeigen3-dev libxsimd-dev nlohmann-json3-dev libgtest-dev libbenchmark-dev "$@")
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
