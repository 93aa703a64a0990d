"""`convgpu status`: the running enforcer's limits, assignments and waiters."""
import json

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..units import format_duration, format_size
from . import common
from .view import not_placed, row, short_id, state_of, text, used_of


def table(st: dict) -> Table | Group:
    caps = ", ".join(f"GPU{d} {format_size(g['assigned'])} of {format_size(g['capacity'])} assigned"
                     for d, g in st["gpus"].items())
    unchecked = st.get("unchecked_calls", 0)
    # per GPU: what a context is charged before NVML measures it, where that comes from
    # (learned, operator, measured-at-start, table-hint, conservative), and what the shim's
    # memory view leaves for one (ctxest.ceiling)
    ceiling = st.get("shim_ctx_ceiling", {})
    est = "; ".join(f"GPU{d} context {format_size(g['ctx_estimate']['bytes'])} ({g['ctx_estimate']['source']}"
                    + (", being measured: newcomers wait" if g.get("ctx_measuring") else "") + ")"
                    + (f", shim view {format_size(ceiling[d]['bytes'])}" if d in ceiling else "")
                    for d, g in st["gpus"].items() if "ctx_estimate" in g)
    notes = [est] if est else []
    dec = st.get("decisions") or {}
    if dec.get("state") == "unreadable":
        notes.append(f"decisions unreadable ({dec['error']}): every container is held until it is repaired or "
                     "moved aside and `convgpu reload` reads it")
    elif dec.get("write_error"):
        notes.append(f"the last decision could not be kept in {dec['path']} ({dec['write_error']}): refused")
    elif dec.get("state") == "memory":
        notes.append("no --state-dir: run-time limits and names are lost at a restart")
    if unchecked:
        notes.append(f"{unchecked} allocations ran unchecked while the enforcer's heartbeat had lapsed "
                     f"(see its log)")
    for m in st.get("gpu_mappings", []):    # probes/gpumap.py: said, never silently GPU 0
        if not m["certain"] or m.get("contradiction"):
            where = (f"charged to GPU {m['also']}" if st.get("unmapped_charge") == "all" and m["also"]
                     else f"charged as GPU {m['hosts']}")
            notes.append(f"pid {m['pid']}: its CUDA devices are not established as host GPUs "
                         f"({m.get('contradiction') or m['how']}): {where}")
    t = Table(title=f"convgpu enforce (pid {st['pid']}): policy {st['policy']}, stall {st['stall']}; {caps}",
              title_justify="left", caption_justify="left", caption=Text("\n").join(map(text, notes)) if notes else None)
    # `used` is allocated plus contexts, as in `convgpu trace` (cli/view.py); `context` is its part
    for col in ("container", "id", "GPU", "limit", "assigned", "used", "context", "ctx from", "state", "stalled",
                "stalls"):
        t.add_column(col, justify="left" if col in ("container", "id", "state") else "right")
    for c in st["containers"]:
        for dev, g in c["gpus"].items():
            row(t, c["name"], short_id(c.get("kind", ""), c.get("id", "")), dev, format_size(c["limit"]),
                format_size(g["assigned"]), format_size(used_of(g)), format_size(g["context_overhead"]),
                g.get("context_source", "-"), state_of(g), format_duration(c["stalled_s"]), str(c["stalls"]))
    for r in st.get("registered", []):   # run jobs, pods and claims with no CUDA call yet
        row(t, r["name"], short_id("cgroup" if r.get("cgroup") else "", r.get("id", "")), "-",
            format_size(r["limit"]), "", "", "", "", not_placed(r), "", "")
    if not st["containers"] and not st.get("registered"):   # a line, not an empty table
        return Group(text(t.title), text("no containers: none has made a CUDA call yet"), *map(text, notes))
    return t


def mine(st: dict) -> list[str]:
    """The caller's own container as lines (status --mine): each GPU's use and, if it waits,
    what for and what to ask."""
    out = [f"container {st['container']}: limit {format_size(st['limit'])} ({st['source']})"]
    if st.get("note"):
        out.append(st["note"])
    for dev, g in st["gpus"].items():
        line = (f"GPU{dev}: uses {format_size(g['used'])} of its limit {format_size(g['limit'])} "
                f"(a CUDA context counts {format_size(g['context'])}), {format_size(g['assigned'])} assigned")
        if g["over_limit"]:
            line += (f"; WAITS {format_duration(g['waiting_s'])}: it needs {format_size(g['needs'])}, above its "
                     "limit; only a higher limit lets it go on: ask the operator (`convgpu limit set`)")
        elif g["waiting"]:
            line += (f"; WAITS {format_duration(g['waiting_s'])} for memory other jobs hold; it goes on when they "
                     "free it")
        out.append(line)
    return out


@common.handle_errors
def status(as_json: bool = typer.Option(False, "--json", help="The full state as JSON."),
           own: bool = typer.Option(False, "--mine", help="From inside a container: only its own limit, use and "
                                    "waits, asked over the shim socket ($CONVGPU_SHIM_SOCKET; no root needed)."),
           run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Show the running enforcer's containers: limits, assignments, usage, waiters."""
    if own:
        st = common.own_status(run_dir)
        typer.echo(json.dumps(st, indent=2) if as_json else "\n".join(mine(st)))
        return
    st = common.control(run_dir, {"cmd": "status"})["status"]
    if as_json:
        typer.echo(json.dumps(st, indent=2))
    else:
        Console(width=max(Console().width, 140)).print(table(st))   # 11 columns: names and ids whole
