"""The picture of one run of a job (`convgpu recommend --plot JOB`): per GPU, what it held over
time (allocations and context charge together), its context charge, its limit, when it
waited, and the recommended limit as a line. matplotlib is the optional `plot` extra; without
it, one line says how to install it. The figure has a fixed size (WIDTH x HEIGHT pixels)
whatever the number of GPUs (one panel each, at most MAX_PANELS)."""
import datetime

from ...errors import ConvgpuError, MissingExtra
from ...units import format_size
from .recommend import size_text
from .store import SERIES_RUNS, Run

WIDTH, HEIGHT, DPI = 1200, 600, 100
MAX_PANELS = 8
GiB_IN_MiB = 1024


MIN_SPAN = 0.2   # s: a wait shorter than this is drawn this wide, so it shows


def spans(waits, dev: int, min_width: float = MIN_SPAN) -> list[tuple[float, float]]:
    """The waits on one GPU as the shading draws them: each at least min_width wide, and those
    that overlap or touch joined into one (issue 52: drawn one by one, their translucent
    shades added up into a solid block where waits followed each other)."""
    out: list = []
    for a, b in sorted((a, max(b, a + min_width)) for a, b, wd in waits if wd == dev):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def render(job: str, run: Run, recommended: int | None, path: str, method: str = "") -> tuple[int, int]:
    """Writes the PNG to path; returns its (width, height) in pixels."""
    fig = figure(job, run, recommended, method)
    fig.savefig(path, dpi=DPI, format="png")
    return fig.canvas.get_width_height()


def figure(job: str, run: Run, recommended: int | None, method: str = ""):
    """The run's matplotlib Figure (render writes it)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtra("plotting needs matplotlib, which is not installed",
                           "pip install 'convgpu[plot]' (or matplotlib)") from None
    s = run.series
    if s is None or not s.t:
        raise ConvgpuError(f"run {run.id} of {job} keeps no time series (only the newest {SERIES_RUNS} runs of a "
                           "job keep theirs)", "plot one of its newest runs (--run -1, -2, ...)")
    devs = sorted(s.held)[:MAX_PANELS]
    fig = Figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(devs), 1, sharex=True, squeeze=False)[:, 0]
    end = max(run.ended - run.started, s.t[-1])
    t = list(s.t) + [end]   # a point stands until the next one; the last, until the run ended
    top = 0.0
    for ax, d in zip(axes, devs):
        gib = {name: [v / GiB_IN_MiB for v in getattr(s, name)[d]] for name in ("held", "ctx", "limit")}
        gib = {name: v + v[-1:] for name, v in gib.items()}
        top = max(top, *gib["held"], *gib["limit"], (recommended or 0) / (GiB_IN_MiB << 20))
        ax.fill_between(t, 0, gib["ctx"], step="post", color="tab:gray", alpha=0.35, label="context charge")
        ax.plot(t, gib["held"], drawstyle="steps-post", color="tab:blue", label="held: allocations + contexts")
        if any(gib["limit"]):
            ax.plot(t, gib["limit"], drawstyle="steps-post", color="tab:red", label="its limit")
        if recommended:
            ax.axhline(recommended / (GiB_IN_MiB << 20), color="tab:green", linestyle="--",
                       label=f"recommended {size_text(recommended)}")
        for i, (a, b) in enumerate(spans(s.waits, d)):
            ax.axvspan(a, b, color="tab:orange", alpha=0.3, linewidth=0, label="waiting" if i == 0 else None)
        ax.set_ylabel(f"GPU {d} (GiB)")
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.set_ylim(0, top * 1.15 or 1)
        ax.set_xlim(0, end)
    axes[0].legend(loc="best", fontsize=8, framealpha=0.9)
    axes[-1].set_xlabel("seconds since the run began (points: the largest value of each interval)")
    when = datetime.datetime.fromtimestamp(run.started).strftime("%Y-%m-%d %H:%M")
    fig.suptitle(f"{job}: run of {when}, {run.ended - run.started:.0f} s, peak {format_size(run.peak)}, asked "
                 f"{format_size(run.limit)}; {run.stalls} stalls, {run.stalled_s:.1f} s waiting"
                 + (f"\nrecommended: {method}" if method else ""), fontsize=9)
    fig.tight_layout()
    return fig
