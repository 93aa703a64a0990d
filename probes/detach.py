"""Detaching perf-event probes without making a command wait for it. (Where the kernel takes
uprobe links, Linux >= 6.6, the uprobes are links and go at once: probes/links.py. What is
handed off here is then the few tracepoints, and every probe on older kernels.)

Each uprobe's perf event, when its last descriptor closes, unregisters the probe under the
kernel's event_mutex and waits for RCU grace periods there: 0.1 s per probe on an idle
2-vCPU VM, 0.5 s under load (measured here, kernel 6.18), and one at a time, however many
threads close them (56 closed from 56 threads took 5.4 s against 6.2 s from one). A tracer has
~56 of them per driver copy (entry and return probes) plus the tracepoints, so `convgpu trace`
spent 6-30 s between Ctrl-C and its exit, growing with every library it probed and with the
host's load: past 20 s on the two-GPU host. Closing them at exit instead changes nothing
(the kernel closes them in the same order before the process is reaped).

hand_off() gives the descriptors to a short-lived child in its own session that closes them
one by one; ours are then closed at once (the child's copies keep each event alive), and the
command ends. Until the child is done the probes still fire into a ring buffer nobody reads:
they account nothing and stop nothing (discovery is off by then)."""
import logging
import os
import subprocess
import sys
import time

log = logging.getLogger(__name__)
CLOSER = ("import os, signal, sys\n"
          "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
          "    signal.signal(s, signal.SIG_IGN)\n"
          "for fd in sys.argv[2:]:\n"
          "    os.close(int(fd))\n")
NAME = "convgpu-detach"   # argv[1] of the child: `pgrep -f convgpu-detach` finds it


def hand_off(b) -> subprocess.Popen | None:
    """Move the perf events of bcc BPF object b's uprobes and tracepoints to a closer child,
    and forget them in b (its cleanup() then frees the rest at once). None when there were
    none, or the child could not start (then b.cleanup() detaches them here, slowly)."""
    tables = [t for t in (b.uprobe_fds, b.tracepoint_fds) if t]
    fds = [fd for t in tables for fd in t.values()]
    if not fds:
        return None
    try:
        child = subprocess.Popen([sys.executable, "-c", CLOSER, NAME, *map(str, fds)], pass_fds=fds,
                                 start_new_session=True, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        log.debug("detaching in the background failed (%s): detaching here", e)
        return None
    for fd in fds:
        os.close(fd)
    # bcc counts the uprobes a process holds against a quota (1000, BCC_PROBE_LIMIT) in a module
    # global that only its own detach lowers: without this, a process that closes tracers in
    # the background (the test suite's in-process enforcers) is soon refused every attach
    import bcc
    bcc._num_open_probes -= len(b.uprobe_fds)
    for t in tables:
        t.clear()
    log.debug("%d probes handed to pid %d to detach", len(fds), child.pid)
    return child


def running() -> set[int]:
    """Pids of the closer children on this host (any tracer's or enforcer's, any version)."""
    out = set()
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if f"\0{NAME}\0".encode() in f.read():
                    out.add(int(d))
        except OSError:
            pass
    return out


def wait_all(timeout: float = 300.0) -> bool:
    """Until no closer child runs (every perf-event probe handed off is gone); False on timeout.
    For benchmarks, whose next mode must find no probe of the last one: a bare call that hits
    it is not bare, and a link cannot share an entry point with a perf event (probes/links.py)."""
    end = time.monotonic() + timeout
    while running():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True
