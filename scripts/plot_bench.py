#!/usr/bin/python3
"""Draw gattn's benchmark results as PNG charts, from Google Benchmark's JSON output.

Input: the JSON a benchmark writes with --benchmark_out=F.json --benchmark_out_format=json.
Charts (the first argument):
  gated_layer  bench_gated_layer: the layer's latency with each gate variant and without one over
               the sequence length (BM_Layer), and each variant's ratio to the ungated layer; the
               G1 ratio measured in turn within each iteration (BM_GateCostPaired) beside it.
  sdpa         bench_sdpa: SDPA GFLOP/s of gattn, the hand-written Eigen attention programs and
               Eigen's GEMM at a matching size (the roof) over N, for d = 128 and one thread; and
               gattn's fraction of that roof and its speedup over the careful Eigen attention
               measured in turn within each iteration (BM_GattnVsCareful).
  decode       bench_qwen3_next: one decoding step of Qwen3-Next's attention layer against the
               memory roof (BM_DecodeRoof): step time and the time its bytes take to stream from
               memory over the cached tokens, and the fraction of the roof reached, for each
               weight and cache type, batch and ragged batch in the JSON.
Each chart names the machine (from the JSON's context: CPU, cores, clock, gattn's version,
instruction sets and threads) and the command that produced the JSON (--command; otherwise the
benchmark's executable). Ratios come from one run; absolute numbers hold for that machine only.

Usage: /usr/bin/python3 scripts/plot_bench.py {gated_layer,sdpa,decode} F.json OUT.png
           [--command "the command that wrote F.json"]
Needs matplotlib (Debian's python3-matplotlib).
"""

import argparse
import io
import json
import statistics
import sys
import textwrap
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402  (Pillow, a dependency of matplotlib)

SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
DPI = 100
WIDTH, HEIGHT = 12.0, 5.2  # inches, without the caption
CAPTION_COLUMNS, CAPTION_LINE = 170, 0.16  # characters and inches per caption line


def load(path):
    """The JSON's context and its runs as {run name: {"family", "variant", "args", "seconds", counters}},
    the median over repetitions (aggregates are ignored: the median is taken here)."""
    with open(path) as f:
        data = json.load(f)
    runs = defaultdict(list)
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        runs[b.get("run_name", b["name"])].append(b)
    out = {}
    for name, reps in runs.items():
        parts = name.split("/")
        args, variant = {}, []
        for p in parts[1:]:
            key, sep, value = p.partition(":")
            if p in ("real_time", "process_time") or key in ("min_time", "iterations", "repeats"):
                continue
            if sep and is_number(value):
                args[key] = float(value)
            elif is_number(p):
                args[sum(isinstance(k, int) for k in args)] = float(p)  # unnamed: by position, from 0
            else:
                variant.append(p)
        entry = {"family": parts[0], "variant": "/".join(variant), "args": args}
        entry["seconds"] = statistics.median(r["real_time"] * SECONDS[r.get("time_unit", "ns")] for r in reps)
        for key, value in reps[0].items():
            if isinstance(value, (int, float)) and key not in entry:
                entry[key] = statistics.median(r.get(key, value) for r in reps)
        entry["label"] = reps[0].get("label", "")
        out[name] = entry
    return data.get("context", {}), out


def is_number(s):
    try:
        float(s)
        return True
    except ValueError:
        return False


def select(runs, family, variant=None, **args):
    """Runs of a family (and variant) whose named arguments equal the given values."""
    found = []
    for r in runs.values():
        if r["family"] != family or (variant is not None and r["variant"] != variant):
            continue
        if all(r["args"].get(k) == float(v) for k, v in args.items()):
            found.append(r)
    return found


def machine(context):
    """One line naming the machine and gattn's build, from the benchmark context."""
    cpu = context.get("cpu_model") or context.get("host_name", "unknown host")
    parts = [cpu]
    if "num_cpus" in context:
        mhz = context.get("mhz_per_cpu")
        parts.append(f"{context['num_cpus']} CPUs" + (f" at {mhz} MHz" if mhz else ""))
    caches = [c for c in context.get("caches", []) if c.get("type") in ("Unified", "Data") and c.get("level", 0) >= 2]
    if caches:
        parts.append(" ".join(f"L{c['level']} {mib(c['size'])}" for c in caches))
    if context.get("gattn_version"):
        parts.append(f"gattn {context['gattn_version']}")
    if context.get("gattn_isa"):
        parts.append(f"ISA: {context['gattn_isa']}")
    if context.get("gattn_threads"):
        threads = context["gattn_threads"]
        parts.append(f"{threads} thread{'' if str(threads) == '1' else 's'} by default")
    if context.get("date"):
        parts.append(context["date"][:10])
    return ", ".join(parts)


def mib(size):
    return f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size // 1024} KiB"


def caption(context, command):
    """The lines under the chart: the machine, then the command (wrapped)."""
    lines = textwrap.wrap("Machine: " + machine(context), CAPTION_COLUMNS, subsequent_indent="  ")
    lines += textwrap.wrap("Command: " + command, CAPTION_COLUMNS, subsequent_indent="  ", break_on_hyphens=False)
    return lines


def log2_axis(ax, values):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(values))
    ax.set_xticklabels([f"{int(v) // 1024}k" if v >= 1024 and v % 1024 == 0 else f"{int(v)}" for v in sorted(values)])
    ax.minorticks_off()


def need(found, what):
    if not found:
        sys.exit(f"plot_bench.py: no {what} in the JSON (was it filtered out?)")


def chart_gated_layer(context, runs, ax_abs, ax_ratio):
    layer = [r for r in runs.values() if r["family"] == "BM_Layer"]
    need(layer, "BM_Layer runs")
    by_variant = defaultdict(dict)  # variant -> N -> ms
    for r in layer:
        by_variant[r["variant"]][r["args"][0]] = r["seconds"] * 1e3
    need(by_variant.get("Ungated"), "BM_Layer/Ungated runs (the ratios' denominator)")
    ungated = by_variant["Ungated"]
    sizes = sorted({n for v in by_variant.values() for n in v})
    names = ["Ungated"] + sorted(v for v in by_variant if v != "Ungated")
    colours = plt.get_cmap("tab20").colors
    for i, name in enumerate(names):
        pts = sorted(by_variant[name].items())
        style = dict(color="black", linewidth=2.2) if name == "Ungated" else dict(color=colours[i % 20])
        ax_abs.plot([n for n, _ in pts], [ms for _, ms in pts], marker="o", markersize=4, label=name, **style)
        if name != "Ungated":
            ratio = [(n, ms / ungated[n]) for n, ms in pts if n in ungated]
            ax_ratio.plot([n for n, _ in ratio], [q for _, q in ratio], marker="o", markersize=4, label=name,
                          **style)
    paired = [r for r in runs.values() if r["family"] == "BM_GateCostPaired" and "gated_ms" in r]
    if paired:
        pts = sorted((r["args"][0], r["gated_ms"] / r["ungated_ms"]) for r in paired)
        star = ax_ratio.plot([n for n, _ in pts], [q for _, q in pts], linestyle="none", marker="*", markersize=13,
                             color="black", label="G1Elementwise, paired in each iteration")[0]
        ax_ratio.legend(handles=[star], fontsize=7, loc="best")
    ax_ratio.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    for ax in (ax_abs, ax_ratio):
        log2_axis(ax, sizes)
        ax.set_xlabel("sequence length N (tokens, one sequence)")
        ax.grid(True, which="major", alpha=0.3)
    ax_abs.set_ylim(bottom=0)
    ax_abs.set_ylabel("forward time, ms (on this machine)")
    ax_abs.set_title("Layer latency (absolute)", fontsize=10)
    ax_ratio.set_ylabel("gated time / ungated time")
    ax_ratio.set_title("gated / ungated time (each timed apart: medians of interleaved repetitions);\n"
                       "star: G1 and ungated timed in turn within each iteration (BM_GateCostPaired)", fontsize=9)
    ax_abs.legend(fontsize=7, ncol=2, loc="upper left")
    return ("bench_gated_layer: gated attention layer vs ungated "
            "(D = 2048, 16 query heads, 2 KV heads, head_dim 128, causal, float)")


def chart_sdpa(context, runs, ax_abs, ax_ratio):
    gattn = [r for r in runs.values() if r["family"] == "BM_GattnSdpa" and r["args"].get("Nq") == r["args"].get("Nk")]
    need(gattn, "BM_GattnSdpa prefill runs (Nq = Nk)")
    ds = [r["args"].get("d") for r in gattn]
    d = 128.0 if 128.0 in ds else max(set(ds), key=ds.count)
    all_threads = {r["args"].get("threads") for r in gattn}
    threads = 1.0 if 1.0 in all_threads else min(all_threads)
    sizes = set()

    def series(found, n_key, label, **style):
        pts = sorted((r["args"][n_key], r["FLOP/s"] / 1e9) for r in found if "FLOP/s" in r)
        if pts:
            sizes.update(n for n, _ in pts)
            ax_abs.plot([n for n, _ in pts], [g for _, g in pts], marker="o", markersize=4, label=label, **style)
        return dict(pts)

    roof = series(select(runs, "BM_EigenGemmRoof", d=d), "N", "Eigen GEMM, same FLOPs (roof)", color="grey",
                  linestyle="--", linewidth=2)
    full = series(select(runs, "BM_GattnSdpa", d=d, causal=0, threads=threads), "Nq", "gattn SDPA", color="tab:blue",
                  linewidth=2.2)
    series(select(runs, "BM_GattnSdpa", d=d, causal=1, threads=threads), "Nq", "gattn SDPA, causal", color="tab:blue",
           linestyle=":")
    careful = series(select(runs, "BM_EigenCarefulSdpa", d=d, causal=0), "N", "careful Eigen attention",
                     color="tab:orange")
    series(select(runs, "BM_EigenCarefulSdpa", d=d, causal=1), "N", "careful Eigen attention, causal",
           color="tab:orange", linestyle=":")
    series(select(runs, "BM_EigenTypicalSdpa", d=d), "N", "typical Eigen attention", color="tab:red")
    log2_axis(ax_abs, sizes)
    ax_abs.set_xlabel("N = N_q = N_k (tokens)")
    ax_abs.set_ylabel("GFLOP/s (on this machine)")
    ax_abs.set_ylim(bottom=0)
    ax_abs.set_title(f"SDPA throughput, d = {int(d)}, 8 heads, {int(threads)} thread{'s' if threads > 1 else ''}",
                     fontsize=10)
    ax_abs.legend(fontsize=7, loc="best")
    ax_abs.grid(True, alpha=0.3)

    # Ratios: gattn / roof and careful / roof (same run, measured one after the other), and the
    # speedup over careful Eigen measured in turn within each iteration.
    labels, values, colours = [], [], []
    for n in sorted(set(full) & set(roof)):
        labels.append(f"gattn / roof\nN={int(n)}")
        values.append(full[n] / roof[n])
        colours.append("tab:blue")
    for n in sorted(set(careful) & set(roof)):
        labels.append(f"careful / roof\nN={int(n)}")
        values.append(careful[n] / roof[n])
        colours.append("tab:orange")
    for r in sorted(select(runs, "BM_GattnVsCareful", d=d), key=lambda r: (r["args"]["causal"], r["args"]["N"])):
        labels.append(f"gattn vs careful\nN={int(r['args']['N'])}" + (", causal" if r["args"]["causal"] else ""))
        values.append(r["speedup"])
        colours.append("tab:green")
    need(values, "ratio (BM_EigenGemmRoof or BM_GattnVsCareful runs)")
    bars = ax_ratio.bar(range(len(values)), values, color=colours)
    ax_ratio.bar_label(bars, fmt="%.2f", fontsize=7)
    ax_ratio.set_xticks(range(len(values)))
    ax_ratio.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
    ax_ratio.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    ax_ratio.set_ylabel("ratio")
    ax_ratio.set_title("Fraction of the GEMM roof, timed apart (blue, orange); speedup over careful\n"
                       "Eigen, both timed in turn within each iteration (green, BM_GattnVsCareful)", fontsize=9)
    ax_ratio.grid(True, axis="y", alpha=0.3)
    return "bench_sdpa: gattn's SDPA against attention written with Eigen and Eigen's GEMM (float32)"


def chart_decode(context, runs, ax_abs, ax_ratio):
    roof = [r for r in runs.values() if r["family"] == "BM_DecodeRoof" and "roof_fraction" in r]
    need(roof, "BM_DecodeRoof runs")
    groups = defaultdict(list)  # (storage, batch, threads, ragged) -> runs
    for r in roof:
        a = r["args"]
        groups[(r["variant"], int(a["batch"]), int(a["threads"]), int(a.get("ragged", 0)))].append(r)
    colours = {"float": "tab:blue", "bf16": "tab:orange", "int8": "tab:green", "bf16_weights_int8_cache": "tab:purple"}
    names = {"float": "float", "bf16": "bf16", "int8": "float weights, int8 cache",
             "bf16_weights_int8_cache": "bf16 weights, int8 cache"}
    one = min(threads for _, _, threads, _ in groups)  # the left panel: one sequence on the fewest threads
    sizes = set()
    for (storage, batch, threads, ragged), found in sorted(groups.items()):
        found.sort(key=lambda r: r["args"]["cached"])
        xs = [r["args"]["cached"] for r in found]
        sizes.update(xs)
        colour = colours.get(storage)
        name = names.get(storage, storage)
        line = "-" if threads == one else "--"
        if ragged:
            marker, size, label = "^", 8, f"{name}, ragged batch of {batch} (1k to the x value)"
        elif batch > 1:
            marker, size, label = "s", 7, f"{name}, batch {batch}"
        else:
            marker, size, label = "o", 5, name
        if threads != one:
            label += f", {threads} threads"
        if batch == 1 and threads == one:
            ax_abs.plot(xs, [r["step_ms"] for r in found], color=colour, marker=marker, markersize=4,
                        label=f"{name}: step")
            roof_ms = [r["MiB"] * 2**20 / (r["stream_GB/s"] * 1e9) * 1e3 for r in found]
            ax_abs.plot(xs, roof_ms, color=colour, linestyle="--", alpha=0.5, linewidth=3,
                        label=f"{name}: bytes / stream bandwidth")
        ax_ratio.plot(xs, [r["roof_fraction"] for r in found], color=colour, linestyle=line, marker=marker,
                      markersize=size, label=label)
    for ax in (ax_abs, ax_ratio):
        log2_axis(ax, sizes)
        ax.set_xlabel("cached tokens per sequence")
        ax.grid(True, alpha=0.3)
    ax_abs.set_ylim(bottom=0)
    ax_abs.set_ylabel("ms per decoding step (on this machine)")
    ax_abs.set_title("Step time, and the time its bytes (weights, K/V cache) take to stream at the\n"
                     f"bandwidth measured just before (the roof); one sequence, {one} thread{'s' if one > 1 else ''}",
                     fontsize=9)
    ax_abs.legend(fontsize=7, loc="upper left")
    ax_ratio.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    ax_ratio.set_ylim(0, max(1.05, 1.05 * max(r["roof_fraction"] for r in roof)))
    ax_ratio.set_ylabel("roof_fraction = roof time / step time")
    ax_ratio.set_title("Fraction of the memory roof reached (1 = streaming speed)", fontsize=10)
    ax_ratio.legend(fontsize=7, loc="best")
    return ("bench_qwen3_next BM_DecodeRoof: one Qwen3-Next attention decoding step vs the memory roof "
            "(hidden 2048, 16 heads, 2 KV heads, head_dim 256)")


def save_small(fig, path):
    """PNG with a palette of 256 colours (Pillow, which matplotlib uses): a third of the bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)


CHARTS = {"gated_layer": chart_gated_layer, "sdpa": chart_sdpa, "decode": chart_decode}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("chart", choices=sorted(CHARTS))
    p.add_argument("json", help="Google Benchmark JSON output")
    p.add_argument("png", help="the chart to write")
    p.add_argument("--command", help="the command that produced the JSON, shown on the chart")
    a = p.parse_args()
    context, runs = load(a.json)
    command = a.command or context.get("executable", "(command not recorded)")
    lines = caption(context, command)
    extra = CAPTION_LINE * (len(lines) + 0.5)
    fig, (ax_abs, ax_ratio) = plt.subplots(1, 2, figsize=(WIDTH, HEIGHT + extra))
    title = CHARTS[a.chart](context, runs, ax_abs, ax_ratio)
    fig.suptitle(title + "\nratios measured in one run; absolute numbers hold for this machine only",
                 fontsize=11)
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=8, family="monospace", ha="left", va="bottom",
             linespacing=1.3)
    fig.tight_layout(rect=(0, extra / (HEIGHT + extra), 1, 1))
    save_small(fig, a.png)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
