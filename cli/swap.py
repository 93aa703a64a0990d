"""`convgpu swap out|in NAME|PID [--gpu N]`: a container's (or one process's) GPU memory to host
memory by the driver's checkpoint, and back (issue 46; docs/ENFORCE.md, "Taking memory back")."""
import time

import typer

from ..printable import printable
from ..units import format_size
from . import common

app = typer.Typer(help="Move GPU memory to host memory and back (the driver's checkpoint).", no_args_is_help=True)
TARGET = typer.Argument(..., help="A container's name or id (every CUDA process of it), or a pid.")
GPU = typer.Option(None, "--gpu", help="Only its processes on this GPU (default: every GPU).")
WAIT = typer.Option(120.0, "--wait", min=0.0, help="Seconds to wait for it to be done (0: do not wait).")


def _states(run_dir: str, pids: list[int]) -> dict[int, tuple[str, int]]:
    """pid -> (its swap state, bytes) as `status` shows it; "running" once untracked."""
    st = common.control(run_dir, {"cmd": "status"})["status"]
    out = {p: ("running", 0) for p in pids}
    for c in st["containers"]:
        for g in c["gpus"].values():
            for s in g.get("swaps", []):
                if s["pid"] in out:
                    out[s["pid"]] = (s["state"], s["bytes"])
    return out


def _wait(run_dir: str, pids: list[int], busy: tuple, wait: float) -> dict:
    """Polls `status` while any of pids is in a `busy` state, for at most `wait` s."""
    deadline = time.monotonic() + wait
    states = _states(run_dir, pids)
    while wait and any(s in busy for s, _ in states.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        states = _states(run_dir, pids)
    return states


@app.command("out")
@common.handle_errors
def swap_out(target: str = TARGET, gpu: int = GPU, wait: float = WAIT,
             run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Checkpoint TARGET's GPU memory to host memory: the GPU is free of it; it comes back at its
    next CUDA call, granted by the policy (or `convgpu swap in`)."""
    r = common.control(run_dir, {"cmd": "swap-out", "target": target, "gpu": gpu})
    typer.echo(printable(r["message"]))
    for pid, (state, n) in sorted(_wait(run_dir, r["pids"], ("locking", "checkpointing"), wait).items()):
        typer.echo(f"pid {pid}: {state}" + (f", {format_size(n)} in host memory" if state == "out" else ""))


@app.command("in")
@common.handle_errors
def swap_in(target: str = TARGET, gpu: int = GPU, wait: float = WAIT,
            run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Bring TARGET's swapped memory back: a wait for its whole footprint, granted by the policy
    like any wait, then restored."""
    r = common.control(run_dir, {"cmd": "swap-in", "target": target, "gpu": gpu})
    typer.echo(printable(r["message"]))
    for pid, (state, _) in sorted(_wait(run_dir, r["pids"], ("out", "restoring", "unlocking"), wait).items()):
        typer.echo(f"pid {pid}: {'back on the GPU' if state == 'running' else state + ' (waits for room)'}")
