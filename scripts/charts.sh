#!/usr/bin/env bash
# Draws gattn's benchmark charts: builds bench_gated_layer, bench_sdpa and bench_qwen3_next
# (Release, -march=native), runs each over a handful of sizes with Google Benchmark's JSON
# output, and turns the JSON into PNG charts with scripts/plot_bench.py (Debian's python3 and
# matplotlib):
#   bench_gated_layer.png  each gate variant's layer latency against the ungated layer's over the
#                          sequence length, and the G1 gate's cost measured in turn (1 thread);
#   bench_sdpa.png         SDPA GFLOP/s of gattn, hand-written Eigen attention and Eigen's GEMM
#                          at the same FLOPs (the roof), d = 128, 1 thread;
#   bench_decode.png       one Qwen3-Next decoding step against the memory roof over 1k–32k
#                          cached tokens (float, bf16 and int8 caches, 1 thread).
# Each chart names the machine and the command that produced its JSON; every command run is
# printed. About 4 minutes on 2 cores after the build. The JSON files stay beside the charts.
# Environment: BUILD_DIR (default build/charts), OUT_DIR (default docs/images), JOBS (build
# jobs, default: all cores), MIN_TIME (--benchmark_min_time in seconds, default 0.05),
# REPETITIONS (of bench_gated_layer and bench_sdpa, randomly interleaved; the charts use the
# median; default 3).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh library libbenchmark-dev python3-matplotlib
build="${BUILD_DIR:-build/charts}"
out="${OUT_DIR:-docs/images}"
min_time="${MIN_TIME:-0.05}"
repetitions="${REPETITIONS:-3}"
mkdir -p "$out"

# Prints a command as it can be pasted into a shell (arguments with special characters quoted).
show() {
  local word line=""
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=,+-]+$ ]]; then line+=" $word"; else line+=" '${word//\'/\'\\\'\'}'"; fi
  done
  printf '%s\n' "${line# }"
}

# Runs a command after printing it, and records its wall time.
run() {
  echo "+ $(show "$@")" >&2
  local t0=$SECONDS
  "$@"
  timings+=("$(printf '%4d s  %s' $((SECONDS - t0)) "$(show "$@" | cut -c1-100)")")
}
timings=()
start=$SECONDS

run cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGATTN_ARCH_FLAGS=-march=native \
    -DGATTN_BUILD_TESTS=OFF -DGATTN_BUILD_EXAMPLES=OFF -DGATTN_BUILD_BENCHMARKS=ON
run cmake --build "$build" -j "${JOBS:-$(nproc)}" --target bench_gated_layer bench_sdpa bench_qwen3_next

# The CPU's model name goes into the JSON's context (Google Benchmark records no model);
# --benchmark_context takes key=value pairs separated by commas.
cpu=$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -1 | tr -d ",='\"")
context="--benchmark_context=cpu_model=${cpu:-unknown CPU}"

# bench ENV-ASSIGNMENTS... -- BINARY NAME FILTER [EXTRA-FLAGS...]: runs one benchmark into
# $out/NAME.json and draws $out/NAME.png ($3 of plot_bench.py: the chart).
bench() {
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local binary=$1 name=$2 chart=$3 filter=$4
  shift 4
  local cmd=("$build/bench/$binary" "--benchmark_filter=$filter" "--benchmark_min_time=$min_time" "$@"
             "$context" "--benchmark_out=$out/$name.json" --benchmark_out_format=json)
  run env "${envs[@]}" "${cmd[@]}" >/dev/null  # the JSON has the results; the table is not shown
  run /usr/bin/python3 scripts/plot_bench.py "$chart" "$out/$name.json" "$out/$name.png" \
      --command "${envs[*]} $(show "${cmd[@]}")"
}

interleaved=("--benchmark_repetitions=$repetitions" --benchmark_enable_random_interleaving=true)
bench OMP_NUM_THREADS=1 -- bench_gated_layer bench_gated_layer gated_layer \
    '^BM_Layer/|^BM_GateCostPaired/' "${interleaved[@]}"
bench OMP_NUM_THREADS=1 -- bench_sdpa bench_sdpa sdpa \
    '^BM_GattnSdpa/Nq:(512|2048|8192)/Nk:[0-9]+/d:128/causal:[01]/threads:1/|^BM_GattnVsCareful/|^BM_Eigen(Careful|Typical)Sdpa/N:(512|2048)/d:128/|^BM_EigenGemmRoof/N:(512|2048)/d:128/' \
    "${interleaved[@]}"
bench OMP_NUM_THREADS=1 -- bench_qwen3_next bench_decode decode \
    '^BM_DecodeRoof/[a-z0-9_]+/cached:[0-9]+/batch:[0-9]+/threads:1/'

echo "== wall time of each command (total $((SECONDS - start)) s):"
printf '%s\n' "${timings[@]}"
echo "== charts in $out: bench_gated_layer.png bench_sdpa.png bench_decode.png (and their JSON)"
