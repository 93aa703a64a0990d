"""`convgpu status`: the running enforcer's limits, assignments and waiters."""
import json

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..units import format_size
from . import common
from .view import not_placed, row, text


def table(st: dict) -> Table:
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
    for col in ("container", "GPU", "limit", "assigned", "used", "ctx", "ctx from", "state", "stalled", "stalls"):
        t.add_column(col, justify="left" if col in ("container", "state") else "right")
    for c in st["containers"]:
        for dev, g in c["gpus"].items():
            state = (f"over by {format_size(g['over_by'])} ({g['over_s']:.0f}s)" if g.get("over_by") else
                     "over limit" if g["over_limit"] else f"waiting {g['waiting_s']:.1f}s"
                     if g["waiting"] else "running")
            if g.get("swapped"):   # in host memory by the driver's checkpoint (enforcer/swap/)
                state = f"swapped {format_size(g['swapped'])} ({g['swapped_s']:.0f}s), {state}"
            row(t, c["name"], dev, format_size(c["limit"]), format_size(g["assigned"]),
                      format_size(g["used"]), format_size(g["context_overhead"]),
                      g.get("context_source", "-"), state,
                      f"{c['stalled_s']:.1f}s", str(c["stalls"]))
    for r in st.get("registered", []):   # run jobs, pods and claims with no CUDA call yet
        row(t, r["name"], "-", format_size(r["limit"]), "", "", "", "", not_placed(r), "", "")
    return t


@common.handle_errors
def status(as_json: bool = typer.Option(False, "--json", help="The full state as JSON."),
           run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Show the running enforcer's containers: limits, assignments, usage, waiters."""
    st = common.control(run_dir, {"cmd": "status"})["status"]
    if as_json:
        typer.echo(json.dumps(st, indent=2))
    else:
        Console(width=120).print(table(st))
