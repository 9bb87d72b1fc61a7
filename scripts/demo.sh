#!/usr/bin/env bash
# The main example: three byte-level language models trained on Debian's fortunes
# (assets/tiny_lm; a baseline, its G1-gated twin and its twin with learned attention sinks) run
# through gattn. Prints from each a continuation sampled with temperature, top-k and top-p from
# a fixed seed and the greedy one, their held-out perplexity, tokens per second (median and
# range of 5 runs), and first-token attention / gate score / largest activation per layer; draws
# first-token attention per layer and head as a PNG heat map.
# Arguments go to the example (e.g. --seed 7 --temperature 1.0 --top-k 0 --top-p 0.9 --runs 3;
# scripts/demo.sh --help lists them).
# Environment: BUILD_DIR (default build/demo), JOBS (default: all cores),
# GATTN_ARCH_FLAGS (default -march=native).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh library python3-matplotlib
build="${BUILD_DIR:-build/demo}"
echo "Building the example in $build (quiet; about a minute the first time)..." >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGATTN_BUILD_TESTS=OFF \
      -DGATTN_BUILD_BENCHMARKS=OFF -DGATTN_ARCH_FLAGS="${GATTN_ARCH_FLAGS--march=native}" >/dev/null
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target tiny_lm >/dev/null
"$build/examples/tiny_lm" assets/tiny_lm "$build/tiny_lm_sink.csv" "$@"
case " $* " in *" --help "* | *" -h "*) exit 0 ;; esac
/usr/bin/python3 scripts/plot_sink.py "$build/tiny_lm_sink.csv" "$build/sink_heatmap.png"
