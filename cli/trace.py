"""`convgpu trace`: a live view (or JSON lines) of GPU memory per container, process and GPU."""
import json
import logging
import os
import sys
import time
from enum import Enum

import typer
from .. import phases
from ..demo import CTX_OVERHEAD as DEMO_CTX_OVERHEAD, GROUPS, Demo
from ..enforcer import devattrs
from ..enforcer.accounting import Accountant, matches
from ..enforcer.ctxest import DEFAULT_STATE_DIR
from ..enforcer.history import HistoryFile, Recorder, from_snapshot
from ..enforcer.tenants.containers import container_of_pid
from ..enforcer.tenants.engines import EngineLookup
from ..enforcer.model import Snapshot
from ..errors import ConvgpuError, NotFoundError
from ..probes.libs import system_drivers
from ..probes.nvml import Nvml
from ..probes.table import CUDA
from ..probes.tracer import Tracer
from ..units import format_duration, parse_size
from . import common
from .live import Keys, View

log = logging.getLogger("convgpu.cli.trace")


class DemoMode(str, Enum):
    auto = "auto"
    always = "always"
    never = "never"


def check_filters(pids: list[int], container: str | None, engines: EngineLookup) -> None:
    for pid in pids:
        if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
            raise NotFoundError(f"no process with pid {pid}", "check it with `ps -p PID`")
    if container is None:
        return
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                c = container_of_pid(int(d))
            except Exception:
                continue
            meta = engines.lookup_sync(c) if c.kind in ("docker", "podman", "containerd", "kubernetes", "crio") else None
            if matches(c, container, meta.name if meta else None):
                return
    raise NotFoundError(f"no running container or cgroup matches {container!r}",
                        "give a name, an id (6+ characters), a short id or a cgroup path; see `podman ps` / `docker ps`")


@common.handle_errors
def trace(
    pid: list[int] = typer.Option([], "--pid", "-p", help="Only these processes (repeatable)."),
    container: str = typer.Option(None, "--container", "-c", help="Only this container: name, id, short id or cgroup path."),
    interval: float = typer.Option(1.0, "--interval", "-i", min=0.05, help="Seconds between snapshots."),
    duration: float = typer.Option(0.0, "--duration", "-d", min=0.0, help="Stop after this many seconds (0: until Ctrl-C)."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout: every event and every snapshot (docs/trace-json.md)."),
    lib: list[str] = typer.Option([], "--lib", help="Also probe this libcuda.so.1 / libcudart (repeatable)."),
    discover: bool = typer.Option(True, "--discover/--no-discover", help="Find CUDA libraries on the host and in containers."),
    demo: DemoMode = typer.Option(DemoMode.auto, "--demo", help="auto: run the bundled demo when the host has no NVIDIA driver and no --pid, --lib or --container is given."),
    ctx_overhead: str = typer.Option(None, "--ctx-overhead", help="What a CUDA context is shown as until NVML has measured one on its GPU (then: the median measured there). Not given: 519MiB (a bare context on an H100), 64MiB in the demo; with an enforcer running, its own charges are shown."),
    events: bool = typer.Option(True, "--events/--no-events", help="With --json: also print each event."),
    selftest: bool = typer.Option(True, "--selftest/--no-selftest", help="Check that every probe of the host's own driver fires (a child calls each symbol once, before cuInit); a container's copy is only read, never loaded."),
    no_bpf_cache: bool = typer.Option(False, "--no-bpf-cache", help=common.NO_BPF_CACHE_HELP),
    run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help="Where a running enforcer answers: then trace shows its view (limits, assignments, waiters) instead of probing twice."),
    history: bool = typer.Option(True, "--history/--no-history", help="Keep each container's run in the job history (`convgpu recommend`), where no enforcer runs (it keeps them then); not for the demo or with --pid."),
    state_dir: str = typer.Option(DEFAULT_STATE_DIR, "--state-dir", envvar="CONVGPU_STATE_DIR", help="Where the job history is kept (the enforcer's --state-dir)."),
):
    """Watch live how much GPU memory each container and process holds."""
    phases.mark("imports")
    overhead = parse_size(ctx_overhead, "--ctx-overhead") if ctx_overhead is not None else None
    if demo is DemoMode.always and (pid or container is not None):
        what = f"--pid {pid[0]}" if pid else f"--container {container}"
        raise ConvgpuError(f"--demo always shows only the demo's own workers, and {what} would hide them",
                           f"drop {what.split()[0]}, or use --demo auto")
    engines = EngineLookup()
    check_filters(pid, container, engines)
    if demo is not DemoMode.always and _enforcer_answers(run_dir):
        engines.close()
        common.stop_on_signals()
        try:
            _remote(run_dir, set(pid), container, interval, duration, as_json, events)
        except KeyboardInterrupt:
            pass
        return
    nvml = Nvml()
    tracer = Tracer(libraries=tuple(lib), discover=discover, selftest=selftest, bpf_cache=common.bpf_cache(no_bpf_cache))
    tracer.gpumap.gpus = nvml.gpus()    # each process's CUDA devices as host GPUs (probes/gpumap.py)
    the_demo = recorder = None
    common.stop_on_signals()
    try:
        phases.mark("setup")
        tracer.start()
        tracer.enable_discovery()   # a process opening a new driver copy waits for its probes
        lib_ = devattrs.host_driver(tracer.libraries)   # what a stack limit costs on each GPU
        if lib_ is not None:
            devattrs.write(tracer.b, devattrs.query(lib_, tracer.gpumap.gpus))
        phases.mark("tracing")
        log.info("%s", phases.line())
        mode = "driver"
        if demo_wanted(demo, bool(nvml.ok or system_drivers()), pid, lib, container):
            the_demo = Demo()
            tracer.finder.extra += (str(the_demo.lib),)
            tracer.rescan(force=True)   # before the workers start: their contexts are seen too
            the_demo.start()
            mode = "demo"
            overhead = DEMO_CTX_OVERHEAD if overhead is None else overhead   # no NVML to measure it
        acct = Accountant(nvml=nvml, ctx_overhead=overhead, engines=engines)
        if history and mode == "driver" and not pid:   # a run ends when its container has no process left
            recorder = Recorder(HistoryFile(state_dir, "convgpu trace"), by="trace", absent_ends=True)
        _loop(tracer, acct, mode, set(pid), container, interval, duration, as_json, events, the_demo, recorder)
    except KeyboardInterrupt:
        pass
    finally:   # runs to its end: a signal now (or a second one) only leaves the flag
        common.hold_signals()
        if recorder is not None:   # runs still going are kept as cut short
            recorder.close()
        if the_demo:   # first: its containers outlive us if anything below fails
            the_demo.stop()
        tracer.close(background=True)   # detaching takes seconds: not between Ctrl-C and the prompt
        engines.close()
        nvml.close()


def demo_wanted(demo: DemoMode, driver: bool, pids, libs, container) -> bool:
    """auto: the demo only where there is no driver and nothing was asked for by name (a
    --pid, --lib or --container names what to watch, and it is not the demo)."""
    if demo is DemoMode.auto:
        return not driver and not pids and not libs and container is None
    return demo is DemoMode.always


def _enforcer_answers(run_dir: str) -> bool:
    try:
        common.control(run_dir, {"cmd": "ping"})
        return True
    except Exception:
        return False


RECONNECT_EVERY = 1.0   # s between two tries to reach an enforcer that went away


class Remote:
    """The running enforcer's probes and accounting, asked over its socket. It may stop (a
    `systemctl restart`): then snap() returns None, `gone` says since when and why, and the
    next snap() tries again (issue 52: trace ended with "no enforcer answers ... start one")."""

    def __init__(self, run_dir, pids, container, as_json, events):
        self.run_dir, self.pids, self.as_json, self.events = run_dir, pids, as_json, events
        self.msg = {"cmd": "snapshot", "pids": sorted(pids) or None, "container": container}
        self.seen = 0
        self.last = None                  # the last snapshot it sent
        self.gone: tuple[float, str] | None = None   # (since, why) while it does not answer
        self.pid = None

    def snap(self):
        from ..probes.events import Event
        try:
            r = common.control(self.run_dir, self.msg)
        except ConvgpuError as e:
            if self.gone is None:
                self.gone = (time.monotonic(), e.problem)
                self._say({"type": "enforcer", "state": "gone", "error": e.problem, "ts": time.time()})
            return None
        evs = [Event(**{k: e[k] for k in Event._fields}) for e in r["events"]]
        pid = r["snapshot"].get("enforce", {}).get("pid")
        if self.gone is not None or (self.pid is not None and pid != self.pid):
            self.gone = None
            self._say({"type": "enforcer", "state": "back", "pid": pid, "ts": time.time()})
        self.pid = pid
        if self.as_json and self.events:
            for e in r["events"]:
                if e["ts_ns"] > self.seen and (not self.pids or e["pid"] in self.pids):
                    sys.stdout.write(json.dumps(e) + "\n")
            self.seen = max([self.seen] + [e["ts_ns"] for e in r["events"]])
        self.last = Snapshot.from_json(r["snapshot"], evs)
        return self.last

    def _say(self, obj: dict):
        if self.as_json:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    def alert(self) -> str | None:
        if self.gone is None:
            return None
        since, why = self.gone
        return (f"enforcer gone {format_duration(time.monotonic() - since)} ago ({why}): reconnecting; "
                "the view below is its last")


def _remote(run_dir, pids, container, interval, duration, as_json, events):
    remote = Remote(run_dir, pids, container, as_json, events)
    end = time.monotonic() + duration if duration else None
    if as_json:
        while True:
            s = remote.snap()
            if s is not None:
                sys.stdout.write(json.dumps(s.to_json()) + "\n")
                sys.stdout.flush()
            if end is not None and time.monotonic() >= end:
                return
            time.sleep(interval if s is not None else min(interval, RECONNECT_EVERY))
    empty = Snapshot(time.time(), "driver", (), ())
    with Keys() as keys, View() as view:
        while end is None or time.monotonic() < end:
            s = remote.snap()
            view.update(s or remote.last or empty, remote.alert())
            if keys.quit(interval if s is not None else min(interval, RECONNECT_EVERY)):
                return


def _loop(tracer, acct, mode, pids, container, interval, duration, as_json, events, the_demo, recorder=None):
    notes = []
    if the_demo:
        notes.append(f"demo: {sum(n for _, n in GROUPS)} workers in {the_demo.kind} on the stand-in driver {the_demo.lib}")
    for lib_, err in tracer.failed:
        notes.append(f"not probed: {lib_}: {err}")
    for lp in tracer.attached:
        bad = [a.probe.symbol for a in lp.probes if a.ok and a.fired is False]
        if bad:
            notes.append(f"probes that never fired in {lp.library}: {', '.join(bad)}")
    end = time.monotonic() + duration if duration else None
    out = sys.stdout

    def snap():
        m = mode if any(x.kind == CUDA for x in tracer.libraries) else "waiting"
        s = acct.snapshot(tracer.usage(), mode=m, libraries=[str(x) for x in tracer.libraries],
                          drops=tracer.stats()["drops"], pids=pids or None, container=container, notes=notes)
        if recorder is not None:
            recorder.sample(from_snapshot(s))
        return s

    def step():
        evs = tracer.poll()
        common.check_stop()
        acct.feed(evs)
        if as_json and events:
            for e in evs:
                if (not pids or e.pid in pids) and (container is None or matches(acct.container(e.pid), container)):
                    out.write(json.dumps(e.to_json(tracer.gpumap.uuid(e.dev))) + "\n")

    tick = min(interval, 0.1)
    if as_json:
        next_snap = time.monotonic()
        while end is None or time.monotonic() < end:
            step()
            if time.monotonic() >= next_snap:
                out.write(json.dumps(snap().to_json()) + "\n")
                out.flush()
                next_snap += interval
            tracer.wait(tick)   # a process stopped at a driver's open wakes us
        step()
        out.write(json.dumps(snap().to_json()) + "\n")
        out.flush()
        return
    with Keys() as keys, View() as view:
        next_snap = time.monotonic()
        while end is None or time.monotonic() < end:
            step()
            if time.monotonic() >= next_snap:
                view.update(snap())
                next_snap += interval
            tracer.wait(tick)   # a process stopped at a driver's open wakes us
            if keys.quit():
                return
