"""`convgpu recommend`: what each job should ask for, from its recent runs (docs/RECOMMEND.md).
Reads <state dir>/history.jsonl (the enforcer's, or `convgpu trace`'s where none runs); needs
no running enforcer. Thin over enforcer/history/ (recommend.py: the method; plot.py: the PNG)."""
from enum import Enum

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..enforcer.ctxest import DEFAULT_STATE_DIR
from ..enforcer.history import recommend as rc
from ..enforcer.history.jobs import safe
from ..enforcer.history.store import MAX_RUNS, HistoryFile, Unreadable
from ..errors import ConvgpuError, NotFoundError
from ..units import format_size, parse_size
from . import common
from .view import WIDTH, text


class Form(str, Enum):
    run = "run"
    units = "units"
    dra = "dra"


def method_of(margin: str, unit: str, runs: int, percentile: float, over: float) -> rc.Method:
    """--margin is a percentage ("10%") or a size ("512MiB")."""
    m = margin.strip()
    if m.endswith("%"):
        try:
            pct = int(m[:-1])
        except ValueError:
            pct = -1
        if not 0 <= pct <= 1000:
            raise ConvgpuError(f"invalid --margin {margin!r}", "give a whole percentage (10%) or a size (512MiB)")
        pct_bytes = (pct, 0)
    else:
        pct_bytes = (0, parse_size(m, "--margin"))
    u = parse_size(unit, "--unit")
    if u < 1 << 20:
        raise ConvgpuError(f"--unit {unit} is below 1 MiB", "give a unit like 256MiB (the device plugin's)")
    return rc.Method(pct_bytes[0], pct_bytes[1], u, runs, percentile, over)


def read(state_dir: str):
    f = HistoryFile(state_dir)
    try:
        return f, f.read()
    except PermissionError:
        raise ConvgpuError(f"permission denied reading {f.path}", "run it as root") from None
    except (Unreadable, OSError) as e:
        raise ConvgpuError(f"cannot read the job history {f.path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}",
                           "repair it or move it aside (the enforcer keeps new runs in memory until then)") from None


def find(h, wanted: str) -> str:
    """A job's key from what the user typed: the key, or a name that only one job has."""
    if wanted in h.jobs:
        return wanted
    hits = [k for k in h.jobs if k.split(":", 1)[1] in (wanted, safe(wanted))]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise NotFoundError(f"{wanted!r} names {len(hits)} jobs: {', '.join(sorted(hits))}", "give the whole key")
    raise NotFoundError(f"no job {wanted!r} in the history", "see `convgpu recommend` for the jobs it holds")


def table(recs, m: rc.Method) -> Table:
    t = Table(title=f"recommended: {m.text()}", title_justify="left")
    for col, just in (("job", "left"), ("runs", "right"), ("peak", "right"), ("recommend", "right"),
                      ("covers", "right"), ("asks", "right"), ("", "left")):
        t.add_column(col, justify=just, overflow="fold")
    for r in recs:
        flag = Text("over-asking", style="yellow") if r.over_asking else Text("")
        if r.under_asking:
            flag = Text("under-asking", style="red")
        t.add_row(text(r.job), str(r.runs), format_size(r.peak), rc.size_text(r.limit),
                  f"{r.covers}/{r.runs}", rc.size_text(r.asked), flag)
    return t


@common.handle_errors
def recommend(
    jobs: list[str] = typer.Argument(None, help="Jobs to show: a key (run:train, podman:web, k8s:ns/Deployment/web/app) or a name only one job has. Default: every job."),
    state_dir: str = typer.Option(DEFAULT_STATE_DIR, "--state-dir", envvar="CONVGPU_STATE_DIR", help="Where the history is (the enforcer's --state-dir)."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout: the method and, per job, the recommendation and its forms."),
    margin: str = typer.Option("10%", "--margin", help="Added to the peak: a whole percentage of it (10%) or a size (512MiB)."),
    unit: str = typer.Option("256MiB", "--unit", help="The limit is a whole number of these: give `convgpu kube --unit`."),
    runs: int = typer.Option(MAX_RUNS, "--runs", min=1, max=MAX_RUNS, help="The newest runs of each job that count."),
    percentile: float = typer.Option(100.0, "--percentile", min=1.0, max=100.0, help="Of the runs' peaks, by nearest rank (100: the largest)."),
    over: float = typer.Option(2.0, "--over", min=1.0, help="Over-asking: asks at least this many times the recommendation (and a unit more)."),
    form: list[Form] = typer.Option([], "--form", help="Forms to paste: run, units, dra (repeatable). Default: all three when one job is shown."),
    plot: str = typer.Option(None, "--plot", help="Write a PNG of this job's run: memory per GPU over time, its limit, context charge, waits, and the recommended limit."),
    out: str = typer.Option(None, "--out", help="The PNG's path (default convgpu-<job>.png here)."),
    run: int = typer.Option(-1, "--run", help="With --plot: which run, -1 the newest, -2 the one before, ..."),
):
    """What each job should ask for: the peak of its recent runs plus a margin, rounded up."""
    m = method_of(margin, unit, runs, percentile, over)
    f, h = read(state_dir)
    if plot is not None:
        return _plot(h, find(h, plot), m, out, run)
    if not h.jobs:
        raise ConvgpuError(f"no job history in {f.path} yet", "run jobs under `convgpu enforce` (or `convgpu trace` "
                           "where none runs); a run is kept when it ends")
    keys = [find(h, j) for j in jobs] if jobs else sorted(h.jobs)
    recs = [r for k in keys if (r := rc.recommend(k, h.jobs[k], m)) is not None]
    if as_json:
        import json
        typer.echo(json.dumps({"file": f.path, "method": {**vars(m), "text": m.text()},
                               "jobs": [r.to_json(m) for r in recs]}, indent=1))
        return
    console = Console(width=min(WIDTH, Console().width))
    console.print(table(recs, m))
    for r in recs:
        for note in r.notes:
            console.print(text(f"{r.job}: {note}"), highlight=False, soft_wrap=True)
    wanted = form or (list(Form) if len(recs) == 1 else [])
    for r in recs:
        for fm in wanted:
            console.print(text(f"# {r.job}, {fm.value}" + (f" (its runs used {r.gpus} GPUs: one GPU's limit)" if
                                                          r.gpus > 1 and fm is not Form.run else "")), style="dim")
            lines = rc.forms(r, m)[fm.value].split("\n")   # pasted whole: its lines kept, each printable
            console.print(Text("\n").join(map(text, lines)), highlight=False, soft_wrap=True)
    if len(recs) > 1 and not form:
        console.print("Forms to paste: give one job, or --form run|units|dra.", style="dim")


def _plot(h, key: str, m: rc.Method, out: str | None, index: int):
    from ..enforcer.history.plot import render
    runs = h.jobs[key]
    if not -len(runs) <= index < len(runs):
        raise ConvgpuError(f"{key} has {len(runs)} runs: no run {index}", f"give --run -1 .. -{len(runs)}")
    rec = rc.recommend(key, runs, m)
    path = out or f"convgpu-{rc.dns_name(key).removesuffix('-gpu-memory')}.png"
    w, hgt = render(key, runs[index], rec.limit if rec else None, path, m.text())
    typer.echo(f"wrote {path} ({w} x {hgt})")
