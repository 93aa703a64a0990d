"""An exit whose event the enforcer never acted on (read by an enforcer killed before it acted:
the kill -9 torture's last enforcer kept such a process in its container for good, its context
counted and its container's assignment held, while two containers waited beside it 120 s).
Now the loop's sweep (enforcer/exits.py Exits.sweep) takes a placed pid that is no process any
more out of its container, and gives back the charge BPF moved to the container's tearing that
nobody took. Real enforcer on the stand-in driver; tenants as nobody in one cgroup."""
import pytest

from conftest import MiB, inprocess_enforcer, read_until, serving, until
from failclosed import allocs, logged, own_lib, python_as_nobody, quiet_logs  # noqa: F401 (fixture)

pytestmark = pytest.mark.system


def test_a_process_whose_exit_event_was_lost_leaves_its_container_and_its_bytes_come_back(
        root, own_lib, cgroups, env5, caplog, monkeypatch):
    from convgpu.enforcer import exits
    monkeypatch.setattr(exits, "LOST_S", 1.0)
    quiet_logs(caplog)
    enf = inprocess_enforcer(own_lib, "lost-exit", 1024 * MiB)
    heard = enf.exits.exiting
    lost = set()

    def exiting(pid, *a, **kw):   # the event of `lost`'s exit read, and never acted on
        if pid in lost:
            lost.discard(pid)
            return None
        return heard(pid, *a, **kw)
    enf.exits.exiting = exiting
    cg = cgroups("lostexit")
    procs = []
    with serving(enf):
        try:
            a = python_as_nobody(cg, own_lib, env5, allocs(2, 128 * MiB))
            b = python_as_nobody(cg, own_lib, env5, allocs(1, 128 * MiB))
            procs += [a, b]
            for p in (a, b):
                assert read_until(p, "done", timeout=30)[-1] == "done"

            def gpu0():
                [c] = [c for c in enf.status()["containers"] if b.pid in c["pids"]]
                return sorted(c["pids"]), c["gpus"]["0"]["used"], c["gpus"]["0"]["tearing_down"]
            until(lambda: gpu0() == (sorted([a.pid, b.pid]), 384 * MiB, 0), 10, "both placed")
            lost.add(a.pid)
            a.kill()
            assert a.wait(timeout=10) == -9
            # before: [a, b], 384 MiB (a's 256 MiB tearing down) for good
            until(lambda: gpu0() == ([b.pid], 128 * MiB, 0), 15, f"a's exit never settled: {gpu0()}")
            assert not lost, "the exit event never came"
            [line] = logged(caplog, f"pid {a.pid} is gone and its exit was never heard: it leaves its container now")
            [line] = logged(caplog, "exits' charges waited 1 s for their exit event: given back")
            assert line.startswith("1 exits'"), line
        finally:
            for p in procs:
                p.kill()
                p.wait()
