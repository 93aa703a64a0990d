"""render(snapshot) -> a rich renderable. Pure: no I/O, so it is tested from a snapshot."""
import time

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..enforcer.model import Snapshot
from ..printable import printable
from ..units import format_size

WIDTH = 100
MODES = {
    "driver": "tracing the NVIDIA driver",
    "demo": "DEMO (no NVIDIA driver here): bundled workload on a stand-in driver",
    "waiting": "waiting for a CUDA driver (libcuda.so.1) to appear",
}


def text(x, style: str = "") -> Text:
    """A cell as text, never markup, its control characters escaped: names, comms, paths and
    notes come from processes and containers (issue 39 attack 2: a process named `[/x]` ended
    the live view with rich's MarkupError, every string rich is handed as a str being parsed as
    markup; issue 47 finding 6: a name's terminal escapes reached the terminal, printable()).
    A Text made elsewhere is checked too (rebuilt, in its style, where it has any)."""
    if isinstance(x, Text):
        return x if printable(x.plain) == x.plain else Text(printable(x.plain), style=x.style)
    return Text(printable(x), style=style)


def row(t: Table, *cells):
    t.add_row(*map(text, cells))


def not_placed(r: dict) -> str:
    """The state cell of an entry with a limit and no CUDA call yet (enforcer/runtime.py registered)."""
    return {"pod": "pod, no call yet", "claim": "claim, no call"}.get(r.get("what"), "registered")


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f}s" if s < 60 else f"{s / 60:.0f}m"


def _header(s: Snapshot) -> Text:
    t = Text()
    t.append("convgpu trace", style="bold")
    t.append("  " + MODES.get(s.mode, s.mode), style="yellow" if s.mode != "driver" else "green")
    t.append("   Ctrl-C to end", style="dim")
    return t


def gpu_table(s: Snapshot) -> Table:
    t = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False)
    for col, j in (("GPU", "right"), ("name", "left"), ("total", "right"), ("used (NVML)", "right"),
                   ("tracked", "right")):
        t.add_column(col, justify=j)
    if not s.gpus:
        row(t, "-", "no GPU activity seen yet", "", "", "")
    for g in s.gpus:
        row(t, str(g.index), g.name[:36], format_size(g.total), format_size(g.used), format_size(g.tracked))
    return t


def container_table(s: Snapshot) -> Table:
    # 22 + 3 + 4 x 10 + 11 + 7 + 6 columns and 8 one-space gaps: 97 of 100 columns
    t = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False, padding=(0, 0, 0, 1))
    t.add_column("container / process", width=22, no_wrap=True, overflow="ellipsis")
    t.add_column("GPU", justify="right", min_width=3, no_wrap=True)
    for col, w in (("live", 10), ("context", 11), ("total", 10), ("peak", 10), ("alloc/s", 7), ("last", 6)):
        t.add_column(col, justify="right", min_width=w, no_wrap=True)
    if not s.containers:
        row(t, Text("no CUDA process yet", style="dim"), "", "", "", "", "", "", "")
    for c in s.containers:
        gpus = ",".join(str(g) for g in sorted({p.gpu for p in c.processes}))
        n = len(c.pids)
        label = text(c.name, "bold")   # kind and id are in --json; processes below
        label.append(f" [{n}]" if n > 1 else "", style="dim")
        row(t, label, gpus,
                  format_size(c.live), format_size(c.overhead), format_size(c.total),
                  format_size(c.peak), f"{c.rate:.1f}", _age(c.last_event_age))
        for p in c.processes:
            src = {"nvml": "", "estimate": " ~", "none": ""}[p.overhead_source]
            row(t, text(f"  {p.pid} {p.comm}", "dim"), str(p.gpu), format_size(p.live),
                      format_size(p.overhead) + src, format_size(p.total), format_size(p.peak),
                      f"{p.rate:.1f}", _age(p.last_event_age))
    return t


def events_table(s: Snapshot, rows: int = 8) -> Table:
    t = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False, title="recent events",
              title_justify="left", title_style="bold")
    for col, j in (("time", "right"), ("pid", "right"), ("comm", "left"), ("event", "left"),
                   ("call", "left"), ("size", "right"), ("live", "right")):
        t.add_column(col, justify=j, no_wrap=True)
    mono_now = time.monotonic_ns()
    for e in list(s.events)[-rows:]:
        call = e.api + (f" ({e.rt_api})" if e.rt_api else "")
        op = e.op + ("~" if e.estimate else "") + ("?" if e.unknown else "")
        row(t, f"-{(mono_now - e.ts_ns) / 1e9:.1f}s", str(e.pid), e.comm[:12], op, call[:34],
                  format_size(e.size) if e.size else "", format_size(e.live) if e.op in ("alloc", "free") else "")
    return t


def enforce_table(s: Snapshot) -> Table:
    """Limits, assignments and waiters of the enforcer that sent this snapshot."""
    e = s.enforce
    caps = ", ".join(f"GPU{d} {format_size(g['assigned'])} of {format_size(g['capacity'])}" for d, g in e["gpus"].items())
    t = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False, padding=(0, 0, 0, 1),
              title=f"enforce (pid {e['pid']}): policy {e['policy']}, stall {e['stall']}; assigned {caps}",
              title_justify="left", title_style="bold")
    t.add_column("container", width=22, no_wrap=True, overflow="ellipsis")
    t.add_column("GPU", justify="right", min_width=3, no_wrap=True)
    for col, w in (("limit", 10), ("assigned", 10), ("used", 10), ("state", 16), ("stalled", 8), ("stalls", 6)):
        t.add_column(col, justify="left" if col == "state" else "right", min_width=w, no_wrap=True)
    if not e["containers"] and not e.get("registered"):
        row(t, Text("no container placed yet", style="dim"), "", "", "", "", "", "", "")
    for c in e["containers"]:
        for dev, g in c["gpus"].items():
            state = (Text(f"over by {format_size(g['over_by'])}", style="bold red") if g.get("over_by") else
                     Text("over limit", style="bold red") if g["over_limit"] else
                     Text(f"waiting {g['waiting_s']:.1f}s", style="yellow") if g["waiting"] else Text("running"))
            if g.get("swapped"):   # in host memory by the driver's checkpoint (enforcer/swap/)
                state = Text(f"swapped {format_size(g['swapped'])}", style="cyan")
            row(t, text(c["name"], "bold"), dev, format_size(c["limit"]), format_size(g["assigned"]),
                      format_size(g["used"] + g["context_overhead"]), state, _age(c["stalled_s"]), str(c["stalls"]))
        if c.get("kind") == "claim":   # a DRA claim's budget: the containers that share it, below it
            for m in c.get("consumers", []):
                row(t, text(f"  {m['id'][:12]} ({len(m['pids'])} proc)", "dim"), "", "", "", "", "", "", "")
    for r in e.get("registered", []):   # run jobs, pods and claims with no CUDA call yet
        row(t, text(r["name"], "bold"), "-", format_size(r["limit"]), "", "", Text(not_placed(r), style="dim"), "", "")
    return t


def footer(s: Snapshot) -> Text:
    t = Text(style="dim")
    t.append(f"events {s.events_total}   dropped {s.drops}   ~ = estimated context overhead (no NVML)\n")
    # a library's path and a note's words may be a container's: printable
    libs = printable(f"probed ({len(s.libraries)}): " + ", ".join(s.libraries)) if s.libraries else "no CUDA library probed yet"
    t.append(libs if len(libs) < WIDTH else libs[: WIDTH - 2] + "…")
    for n in s.notes:
        t.append("\n" + printable(n), style="yellow")
    return t


def render(s: Snapshot, event_rows: int = 8) -> Group:
    parts = [_header(s), gpu_table(s), container_table(s)]
    if s.enforce is not None:
        parts.append(enforce_table(s))
    return Group(*parts, events_table(s, event_rows), footer(s))
