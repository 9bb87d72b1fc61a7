#!/usr/bin/env bash
# Builds the libFuzzer harness tests/fuzz/fuzz_sdpa.cpp with clang (-fsanitize=fuzzer,address,
# undefined, -O1 -g, assertions on) twice, and fuzzes gattn's SDPA against a float64 reference and
# the gated layer with each for a bounded time, starting from the seed corpus tests/fuzz/corpus:
#   baseline  the compiler's default instruction set (x86-64: SSE2);
#   wide      the widest instruction set of this CPU: -march=native when it has AVX-512F, else
#             -mavx2 -mfma when it has AVX2 and FMA (skipped otherwise, the baseline run then
#             gets all the time). gattn's kernels are separate code per instruction set.
# Prints the number of executions per build; a crash or mismatch fails with the input saved
# under <build dir>/artifacts/ (replay it with: <build dir>/tests/fuzz_sdpa <file>).
# Environment: BUILD_DIR (default build/fuzz; the wide build goes to BUILD_DIR-wide), JOBS
# (default: all cores), FUZZ_SECONDS (default 60: the total, split evenly between the builds),
# FUZZ_MERGE=1 to add the inputs that found new coverage (in either build) to tests/fuzz/corpus
# (a minimising merge: keep the corpus small, under ~200 files / 1 MB).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh clang
base_dir="${BUILD_DIR:-build/fuzz}"
jobs="${JOBS:-$(nproc)}"
total_seconds="${FUZZ_SECONDS:-60}"
seeds=tests/fuzz/corpus

# Builds to fuzz: "<name> <build dir> <instruction-set flags>".
builds=("baseline|$base_dir|")
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  builds+=("wide (AVX-512, -march=native)|$base_dir-wide|-march=native")
elif grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo; then
  builds+=("wide (AVX2, -mavx2 -mfma)|$base_dir-wide|-mavx2 -mfma")
fi
seconds=$((total_seconds / ${#builds[@]}))

for entry in "${builds[@]}"; do
  IFS='|' read -r name dir arch <<<"$entry"
  echo "== fuzz_sdpa build, $name (clang, libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer)"
  cmake -S . -B "$dir" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" -DGATTN_BUILD_FUZZERS=ON -DGATTN_ARCH_FLAGS="$arch" \
        -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$dir" -j "$jobs" --target fuzz_sdpa 2>&1 |
    grep -Ev '^\[ *[0-9]+%\] (Building|Linking|Built)' || true
  [ -x "$dir/tests/fuzz_sdpa" ] || { echo "fuzz_sdpa was not built in $dir" >&2; exit 1; }
done

failed=0
summary=()
for entry in "${builds[@]}"; do
  IFS='|' read -r name dir arch <<<"$entry"
  fuzzer="$dir/tests/fuzz_sdpa"
  work="$dir/corpus"
  rm -rf "$work"
  mkdir -p "$work" "$dir/artifacts"
  echo "== fuzz_sdpa, $name, for $seconds s from $(ls "$seeds" | wc -l) seed inputs"
  set +e
  UBSAN_OPTIONS=print_stacktrace=1 "$fuzzer" -max_total_time="$seconds" -print_final_stats=1 \
    -max_len=4096 -timeout=30 -rss_limit_mb=4096 -artifact_prefix="$dir/artifacts/" \
    "$work" "$seeds" >"$dir/fuzz.log" 2>&1
  status=$?
  set -e
  # The progress lines go; the start, the end, the statistics and any report stay.
  grep -Ev '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse|RELOAD|INITED)|NEW_FUNC|^"|Recommended dictionary|End of recommended' \
    "$dir/fuzz.log" | tail -n 60
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/fuzz.log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/fuzz.log")
  if [ "$status" -ne 0 ]; then
    echo "FAIL: fuzz_sdpa ($name) stopped with status $status after ${runs:-?} executions;" \
         "input: $(ls "$dir"/artifacts/* 2>/dev/null | head -n 1)" >&2
    failed=1
    summary+=("fuzz_sdpa $name: FAILED after ${runs:-?} executions")
  else
    summary+=("fuzz_sdpa $name: ${runs:-?} executions in $seconds s (${rate:-?}/s), $(ls "$work" | wc -l) inputs with new coverage, no failure")
  fi
done
printf '%s\n' "${summary[@]}"
[ "$failed" -eq 0 ] || exit 1

if [ "${FUZZ_MERGE:-0}" = 1 ]; then
  # Each build merges its new inputs in turn, so an input is kept when it reaches code that the
  # corpus does not reach in that build. Edge coverage only (-use_counters=0): keeps the corpus
  # to the inputs that reach new code.
  for entry in "${builds[@]}"; do
    IFS='|' read -r name dir arch <<<"$entry"
    "$dir/tests/fuzz_sdpa" -merge=1 -use_counters=0 -max_len=4096 "$seeds" "$dir/corpus" >"$dir/merge.log" 2>&1
  done
  echo "corpus: $(ls "$seeds" | wc -l) files, $(du -sk "$seeds" | cut -f1) KiB"
fi
