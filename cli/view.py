"""render(snapshot) -> a rich renderable. Pure: no I/O, so it is tested from a snapshot.

One vocabulary in every view (issue 52: trace's "used" was allocations and contexts, status's
allocations alone; one container had two names): `allocated` is what a container's allocation
calls hold, `context` what its CUDA contexts cost, and `used` the two together, the figure its
limit is held against, in `convgpu trace` and `convgpu status` alike. A container has one name
(the enforcer's, where one runs) and an id that `convgpu limit set` takes. Durations read as
4.2s, 3m05s, 3h00m. The layout fits the terminal: below WIDTH columns the least needed columns
go, and with a height, process rows and events give way before anything is cut."""
import time

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..enforcer.model import Snapshot
from ..enforcer.tenants.containers import Container
from ..printable import printable
from ..units import format_duration, format_size

WIDTH = 100          # the widest the views get; below it, columns go (narrow)
MODES = {
    "driver": "tracing CUDA calls",
    "demo": "DEMO (no NVIDIA driver here): bundled workload on a stand-in driver",
    "waiting": "waiting for a CUDA driver (libcuda.so.1) to appear",
}
# what an event is, in the views' words (--json keeps the op names: docs/trace-json.md)
EVENT_WORDS = {"unknown": "first call", "ctx_create": "context", "ctx_destroy": "ctx gone",
               "over_limit": "over limit", "stall": "stalled", "set_device": "set device",
               "lib_open": "lib open", "full": "map full", "unsized": "unsized"}
QUIT = "q or Ctrl-C to end"


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


def short_id(kind: str, cid: str) -> str:
    """The id a view shows, which `convgpu limit set` takes: an engine's 12 hex digits, a
    cgroup's last component (Container.short)."""
    return Container(kind, cid, "").short if cid else "-"


def state_of(g: dict) -> Text:
    """A container's state on one GPU, in the words of every view; swapped out first (in host
    memory by the driver's checkpoint: enforcer/swap/), then what else it is."""
    state = _state(g)
    if g.get("swapped"):
        return Text.assemble((f"swapped {format_size(g['swapped'])} ({format_duration(g.get('swapped_s', 0))}), ",
                              "cyan"), state)
    return state


def _state(g: dict) -> Text:
    if g.get("over_by"):
        return Text(f"over by {format_size(g['over_by'])} ({format_duration(g.get('over_s', 0))})", style="bold red")
    if g.get("over_limit"):
        return Text("over limit", style="bold red")
    if g.get("waiting"):
        return Text(f"waiting {format_duration(g['waiting_s'])}", style="yellow")
    return Text("running")


def used_of(g: dict) -> int:
    """`used` in the views: allocated plus contexts (status --json keeps them apart)."""
    return g["used"] + g["context_overhead"]


def _table(title: str | None = None) -> Table:
    """Columns one space apart (the box's divider), no edges: at 80 columns every cell counts."""
    return Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False, padding=0, show_edge=False,
                 title=title, title_justify="left", title_style="bold")


def _header(s: Snapshot, alert: str | None) -> Text:
    t = Text()
    t.append("convgpu trace", style="bold")
    mode = MODES.get(s.mode, s.mode)
    if s.mode == "driver":
        mode += f" ({len(s.libraries)} librar{'y' if len(s.libraries) == 1 else 'ies'} probed)"
    t.append("  " + mode, style="yellow" if s.mode != "driver" else "green")
    t.append("   " + QUIT, style="dim")
    if alert:
        t.append("\n" + alert, style="bold red")
    return t


def gpu_table(s: Snapshot, narrow: bool = False) -> Table:
    t = _table()
    for col, j in (("GPU", "right"), ("name", "left"), ("total", "right"), ("used (NVML)", "right"),
                   ("tracked", "right")):
        t.add_column(col, justify=j, no_wrap=True)
    if not s.gpus:
        row(t, "-", "no GPU activity seen yet", "", "", "")
    for g in s.gpus:
        row(t, str(g.index), g.name[:24 if narrow else 36], format_size(g.total), format_size(g.used),
            format_size(g.tracked))
    return t


def _names(s: Snapshot) -> dict[str, str]:
    """cgroup -> the enforcer's name for it (a `convgpu run --name`, a pod's job): one name per
    container in every table."""
    e = s.enforce or {}
    return {c["cgroup"]: c["name"] for c in e.get("containers", []) if c.get("cgroup")}


def container_table(s: Snapshot, narrow: bool = False, processes: bool = True) -> Table | Text:
    """What the probes see: per container, then per process (processes=False: counted only);
    none yet: one line, which says where a stalled job is (issue 52: "no CUDA process yet"
    stood beside a job stalled at its first call)."""
    if not s.containers:
        e = s.enforce or {}
        waiting = sum(1 for c in e.get("containers", []) for g in c["gpus"].values() if g.get("waiting"))
        word = (f"no allocation yet; {waiting} waiting (below)" if waiting else
                "no allocation yet (the enforcer's view below)" if e.get("containers") or e.get("registered")
                else "no CUDA process yet")
        return Text.assemble(("containers: ", "bold"), (word, "dim"))
    t = _table("containers")
    t.add_column("container / process", width=16 if narrow else 22, no_wrap=True, overflow="ellipsis")
    t.add_column("id", width=12, no_wrap=True, overflow="ellipsis")
    t.add_column("GPU", justify="right", width=3, no_wrap=True, overflow="ellipsis")
    cols = [("allocated", 10), ("context", 12), ("used", 10), ("peak", 10)]
    if not narrow:
        cols += [("alloc/s", 7), ("last", 6)]
    for col, w in cols:
        t.add_column(col, justify="right", width=w, no_wrap=True, overflow="ellipsis")
    names = _names(s)
    for c in s.containers:
        gpus = ",".join(str(g) for g in sorted({p.gpu for p in c.processes}))
        n = len(c.pids)
        label = text(names.get(c.cgroup, c.name), "bold")   # kind and full id are in --json
        label.append(f" [{n}]" if n > 1 else "", style="dim")
        extra = [] if narrow else [f"{c.rate:.1f}", format_duration(c.last_event_age)]
        row(t, label, short_id(c.kind, c.id), gpus, format_size(c.live), format_size(c.overhead),
            format_size(c.total), format_size(c.peak), *extra)
        if not processes:
            continue
        for p in c.processes:
            src = {"nvml": "", "estimate": " ~", "none": ""}[p.overhead_source]
            extra = [] if narrow else [f"{p.rate:.1f}", format_duration(p.last_event_age)]
            row(t, text(f"  {p.pid} {p.comm}", "dim"), "", str(p.gpu), format_size(p.live),
                format_size(p.overhead) + src, format_size(p.total), format_size(p.peak), *extra)
    return t


def events_table(s: Snapshot, rows: int = 8, narrow: bool = False) -> Table:
    t = _table("recent events")
    cols = [("time", "right", 7), ("pid", "right", 7), ("comm", "left", 10 if narrow else 12),
            ("event", "left", 12), ("call", "left", 26 if narrow else 34), ("size", "right", 10)]
    cols += [] if narrow else [("live", "right", 10)]
    for col, j, w in cols:
        t.add_column(col, justify=j, max_width=w, no_wrap=True, overflow="ellipsis")
    mono_now = time.monotonic_ns()
    for e in list(s.events)[-rows:] if rows else ():
        call = e.api + (f" ({e.rt_api})" if e.rt_api else "")
        op = EVENT_WORDS.get(e.op, e.op) + ("~" if e.estimate else "") + ("?" if e.unknown else "")
        cells = [f"-{format_duration((mono_now - e.ts_ns) / 1e9)}", str(e.pid), e.comm[:10 if narrow else 12], op,
                 call[:26 if narrow else 34], format_size(e.size) if e.size else ""]
        if not narrow:
            cells.append(format_size(e.live) if e.op in ("alloc", "free") else "")
        row(t, *cells)
    return t


def enforce_table(s: Snapshot, narrow: bool = False) -> Table:
    """Limits, assignments and waiters of the enforcer that sent this snapshot."""
    e = s.enforce
    caps = ", ".join(f"GPU{d} {format_size(g['assigned'])} of {format_size(g['capacity'])}" for d, g in e["gpus"].items())
    t = _table(f"enforcer (pid {e['pid']}) {e['policy']}/{e['stall']}; assigned {caps}" if narrow else
               f"enforcer (pid {e['pid']}): policy {e['policy']}, stall {e['stall']}; assigned {caps}")
    t.add_column("container", width=14 if narrow else 18, no_wrap=True, overflow="ellipsis")
    t.add_column("id", width=12, no_wrap=True, overflow="ellipsis")
    t.add_column("GPU", justify="right", width=3, no_wrap=True, overflow="ellipsis")
    cols = [("limit", 10)] + ([] if narrow else [("assigned", 10)]) + [("used", 10), ("state", 16), ("stalled", 7)]
    cols += [] if narrow else [("stalls", 6)]
    for col, w in cols:
        t.add_column(col, justify="left" if col == "state" else "right", width=w, no_wrap=True, overflow="ellipsis")
    if not e["containers"] and not e.get("registered"):
        row(t, Text("no container placed yet", style="dim"), "", "", *[""] * len(cols))
    for c in e["containers"]:
        for dev, g in c["gpus"].items():
            cells = [format_size(c["limit"])] + ([] if narrow else [format_size(g["assigned"])])
            cells += [format_size(used_of(g)), state_of(g), format_duration(c["stalled_s"])]
            cells += [] if narrow else [str(c["stalls"])]
            row(t, text(c["name"], "bold"), short_id(c.get("kind", ""), c.get("id", "")), dev, *cells)
        if c.get("kind") == "claim":   # a DRA claim's budget: the containers that share it, under it
            for m in c.get("consumers", []):
                row(t, text(f"  + {len(m['pids'])} proc", "dim"), short_id(m.get("kind", ""), m["id"]), "",
                    *[""] * len(cols))
    for r in e.get("registered", []):   # run jobs, pods and claims with no CUDA call yet
        cells = [format_size(r["limit"])] + ([] if narrow else [""]) + ["", Text(not_placed(r), style="dim"), ""]
        cells += [] if narrow else [""]
        row(t, text(r["name"], "bold"), short_id("cgroup" if r.get("cgroup") else "", r.get("id", "")), "-",
            *cells)
    return t


def footer(s: Snapshot, width: int = WIDTH) -> Text:
    t = Text(style="dim")
    t.append(f"events {s.events_total}   dropped {s.drops}   ~ = estimated context overhead (no NVML)\n")
    # a library's path and a note's words may be a container's: printable
    libs = printable(f"probed ({len(s.libraries)}): " + ", ".join(s.libraries)) if s.libraries else "no CUDA library probed yet"
    t.append(libs if len(libs) < width else libs[: width - 2] + "…")
    for n in s.notes:
        t.append("\n" + printable(n), style="yellow")
    return t


def render(s: Snapshot, event_rows: int = 8, width: int = WIDTH, height: int | None = None,
           alert: str | None = None) -> Group:
    """The whole view for a terminal of width x height (None: as tall as it takes). Where it
    would not fit, first the process rows go (their containers stay), then events, down to 3,
    then the footer's notes: the header, the GPUs and every container stay."""
    narrow = width < WIDTH
    tries = [(True, event_rows, True), (False, event_rows, True), (False, min(event_rows, 3), True),
             (False, min(event_rows, 3), False), (False, 0, False)]
    for processes, rows, notes in tries if height else tries[:1]:
        parts = [_header(s, alert), gpu_table(s, narrow), container_table(s, narrow, processes)]
        if s.enforce is not None:
            parts.append(enforce_table(s, narrow))
        if rows:
            parts.append(events_table(s, rows, narrow))
        shown = s if notes else Snapshot(**{**s.__dict__, "notes": ()})
        parts.append(footer(shown, width))
        group = Group(*parts)
        if not height or lines(group, width) <= height:
            return group
    return group


def lines(renderable, width: int) -> int:
    """How many lines `renderable` takes at this width (rendered off screen)."""
    c = Console(width=width, color_system=None, file=_Null(), legacy_windows=False)
    return len(c.render_lines(renderable, c.options.update(width=width), pad=False))


class _Null:
    def write(self, _):
        return 0

    def flush(self):
        pass
