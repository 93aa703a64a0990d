"""A free in flight across a take-over is settled once (the kill -9 torture with --handover:
a container's books stayed one 128 MiB block above the driver's count for good).

A free's block leaves the books at its return (bpf/frees.bpf.c). With uprobe sessions that
return runs only in the link whose entry ran: a free entered under the enforcer before, in a
process stopped whole across the restart (its held call taken over, or a restart landing mid
free), returns after the successor took admission and the old probes detached; no program
settled it. Here the process is stopped inside its free (the stand-in returns 1 s after the
bytes are back: CONVGPU_STANDIN_FREE_RETURN_MS) as a handover stops a held one, the enforcer is
replaced, the old probes go, and it runs on: the books equal the driver's count exactly.
Real uprobes on the stand-in, the CLI as subprocesses."""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import Enforcing, read_until, run_dir_for, start_in, stop_all

pytestmark = pytest.mark.system
MiB = 1 << 20


def driver_count(build, env, pid: int) -> int:
    usage = json.loads(subprocess.run([str(build / "standin" / "standin-usage"), "--json"], env=env,
                                      capture_output=True, text=True, check=True).stdout)
    return sum(sum(p["used"]) for p in usage["procs"] if p["pid"] == pid)


def books(enf, name: str) -> int:
    st = enf.ctl(cmd="status")["status"]
    return next(c["gpus"]["0"]["used"] for c in st["containers"] if c["name"] == name)


def children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(x) for x in f.read().split()}


def gone(pid: int, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"pid {pid} still there after {timeout} s"
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["handover", "kill"])
def test_a_free_in_flight_across_a_take_over_leaves_the_books_once(cgroups, build, env5, how):
    run_dir = run_dir_for("takeover")
    args = ("--gpu-memory", "2GiB", "--limit", "freer=1GiB", *(("--handover", "30") if how == "handover" else ()))
    env = dict(env5, CONVGPU_STANDIN_FREE_RETURN_MS="1000")
    first = Enforcing(build, *args, run_dir=run_dir)
    second = p = None
    try:
        # two blocks freed one after the other by one thread: the first free spans the take-over
        p = start_in(cgroups("freer"), build, env, "alloc", "-n", "2", "-s", "128M", "--hold", "--hold-freed")
        assert f"allocated 2 {256 * MiB} pid={p.pid}" in read_until(p, "ready")
        assert books(first, "freer") == driver_count(build, env, p.pid) == 256 * MiB
        p.stdin.write("\n")
        p.stdin.flush()
        deadline = time.monotonic() + 10
        while driver_count(build, env, p.pid) != 128 * MiB:   # the driver has it back, the call runs on
            assert time.monotonic() < deadline, "the first free never gave its bytes back"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGSTOP)   # stopped whole inside its free, as a handover stops a held one
        assert books(first, "freer") == 256 * MiB   # charged until the free returns
        watchdogs = children(first.p.pid)
        if how == "handover":
            first.p.send_signal(signal.SIGTERM)
            assert first.p.wait(timeout=30) == 0
        else:
            first.p.kill()
            first.p.wait()
        second = Enforcing(build, *args, run_dir=run_dir)
        assert any("took over from enforcer" in x for x in second.log), second.log
        for w in watchdogs:   # the old probes detach once the successor took over
            gone(w)
        os.kill(p.pid, signal.SIGCONT)
        lines = read_until(p, "freed")
        assert f"freed 2 {256 * MiB}" in lines, lines
        assert driver_count(build, env, p.pid) == 0
        deadline = time.monotonic() + 5
        while books(second, "freer") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert books(second, "freer") == driver_count(build, env, p.pid) == 0
    finally:
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
        stop_all([p], second, first)
