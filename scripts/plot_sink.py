#!/usr/bin/python3
"""Draw first-token attention (F-Attn) per layer and head as heat maps, one model beside another.

Input: the CSV the tiny_lm example writes (columns model, layer, head, first_token_attention).
Output: a PNG with one panel per model (rows: layers, columns: heads), on a shared colour scale
centred on what uniform attention would give: red above it (a head that sinks attention into
the first token), blue below. Uniform attention over the visible keys puts 1/(i + 1) on the
first token for query i; the mean over queries 1 .. window-1 is what the example's F-Attn
would be.

Usage: /usr/bin/python3 scripts/plot_sink.py tiny_lm_sink.csv sink_heatmap.png [window]
  window: the tokens per held-out window (default 256, the example's).
"""

import csv
import sys

import matplotlib
from matplotlib.colors import TwoSlopeNorm

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


def uniform_first_token(window):
    """Mean over queries 1..window-1 of 1/(i + 1), in percent."""
    return 100.0 * sum(1.0 / (i + 1) for i in range(1, window)) / (window - 1)


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    models = read(sys.argv[1])
    uniform = uniform_first_token(int(sys.argv[3]) if len(sys.argv) == 4 else 256)
    vmax = max(2.0 * uniform, max(max(max(r) for r in m) for m in models.values()))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=uniform, vmax=vmax)
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models) + 1, 3.6), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items()):
        im = ax.imshow(m, cmap="RdBu_r", norm=norm, aspect="auto")
        for l, row in enumerate(m):
            for h, v in enumerate(row):
                far = abs(norm(v) - 0.5) > 0.3  # dark cells get white text
                ax.text(h, l, f"{v:.1f}%", ha="center", va="center", fontsize=8,
                        color="white" if far else "black")
        ax.set_title(name)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(len(m[0])))
        ax.set_yticks(range(len(m)))
    bar = fig.colorbar(im, ax=axes[0].tolist(), label="attention on the first token (%)")
    bar.ax.axhline(uniform, color="black", linewidth=1.5)  # uniform attention
    fig.suptitle(f"First-token attention on held-out text (white: uniform attention, {uniform:.1f}%)", y=1.02)
    fig.savefig(sys.argv[2], dpi=120, bbox_inches="tight")
    print(f"heat map: {sys.argv[2]}")


if __name__ == "__main__":
    main()
