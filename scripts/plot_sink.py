#!/usr/bin/python3
"""Draw first-token attention (F-Attn) per layer and head as heat maps, one model beside another.

Input: the CSV the tiny_lm example writes (columns model, layer, head, first_token_attention).
Output: a PNG with one panel per model (rows: layers, columns: heads), on a shared colour scale.

Usage: /usr/bin/python3 scripts/plot_sink.py tiny_lm_sink.csv sink_heatmap.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    models = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            grid = models.setdefault(row["model"], {})
            grid[(int(row["layer"]), int(row["head"]))] = float(row["first_token_attention"])
    out = {}
    for name, grid in models.items():
        layers = 1 + max(l for l, _ in grid)
        heads = 1 + max(h for _, h in grid)
        out[name] = [[100.0 * grid[(l, h)] for h in range(heads)] for l in range(layers)]  # percent
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    models = read(sys.argv[1])
    vmax = max(max(max(r) for r in m) for m in models.values())
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models) + 1, 3.6), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items()):
        im = ax.imshow(m, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
        for l, row in enumerate(m):
            for h, v in enumerate(row):
                ax.text(h, l, f"{v:.1f}%", ha="center", va="center", fontsize=8,
                        color="white" if v < 0.6 * vmax else "black")
        ax.set_title(name)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(len(m[0])))
        ax.set_yticks(range(len(m)))
    fig.colorbar(im, ax=axes[0].tolist(), label="attention on the first token (%)")
    fig.suptitle("First-token attention on held-out text", y=1.02)
    fig.savefig(sys.argv[2], dpi=120, bbox_inches="tight")
    print(f"heat map: {sys.argv[2]}")


if __name__ == "__main__":
    main()
