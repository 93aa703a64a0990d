"""PNG plots of the scheduling experiment (matplotlib: the optional `bench` extra)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from convgpu.units import format_size  # noqa: E402

PANELS = (("makespan", "makespan (s)"), ("mean_suspended", "mean suspended time (s)"),
          ("p95_suspended", "p95 suspended time (s)"), ("deadlocks", "runs deadlocked (%)"))


def plot_simulation(results: dict, meta: dict, out: Path) -> list[Path]:
    """One PNG per context overhead: four panels against N, one line per policy, shaded 95 %
    confidence intervals (over the runs that finished)."""
    files = []
    for oname, by_n in results.items():
        ns = [int(n) for n in by_n]
        labels = list(next(iter(by_n.values())))
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
        for ax, (metric, title) in zip(axes.flat, PANELS):
            for lab in labels:
                rows = [by_n[str(n)][lab] for n in ns]
                if metric == "deadlocks":
                    ax.plot(ns, [100 * r["deadlocks"] / r["runs"] for r in rows], marker=".", label=lab)
                    continue
                mean = [r[metric]["mean"] for r in rows]
                ci = [r[metric]["ci"] for r in rows]
                line, = ax.plot(ns, mean, marker=".", label=lab)
                ax.fill_between(ns, [m - c for m, c in zip(mean, ci)], [m + c for m, c in zip(mean, ci)],
                                color=line.get_color(), alpha=0.2)
            ax.set_title(title)
            ax.grid(alpha=0.3)
        for ax in axes[1]:
            ax.set_xlabel("containers (N)")
        axes[0][0].legend()
        fig.suptitle(f"simulator, 5 GiB, context overhead {format_size(meta['overheads'][oname])} "
                     f"({oname}), {meta['seeds']} seeds per point, {meta['date']}")
        fig.tight_layout()
        path = out / f"sim-{oname}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path)
    return files


def plot_real(rows: list[dict], out: Path, title: str) -> Path:
    """Real runs against the simulator on the same seeds: makespan and mean suspended time per
    policy, bars side by side (times in the workload's unscaled seconds)."""
    policies = sorted({r["policy"] for r in rows}, key=[r["policy"] for r in rows].index)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, name in ((axes[0], "makespan", "makespan (s)"),
                             (axes[1], "mean_suspended", "mean suspended time (s)")):
        xs = range(len(policies))
        for k, (src, off) in enumerate((("sim", -0.2), ("real", 0.2))):
            vals = [sum(r[src][metric] for r in rows if r["policy"] == p) /
                    max(1, sum(1 for r in rows if r["policy"] == p)) for p in policies]
            ax.bar([x + off for x in xs], vals, width=0.4, label="simulator" if src == "sim" else "enforcer")
        ax.set_xticks(list(xs), policies)
        ax.set_title(name)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "real-vs-sim.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
