"""PNG plots of the scheduling experiment (matplotlib: the optional `bench` extra)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from convgpu.units import format_size  # noqa: E402

from bench.plots import save  # noqa: E402

MAX_DEADLOCKED = 0.1   # a point is drawn while at most this share of its runs deadlocked
PANELS = (("makespan", "makespan (s)"), ("mean_suspended", "mean suspended time (s)"),
          ("p95_suspended", "p95 suspended time (s)"), ("deadlocks", "runs deadlocked (%)"))


def plot_simulation(results: dict, meta: dict, out: Path) -> list[Path]:
    """One PNG per context overhead: four panels against N, one line per policy, shaded 95 %
    confidence intervals (over the runs that finished)."""
    files = []
    for oname, by_n in results.items():
        ns = [int(n) for n in by_n]
        labels = list(next(iter(by_n.values())))
        fig, axes = plt.subplots(2, 2, figsize=(11, 8.5), sharex=True)
        for ax, (metric, title) in zip(axes.flat, PANELS):
            for lab in labels:
                rows = [by_n[str(n)][lab] for n in ns]
                if metric == "deadlocks":
                    ax.plot(ns, [100 * r["deadlocks"] / r["runs"] for r in rows], marker=".", label=lab)
                    continue
                # over the runs that finished: meaningless once many deadlock (survivors only)
                pts = [(n, r[metric]["mean"], r[metric]["ci"]) for n, r in zip(ns, rows)
                       if r["deadlocks"] <= MAX_DEADLOCKED * r["runs"]]
                xs, mean, ci = [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
                line, = ax.plot(xs, mean, marker=".", label=lab)
                ax.fill_between(xs, [m - c for m, c in zip(mean, ci)], [m + c for m, c in zip(mean, ci)],
                                color=line.get_color(), alpha=0.2)
            ax.set_title(title)
            ax.grid(alpha=0.3)
        for ax in axes[1]:
            ax.set_xlabel("containers (N)")
        axes[0][0].legend()
        fig.suptitle(f"simulator, 5 GiB, context overhead {format_size(meta['overheads'][oname])} "
                     f"({oname}), {meta['seeds']} seeds per point, {meta['date']}\n"
                     f"means of the runs that finished, drawn while at most "
                     f"{MAX_DEADLOCKED:.0%} deadlocked; shaded: 95 % CI")
        files.append(save(fig, out / f"sim-{oname}.png"))
    return files
