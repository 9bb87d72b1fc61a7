#!/usr/bin/env bash
# Builds gattn's libFuzzer harnesses with clang (-fsanitize=fuzzer,address,undefined, -O1 with
# line tables, assertions on) at the widest instruction set of this CPU (-march=native when it
# has AVX-512F, else -mavx2 -mfma when it has AVX2 and FMA, else the compiler's default), and
# fuzzes each for a bounded time from its seed corpus:
#  - tests/fuzz/fuzz_sdpa.cpp: SDPA against a float64 reference, and (fuzz_sdpa_layer.cpp, a
#    second unit that builds beside it) the gated layer and the layer decoding through a KV
#    cache with invalid calls among the valid ones (seeds tests/fuzz/corpus; its decode_* seeds
#    are written by scripts/make_fuzz_seeds.py). The sanitized test suite (scripts/test.sh's
#    asan flavour) runs the AVX2 kernels; this build adds the AVX-512 ones on CPUs that have
#    them;
#  - the file readers:
#      fuzz_safetensors  gattn::SafetensorsFile (seeds tests/fuzz/corpus_safetensors);
#      fuzz_config       load_qwen3_next_config (seeds tests/fuzz/corpus_config);
#      fuzz_index        model.safetensors.index.json of a sharded checkpoint (seeds
#                        tests/fuzz/corpus_index);
#    each with its dictionary tests/fuzz/<reader>.dict, and one allocation of 64 MB or more
#    counted as a finding (-malloc_limit_mb=64: the inputs are a few KB).
# Up to JOBS harnesses run at once. The summary gives, per harness, the executions, executions
# per second and libFuzzer's final coverage (cov: edges, ft: features, from the last
# "#N DONE cov: ..." line). A crash, a sanitizer report, a mismatch or an undocumented exception
# fails the script with the input kept under <build dir>/artifacts/ (replay it with
# <build dir>/tests/<harness> <file>; add it to the harness's corpus as finding_<what> so that
# ctest's Fuzz.*CorpusReplay replays it).
# Environment: BUILD_DIR (default build/fuzz), JOBS (default: all cores), FUZZ_SECONDS (default
# 60: fuzz_sdpa), FUZZ_IO_SECONDS (default 60: each file-reader harness); 0 replays the seeds
# only. ARCH (instruction-set flags) replaces the choice above, e.g. ARCH= for the compiler's
# default. FUZZ_MERGE=1 adds the inputs that found new coverage in fuzz_sdpa to
# tests/fuzz/corpus (a minimising merge: keep the corpus small, under ~200 files / 1 MB); the
# file readers' corpora are written by scripts/make_fuzz_seeds.py.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh clang ninja-build
dir="${BUILD_DIR:-build/fuzz}"
jobs="${JOBS:-$(nproc)}"
sdpa_seconds="${FUZZ_SECONDS:-60}"
io_seconds="${FUZZ_IO_SECONDS:-60}"
seeds=tests/fuzz/corpus
readers=(safetensors config index)

if [ -n "${ARCH+set}" ]; then
  arch="$ARCH"
elif grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  arch="-march=native"
elif grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo; then
  arch="-mavx2 -mfma"
else
  arch=""
fi
targets=(fuzz_sdpa "${readers[@]/#/fuzz_}")
echo "== ${targets[*]} build, instruction sets '${arch:-default}' (clang, libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S . -B "$dir" "$(scripts/ninja_generator.sh "$dir")" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" -DGATTN_BUILD_FUZZERS=ON -DGATTN_ARCH_FLAGS="$arch" \
      -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$dir" -j "$jobs" --target "${targets[@]}" 2>&1 |
  grep -Ev '^\[[0-9]+/[0-9]+\] (Building|Linking)' || true
for t in "${targets[@]}"; do
  [ -x "$dir/tests/$t" ] || { echo "$t was not built in $dir" >&2; exit 1; }
done

# Runs: "<label>|<fuzzer>|<working corpus>|<seed corpus>|<seconds>|<artifact prefix>|<flags>",
# the longest first (they start in this order as cores free up).
runs=("fuzz_sdpa|$dir/tests/fuzz_sdpa|$dir/corpus|$seeds|$sdpa_seconds|$dir/artifacts/|-max_len=4096 -timeout=30 -rss_limit_mb=4096")
for r in "${readers[@]}"; do
  runs+=("fuzz_$r|$dir/tests/fuzz_$r|$dir/corpus_$r|tests/fuzz/corpus_$r|$io_seconds|$dir/artifacts/fuzz_$r-|-max_len=8192 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=64 -dict=tests/fuzz/$r.dict")
done

# One run: its output goes to <working corpus>.log, its exit status to <working corpus>.status.
# The harnesses' temporary files go to <build dir>/tmp.
tmp="$PWD/$dir/tmp"
rm -rf "$tmp"
mkdir -p "$tmp"
run() {
  local label="$1" fuzzer="$2" work="$3" seed_dir="$4" secs="$5" prefix="$6" flags="$7" limit
  rm -rf "$work"
  mkdir -p "$work" "${prefix%/*}"
  if [ "$secs" -gt 0 ]; then limit="-max_total_time=$secs"; else limit="-runs=0"; fi
  echo "== $label: ${secs} s from $(ls "$seed_dir" | wc -l) seed inputs"
  set +e
  # shellcheck disable=SC2086  # flags are words
  TMPDIR="$tmp" UBSAN_OPTIONS=print_stacktrace=1 "$fuzzer" "$limit" -print_final_stats=1 $flags \
    -artifact_prefix="$prefix" "$work" "$seed_dir" >"$work.log" 2>&1 </dev/null
  echo $? >"$work.status"
  set -e
}
for entry in "${runs[@]}"; do
  IFS='|' read -r label fuzzer work seed_dir secs prefix flags <<<"$entry"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run "$label" "$fuzzer" "$work" "$seed_dir" "$secs" "$prefix" "$flags" &
done
wait

failed=0
summary=()
for entry in "${runs[@]}"; do
  IFS='|' read -r label fuzzer work seed_dir secs prefix flags <<<"$entry"
  log="$work.log"
  status=$(cat "$work.status" 2>/dev/null || echo 1)
  echo "== $label"
  # The progress lines go; the start, the end, the statistics and any report stay.
  grep -Ev '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse|RELOAD|INITED)|NEW_FUNC|^"|Recommended dictionary|End of recommended' \
    "$log" | tail -n 60
  runs_done=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  last=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 || true)
  [ -n "$last" ] || last=$(grep -E '^#[0-9]+[[:space:]].*cov: ' "$log" | tail -n 1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  if [ "$status" -ne 0 ]; then
    artifact=$(grep -o "Test unit written to .*" "$log" | tail -n 1 | sed 's/Test unit written to //' || true)
    echo "FAIL: $label stopped with status $status after ${runs_done:-?} executions; input: ${artifact:-none written}" >&2
    failed=1
    summary+=("$label: FAILED after ${runs_done:-?} executions; input kept: ${artifact:-none written}")
  else
    summary+=("$label: ${runs_done:-?} executions in $secs s (${rate:-?}/s), cov ${cov:-?} ft ${ft:-?}, $(ls "$work" | wc -l) inputs with new coverage, no failure; last: ${last:-none}")
  fi
done
echo "== summary"
printf '%s\n' "${summary[@]}"
[ "$failed" -eq 0 ] || exit 1

if [ "${FUZZ_MERGE:-0}" = 1 ]; then
  # Edge coverage only (-use_counters=0): keeps the corpus to the inputs that reach new code.
  "$dir/tests/fuzz_sdpa" -merge=1 -use_counters=0 -max_len=4096 "$seeds" "$dir/corpus" >"$dir/merge.log" 2>&1
  echo "corpus: $(ls "$seeds" | wc -l) files, $(du -sk "$seeds" | cut -f1) KiB"
fi
