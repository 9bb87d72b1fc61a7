#!/usr/bin/env bash
# Builds the libFuzzer harness tests/fuzz/fuzz_sdpa.cpp with clang (-fsanitize=fuzzer,address,
# undefined, -O1 -g, assertions on) and fuzzes gattn's SDPA against a float64 reference and the
# gated layer for a bounded time, starting from the seed corpus tests/fuzz/corpus. Prints the
# number of executions; a crash or mismatch fails with the input saved under
# BUILD_DIR/artifacts/ (replay it with: BUILD_DIR/tests/fuzz_sdpa <file>).
# Environment: BUILD_DIR (default build/fuzz), JOBS (default: all cores), FUZZ_SECONDS (default
# 60), FUZZ_MERGE=1 to add the inputs that found new coverage to tests/fuzz/corpus (a minimising
# merge: keep the corpus small, under ~200 files / 1 MB).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh clang
build="${BUILD_DIR:-build/fuzz}"
jobs="${JOBS:-$(nproc)}"
seconds="${FUZZ_SECONDS:-60}"
seeds=tests/fuzz/corpus

echo "== fuzz_sdpa build (clang, libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S . -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" -DGATTN_BUILD_FUZZERS=ON \
      -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target fuzz_sdpa 2>&1 |
  grep -Ev '^\[ *[0-9]+%\] (Building|Linking|Built)' || true
fuzzer="$build/tests/fuzz_sdpa"
[ -x "$fuzzer" ] || { echo "fuzz_sdpa was not built" >&2; exit 1; }

work="$build/corpus"
rm -rf "$work"
mkdir -p "$work" "$build/artifacts"
echo "== fuzz_sdpa for $seconds s from $(ls "$seeds" | wc -l) seed inputs"
set +e
UBSAN_OPTIONS=print_stacktrace=1 "$fuzzer" -max_total_time="$seconds" -print_final_stats=1 \
  -max_len=4096 -timeout=30 -rss_limit_mb=4096 -artifact_prefix="$build/artifacts/" \
  "$work" "$seeds" >"$build/fuzz.log" 2>&1
status=$?
set -e
# The progress lines go; the start, the end, the statistics and any report stay.
grep -Ev '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse|RELOAD|INITED)|NEW_FUNC|^"|Recommended dictionary|End of recommended' \
  "$build/fuzz.log" | tail -n 60
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$build/fuzz.log")
rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$build/fuzz.log")
if [ "$status" -ne 0 ]; then
  echo "FAIL: fuzz_sdpa stopped with status $status after ${runs:-?} executions;" \
       "input: $(ls "$build"/artifacts/* 2>/dev/null | head -n 1)" >&2
  exit 1
fi
echo "fuzz_sdpa: ${runs:-?} executions in $seconds s (${rate:-?}/s), $(ls "$work" | wc -l) inputs with new coverage, no failure"
if [ "${FUZZ_MERGE:-0}" = 1 ]; then
  # Edge coverage only (-use_counters=0): keeps the corpus to the inputs that reach new code.
  "$fuzzer" -merge=1 -use_counters=0 -max_len=4096 "$seeds" "$work" >"$build/merge.log" 2>&1
  echo "corpus: $(ls "$seeds" | wc -l) files, $(du -sk "$seeds" | cut -f1) KiB"
fi
