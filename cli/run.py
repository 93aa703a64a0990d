"""`convgpu run --limit SIZE [--name N] -- CMD ...`: a job outside containers gets a cgroup of its
own, registered with the running enforcer (limit and name) before CMD starts, so CMD's first
CUDA call is already counted against that limit. The cgroup is removed when CMD exits; the exit
status is CMD's. While CMD waits for memory, stderr says so (issue 52: a stalled job printed
nothing, and looked hung)."""
import os
import re
import signal
import subprocess
import sys
import time

import typer

from ..enforcer.tenants.cgroupfs import cgroup_layout, remove_cgroup
from ..errors import ConvgpuError
from ..units import format_apart, format_duration as duration, format_size, parse_size
from . import common

LOOK_EVERY = 1.0    # s between two looks at the enforcer's status while the job runs
REMIND_EVERY = 60.0  # s between two reminders that the job still waits

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


class Watch:
    """What the job's container waits for, from the enforcer's status: one line when a wait
    starts, a reminder every REMIND_EVERY, one when it resumes, one when the enforcer stops
    answering (the job then runs unchecked) and when it answers again. say: where lines go."""

    def __init__(self, cgroup: str, name: str, run_dir: str, say):
        self.cgroup, self.name, self.say = cgroup, name, say
        self.opt = "" if run_dir == common.RUN_DIR else f" --run-dir {run_dir}"
        self.since = self.told = None   # when the wait began; when it was last said
        self.gone = False

    def look(self, st: dict | None, now: float, error: str = ""):
        if st is None:
            if not self.gone:
                self.gone = True
                self.say(f"the enforcer does not answer ({error}): {self.name} is not limited meanwhile")
            return
        if self.gone:
            self.gone = False
            self.say(f"the enforcer (pid {st['pid']}) answers again")
        why = self.waits(st)
        if why is None:
            if self.since is not None:
                self.say(f"{self.name} resumed after {duration(now - self.since)}")
            self.since = None
            return
        if self.since is None:
            self.since = self.told = now - why[0]
            self.say(f"{self.name} waits for GPU memory: {why[1]}; `convgpu status{self.opt}` shows more")
        elif now - self.told >= REMIND_EVERY:
            self.told = now
            self.say(f"{self.name} still waits ({duration(now - self.since)}): {why[1]}")

    def ended(self, rc: int, now: float):
        """The job ended between two looks: a wait it was in ended too."""
        if self.since is None:
            return
        self.say(f"{self.name} resumed after {duration(now - self.since)}" if rc == 0 else
                 f"{self.name} ended (status {rc}) {duration(now - self.since)} after its wait began")
        self.since = None

    def waits(self, st: dict) -> tuple[float, str] | None:
        """(seconds it has waited, why) if the job's container waits on a GPU, else None."""
        c = next((c for c in st.get("containers", []) if c.get("cgroup") == self.cgroup), None)
        waiting = [(d, g) for d, g in (c or {}).get("gpus", {}).items() if g.get("waiting")]
        if not waiting:
            return None
        dev, g = waiting[0]
        if g["over_limit"]:
            need, lim = format_apart(g.get("demand", 0), g["limit"])
            why = (f"on GPU{dev} it needs {need}, above its limit {lim}, and waits until the limit is raised: "
                   f"`convgpu limit set {self.cgroup} SIZE{self.opt}`")
        else:
            why = (f"on GPU{dev} others hold the memory it was not yet assigned ({format_size(g['assigned'])} "
                   f"of its limit {format_size(g['limit'])} assigned); it resumes when they free it")
        return g.get("waiting_s", 0.0), why


def _look(watch: Watch, run_dir: str):
    try:
        st = common.control(run_dir, {"cmd": "status"})["status"]
    except ConvgpuError as e:
        watch.look(None, time.monotonic(), e.problem)
        return
    watch.look(st, time.monotonic())


def say(line: str):
    print(f"convgpu run: {line}", file=sys.stderr, flush=True)


@common.handle_errors
def run(cmd: list[str] = typer.Argument(..., help="The command and its arguments (after --)."),
        limit: str = typer.Option(..., "--limit", help="GPU-memory limit of the job, e.g. 4GiB."),
        name: str = typer.Option("job", "--name", help="Name shown by status, trace and metrics."),
        shim: bool = typer.Option(False, "--shim", help="Also preload the shim: over-limit calls fail with out-of-memory instead of stalling."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Say nothing on stderr while the job waits for memory."),
        run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Run CMD in a cgroup of its own with a GPU-memory limit, under the running enforcer. While
    the job waits for GPU memory, stderr says what it waits for and how to see more."""
    size = parse_size(limit, "--limit")
    if size == 0:
        raise ConvgpuError("--limit 0 lets the job allocate nothing, and its first CUDA call waits",
                           "give a size, e.g. --limit 4GiB")
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
        reply = common.control(run_dir, {"cmd": "register", "cgroup": rel, "limit": size, "name": name})
        if reply.get("warning"):
            say(f"warning: {reply['warning']}")
        try:
            child = subprocess.Popen(cmd, env=env, preexec_fn=_join(dirs))
        except OSError as e:
            raise ConvgpuError(f"cannot run {cmd[0]!r}: {e.strerror}", "check the command") from None
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: child.send_signal(s))
        watch = None if quiet else Watch(rel, name, run_dir, say)
        while True:
            try:
                rc = child.wait(timeout=LOOK_EVERY)
                if watch is not None:
                    watch.ended(rc, time.monotonic())
                break
            except subprocess.TimeoutExpired:
                if watch is not None:
                    _look(watch, run_dir)
    finally:
        for d in dirs:
            remove_cgroup(d)
    raise typer.Exit(rc if rc >= 0 else 128 - rc)
