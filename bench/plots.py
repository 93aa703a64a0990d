"""PNG plots of the evaluation's experiments from the JSON files their benchmarks write
(matplotlib: the optional `bench` extra). Every figure's title says how it was measured and on
what machine, driver and date (bench/machine.py: from the JSON, else the machine.txt beside it).

    python -m bench.plots [--latency FILE] [--e2e FILE] [--toggle FILE...] [--out docs/img/bench]

--latency (bench.probe_latency's JSON) -> latency.png: experiment 1, time per call as a ratio to
bare, one panel per API and operation. --e2e (bench.e2e's) -> startup.png (experiment 2) and
e2e.png (experiment 3, the old method). --toggle (bench.e2e_toggle's, one per workload) ->
e2e_toggle.png: experiment 3, the ratio to bare per mode with its 95 % interval, a panel each."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

from convgpu.units import format_size  # noqa: E402

from bench.latency_report import cells_of  # noqa: E402
from bench.machine import describe  # noqa: E402

COLORS = {"bare": "black", "probed": "tab:blue", "enforced": "tab:orange", "shim": "tab:red", "shim-only": "tab:purple",
          "probed@base": "tab:cyan", "enforced@base": "tab:brown"}   # the code before (--baseline-pythonpath)


def save(fig, path: Path, top: float = 0.0) -> Path:
    """Lay out (leaving `top` inches for a caption), write at 90 dpi, free the figure."""
    fig.tight_layout(rect=(0, 0, 1, 1 - top / fig.get_figheight()))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def title(fig, text: str, fontsize: float) -> None:
    """The caption above the panels, each line wrapped to the figure's width."""
    width = int(fig.get_figwidth() * 72 / (fontsize * 0.55))
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in text.splitlines()), fontsize=fontsize)


def free_name(api: str) -> str:
    if api == "cuMemCreate+Map":
        return "cuMemUnmap+Release"
    return "cudaFree" if api.startswith("cuda") else "cuMemFree_v2"


def plot_latency(data: dict, src: Path, out: Path) -> Path:
    """One panel per (API, operation): x the sizes (bare's median under each), y the ratio to
    bare on a log scale, solid the median, dashed the p99, one colour per mode."""
    panels: dict = {}
    for c in cells_of(data):
        panels.setdefault((c["api"], c["op"]), []).append(c)
    modes = [m for m in data["modes"] if m != "bare"]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(9.0, 4.2 * cols), 3.1 * rows + 1.6), squeeze=False)
    for ax, ((api, op), cells) in zip(axes.flat, panels.items()):
        xs = range(len(cells))
        for m in modes:
            ax.plot(xs, [c["modes"][m]["ratio"] for c in cells], marker="o", color=COLORS.get(m), label=m)
            p99 = [c["modes"][m].get("p99_ratio") for c in cells]
            if None not in p99:
                ax.plot(xs, p99, marker=".", linestyle="--", color=COLORS.get(m), alpha=0.6)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=False))   # "3", not "3x10^0"
        ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
        ax.set_xticks(list(xs), [("" if op == "call" else format_size(c["size"]) + "\n") +
                                 f"{c['modes']['bare']['median_us']:.1f} us" for c in cells], fontsize=8)
        ax.set_title({"alloc": api, "free": f"{free_name(api)} (after {api})", "call": api}[op], fontsize=9)
        ax.grid(alpha=0.3, which="both")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("time / bare's")
    if modes:
        axes[0][0].legend(fontsize=8)
    title(fig, "Experiment 1: time per call as a ratio to bare (solid: median, dashed: p99; under each size: "
          "bare's median)\n"
          f"build/alloc_bench via bench.probe_latency: {data['rounds']} rounds x {data['iters']} calls per "
          "cell, the modes interleaved in each round; medians over rounds\n" + describe(data, src), 10)
    return save(fig, out / "latency.png", top=0.9)   # below the four-line caption


def _strip(ax, groups: dict, unit: str) -> None:
    """Every repetition a dot, the median a bar with its value and ratio to the first group's."""
    first = statistics.median(next(iter(groups.values())))
    for i, (name, vals) in enumerate(groups.items()):
        med = statistics.median(vals)
        ax.scatter([i] * len(vals), vals, color=COLORS.get(name, "gray"), alpha=0.6, zorder=3)
        ax.hlines(med, i - 0.3, i + 0.3, color=COLORS.get(name, "gray"), linewidth=2)
        ax.annotate(f"{med:.2f} {unit}" + (f"\nx{med / first:.2f}" if name in COLORS else ""), (i + 0.32, med),
                    fontsize=8, va="center")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_xlim(-0.5, len(groups) - 0.2)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis="y")


def plot_e2e(data: dict, src: Path, out: Path) -> list[Path]:
    """startup.png: process start to its first allocation returned, per mode, and the enforcer's
    own start; e2e.png: the timed training steps per mode."""
    runs, where = data["runs"], describe(data, src)
    how = (f"bench.e2e: {data['reps']} repetitions, the modes taking turns in each; a two-convolution CNN on "
           f"synthetic MNIST-shaped data, batch {data['batch']}")
    files = []
    for name, key, caption, extra in (
            ("startup", "startup_s", "Experiment 2: start-up, from just before the process starts to its first "
             "allocation returned\n(`import torch`, context, `torch.empty` on the GPU)", data.get("enforcer_start_s")),
            ("e2e", "train_s", f"Experiment 3: {data['steps']} training steps after 50 warm-up steps", None)):
        groups = {m: [r[key] for r in rs] for m, rs in runs.items()}
        if extra:
            groups["enforcer\nstart"] = extra   # exec to probes attached and self-tested
        fig, ax = plt.subplots(figsize=(7.5, 4.6))
        _strip(ax, groups, "s")
        ax.set_ylabel("seconds")
        title(fig, f"{caption}\n{how}\n{where}", 9)
        files.append(save(fig, out / f"{name}.png"))
    return files


def plot_toggle(runs: list[tuple[dict, Path]], out: Path) -> Path:
    """One panel per workload: per mode the mean ratio to the neighbouring bare blocks with its
    bootstrap interval (bar), every block's own ratio (dots), the injected truth of `delay`
    (a cross); under each mode its allocation rate and the interval's half-width."""
    from bench.e2e_stats import paired, summarize_run
    for data, _ in runs:   # a run cut short by its time limit has its blocks only
        if "modes" not in data:
            data["modes"] = summarize_run(data["blocks"])
    fig, axes = plt.subplots(1, len(runs), figsize=(max(7.0, 4.6 * len(runs)), 5.2), squeeze=False)
    for ax, (data, src) in zip(axes[0], runs):
        modes = [m for m, v in data["modes"].items() if "ratio" in v]
        pairs = paired(data["blocks"])
        for i, m in enumerate(modes):
            v = data["modes"][m]
            ax.scatter([i + 0.18] * sum(p["mode"] == m for p in pairs), [p["ratio"] for p in pairs if p["mode"] == m],
                       color=COLORS.get(m, "gray"), alpha=0.45, s=12)
            ax.errorbar([i], [v["ratio"]], yerr=[[v["ratio"] - v["ratio_lo"]], [v["ratio_hi"] - v["ratio"]]],
                        fmt="o", color=COLORS.get(m, "gray"), capsize=6, linewidth=2)
            if "truth_ratio" in v:
                ax.scatter([i], [v["truth_ratio"]], marker="x", color="black", s=60, zorder=4, label="injected truth")
        ax.axhline(1.0, color="black", linewidth=0.8)
        rate = lambda m: data["modes"][m].get("alloc_rate")   # noqa: E731
        ax.set_xticks(range(len(modes)), [f"{m}\n{data['modes'][m]['ratio']:.4f} +-{data['modes'][m]['half_pct']:.3f} %"
                                         f"\n{data['modes'][m]['paired']} blocks" +
                                         (f", {rate(m):,.0f} allocs/s" if rate(m) else "") for m in modes], fontsize=8)
        ax.set_xlim(-0.5, len(modes) - 0.3)
        bare = data["modes"]["bare"]
        ax.set_title(f"{data['label']}\nbare step {bare['median_ms']:.3f} ms, {bare['blocks']} bare blocks\n"
                     + textwrap.fill(describe(data, src), 60), fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        if any("truth_ratio" in data["modes"][m] for m in modes):
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("step time / neighbouring bare blocks'")
    d0 = runs[0][0]
    title(fig, "Experiment 3: end to end, the mode switched under one running workload\n"
          f"bench.e2e_toggle: blocks of {d0['block_s']:g} s after {d0['settle_s']:g} s of settling, each against the "
          "mean of its bare neighbours; mean ratio, 95 % bootstrap interval over blocks", 10)
    return save(fig, out / "e2e_toggle.png", top=0.45)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency", type=Path, help="bench.probe_latency --json output")
    ap.add_argument("--e2e", type=Path, help="bench.e2e --json output")
    ap.add_argument("--toggle", type=Path, nargs="+", help="bench.e2e_toggle --json outputs, a panel each")
    ap.add_argument("--out", type=Path, default=Path("docs/img/bench"))
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    files = []
    if a.latency:
        files.append(plot_latency(json.loads(a.latency.read_text()), a.latency, a.out))
    if a.e2e:
        files += plot_e2e(json.loads(a.e2e.read_text()), a.e2e, a.out)
    if a.toggle:
        files.append(plot_toggle([(json.loads(p.read_text()), p) for p in a.toggle], a.out))
    if not files:
        ap.error("nothing to plot: give --latency, --e2e and/or --toggle")
    print("\n".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
