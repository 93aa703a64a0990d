"""`convgpu run --limit SIZE [--name N] -- CMD ...`: a job outside containers gets a cgroup of its
own, registered with the running enforcer (limit and name) before CMD starts, so CMD's first
CUDA call is already counted against that limit. The cgroup is removed when CMD exits; the exit
status is CMD's."""
import os
import re
import signal
import subprocess

import typer

from ..enforcer.tenants.cgroupfs import cgroup_layout, remove_cgroup
from ..errors import ConvgpuError
from ..units import parse_size
from . import common

PARENT = "/convgpu.run"


def job_cgroups(name: str) -> tuple[str, list[str]]:
    """(path as the enforcer sees it, directories to join): cgroup2, plus the v1 freezer on
    hybrid hosts so that --stall freezer works there too."""
    lay = cgroup_layout()
    if lay.v2_root is None:
        raise ConvgpuError("no cgroup2 hierarchy is mounted", "mount cgroup2 (convgpu needs it)")
    rel = f"{PARENT}/{name}-{os.getpid()}"
    dirs = [lay.v2_root + rel]
    if lay.mode == "hybrid" and lay.freezer_v1_root:
        dirs.append(lay.freezer_v1_root + rel)
    return rel, dirs


def _join(dirs):
    def preexec():
        for d in dirs:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write("0")   # 0: the writing process, i.e. the child before exec
    return preexec


@common.handle_errors
def run(cmd: list[str] = typer.Argument(..., help="The command and its arguments (after --)."),
        limit: str = typer.Option(..., "--limit", help="GPU-memory limit of the job, e.g. 4GiB."),
        name: str = typer.Option("job", "--name", help="Name shown by status, trace and metrics."),
        shim: bool = typer.Option(False, "--shim", help="Also preload the shim: over-limit calls fail with out-of-memory instead of stalling."),
        run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Run CMD in a cgroup of its own with a GPU-memory limit, under the running enforcer."""
    size = parse_size(limit, "--limit")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ConvgpuError(f"invalid --name {name!r}", "use letters, digits, '.', '_' or '-'")
    rel, dirs = job_cgroups(name)
    env = dict(os.environ)
    if shim:
        from .shim import shim_env
        env.update(shim_env(run_dir))
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    try:
        common.control(run_dir, {"cmd": "register", "cgroup": rel, "limit": size, "name": name})
        try:
            child = subprocess.Popen(cmd, env=env, preexec_fn=_join(dirs))
        except OSError as e:
            raise ConvgpuError(f"cannot run {cmd[0]!r}: {e.strerror}", "check the command") from None
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: child.send_signal(s))
        rc = child.wait()
    finally:
        for d in dirs:
            remove_cgroup(d)
    raise typer.Exit(rc if rc >= 0 else 128 - rc)
