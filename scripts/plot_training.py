#!/usr/bin/python3
"""Draw the loss curves of examples/train_tiny_lm's training logs into one PNG.

Input: training_log.json files as train_tiny_lm writes them (records of step, loss and, every
--eval-every steps, heldout_loss). Each log is labelled by its directory's name (baseline,
gated, sinks). Left panel: training loss, a moving mean over `smooth` steps; right panel: the
held-out loss (nats per byte over every full 256-byte window of the held-out text).

Usage: /usr/bin/python3 scripts/plot_training.py OUT.png LOG.json [LOG.json ...] [--smooth N]
  e.g. scripts/plot_training.py curves.png run/baseline/training_log.json run/gated/training_log.json
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def moving_mean(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("logs", type=Path, nargs="+")
    parser.add_argument("--smooth", type=int, default=50, help="moving-mean window of the training loss")
    args = parser.parse_args()
    fig, (train_ax, heldout_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for path in args.logs:
        records = json.loads(path.read_text())["records"]
        label = path.parent.name
        steps = [r["step"] for r in records]
        line, = train_ax.plot(steps, moving_mean([r["loss"] for r in records], args.smooth), label=label)
        held = [(r["step"], r["heldout_loss"]) for r in records if "heldout_loss" in r]
        if held:
            heldout_ax.plot(*zip(*held), marker="o", markersize=3, color=line.get_color(), label=label)
    train_ax.set(title=f"training loss (mean over {args.smooth} steps)", xlabel="step", ylabel="nats per byte")
    heldout_ax.set(title="held-out loss", xlabel="step", ylabel="nats per byte")
    for ax in (train_ax, heldout_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
