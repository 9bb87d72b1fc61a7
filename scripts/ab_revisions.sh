#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Times two revisions of gattn in one process (bench/bench_revisions.cpp): each revision's
# headers build bench/ab_step.cpp into a shared object, and the two objects run the same SDPA
# calls in turn. Prints Google Benchmark's table with b_vs_a, the median ratio of B's time to
# A's over the pairs of calls (below 1: B is faster), and its quartiles. See docs/benchmarks.md.
#
#   scripts/ab_revisions.sh REV_A REV_B [avx2|native|baseline] [Google Benchmark flags]
#
# A revision is anything `git archive` takes (a commit, a branch, HEAD~2), or `worktree` for
# the headers as they are in this checkout, uncommitted changes included. Default flavour:
# native (-march=native); OMP_NUM_THREADS defaults to 1. bench/ab_step.cpp always comes from
# this checkout, so both revisions must have the SDPA call it makes.
#
#   scripts/ab_revisions.sh HEAD worktree native --benchmark_filter=N_q:1/ --benchmark_counters_tabular=true
#
# --huge_pages among the flags puts K and V in transparent huge pages, as gattn's own caches
# ask for theirs (counter huge_page_MiB).
#
# Environment: AB_DIR (default build/ab-<flavour>; its rev-a and rev-b are replaced), CXX.
# Needs a C++17 compiler with OpenMP, pkg-config, Eigen, xsimd and Google Benchmark.
set -eu

if [ $# -lt 2 ]; then
  sed -n '3,19p' "$0" >&2
  exit 2
fi
rev_a=$1
rev_b=$2
shift 2
flavour=native
case "${1:-}" in
  avx2|native|baseline) flavour=$1; shift ;;
  -*|'') ;;
  *) echo "ab_revisions.sh: the flavour must be avx2, native or baseline, got '$1'" >&2; exit 2 ;;
esac
case "$flavour" in
  avx2) arch="-mavx2 -mfma" ;;
  native) arch="-march=native" ;;
  baseline) arch="" ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
out=${AB_DIR:-$root/build/ab-$flavour}
cxx=${CXX:-c++}
for rev in "$rev_a" "$rev_b"; do
  if [ "$rev" != worktree ] && ! git -C "$root" rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
    echo "ab_revisions.sh: '$rev' is not a revision of $root (nor 'worktree')" >&2
    exit 2
  fi
done
mkdir -p "$out"

# The headers of revision $1 into $out/$2/include.
headers() {
  rm -rf "${out:?}/$2"
  mkdir -p "$out/$2"
  if [ "$1" = worktree ]; then
    cp -R "$root/include" "$out/$2/include"
  else
    git -C "$root" archive "$1" include | tar -x -C "$out/$2"
  fi
}

for side in a b; do
  if [ $side = a ]; then rev=$rev_a; else rev=$rev_b; fi
  if [ "$rev" = worktree ]; then
    echo "$side: this checkout's headers" >&2
  else
    echo "$side: $rev ($(git -C "$root" rev-parse --short "$rev^{commit}"))" >&2
  fi
  headers "$rev" "rev-$side"
  # Hidden visibility: the two objects' copies of gattn's inline functions stay apart.
  # shellcheck disable=SC2086,SC2046  # $arch and pkg-config's output are lists of flags
  $cxx -std=c++17 -O3 -DNDEBUG $arch -fopenmp -fPIC -shared -fvisibility=hidden -fvisibility-inlines-hidden \
    -I"$out/rev-$side/include" $(pkg-config --cflags eigen3 xsimd) "$root/bench/ab_step.cpp" \
    -o "$out/rev-$side.so"
done
# shellcheck disable=SC2046  # pkg-config prints a list of flags
$cxx -std=c++17 -O2 -I"$root/include" "$root/bench/bench_revisions.cpp" $(pkg-config --cflags --libs benchmark) -ldl -pthread \
  -o "$out/bench_revisions"

OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$out/bench_revisions" "$@" "$out/rev-a.so" "$out/rev-b.so"
