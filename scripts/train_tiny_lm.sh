#!/usr/bin/env bash
# Trains the three tiny byte-level language models (baseline, gated attention, learned sinks) on
# the Debian fortunes and exports them with float64 references to assets/tiny_lm/ (27 to 55
# CPU-minutes per model, trained at once: 45 to 100 minutes on two cores). Arguments go to
# scripts/train_tiny_lm.py, e.g. --quick, --check or --models sinks.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh library fortunes python3-torch python3-numpy
# Debian's torch and numpy live in the system interpreter, not in whatever python3 is on PATH.
exec /usr/bin/python3 scripts/train_tiny_lm.py "$@"
