"""A restart is not a release (issue 47): a SIGTERM with --handover leaves every stopped call
stopped, admission on, for the next enforcer on the run dir to take over; a waiter resumes only
once the successor grants it. Without a successor in time, the watchdog resumes everything as at
any death. Ctrl-C (SIGINT) and a SIGTERM without --handover still release at once (test_enforce).
Real uprobes on the stand-in, the CLI as subprocesses."""
import os
import signal
import time

import pytest

from conftest import Enforcing, proc_state, read_until, run_dir_for, start_in, stop_all, until, wait_state

pytestmark = pytest.mark.system


def stays(pid: int, state: str, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc_state(pid) == state, f"pid {pid}: {proc_state(pid)}"
        time.sleep(0.01)


def waits(enf, name: str) -> list[dict]:
    st = enf.ctl(cmd="status")["status"]
    return [w for c in st["containers"] if c["name"] == name for w in c["gpus"]["0"]["waits"]]


def args(*more):
    return ("--gpu-memory", "2GiB", "--limit", "holder=2GiB", "--limit", "waiter=2GiB", "--handover", *more)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_stalled_process_stays_stalled_across_a_restart_with_handover(cgroups, build, env5, threads):
    run_dir = run_dir_for("handover")
    first = Enforcing(build, *args("30"), run_dir=run_dir)
    second = holder = waiter = None
    try:
        holder = start_in(cgroups("holder"), build, env5, "alloc", "-s", "1536M", "--hold")
        read_until(holder, "ready")
        # two threads of 512 MiB each: one waits held alone by ptrace while the other runs on
        waiter = start_in(cgroups("waiter"), build, env5, "alloc", "-t", threads, "-s", "512M", "--hold")
        first.wait_for(f"stall waiter pid {waiter.pid}")
        # every thread's call held before the restart (the second's stall comes after the first's)
        until(lambda: len(waits(first, "waiter")) == threads, 20, f"not {threads} waits: {waits(first, 'waiter')}")
        wait_state(waiter.pid, "T")
        first.p.send_signal(signal.SIGTERM)   # systemctl restart: stop, then start again
        assert first.p.wait(timeout=30) == 0
        first.wait_for("handing over: 1 processes stay stopped")
        stays(waiter.pid, "T", 3.0)           # no enforcer now, and still held
        second = Enforcing(build, *args("30"), run_dir=run_dir)
        assert any(f"took over {threads} calls held by the enforcer before" in x for x in second.log), second.log
        stays(waiter.pid, "T", 1.0)           # still no room: the successor holds it
        holder.stdin.write("\n")
        holder.stdin.flush()
        read_until(holder, "exit")
        second.wait_for("resume waiter")
        lines = read_until(waiter, "ready")
        # held whole for that wait only: its later waits hold their thread again (held whole for
        # good, every process of a container that waited froze it: the H100's torture, issue 47)
        until(lambda: str(waiter.pid) not in second.ctl(cmd="status")["status"]["holds"]["whole_process"], 5,
              "still held whole after its taken-over wait")
        assert f"allocated {threads} {threads * 512 << 20} pid={waiter.pid}" in lines
        st = second.ctl(cmd="status")["status"]
        assert {c["name"]: c["gpus"]["0"]["used"] for c in st["containers"]} == {"waiter": threads * 512 << 20}
    finally:
        stop_all([holder, waiter], second, first)


def test_with_no_successor_in_time_the_watchdog_resumes_the_held(cgroups, build, env5):
    first = Enforcing(build, *args("5"), run_dir=run_dir_for("handover"))
    holder = waiter = None
    try:
        holder = start_in(cgroups("holder"), build, env5, "alloc", "-s", "1536M", "--hold")
        read_until(holder, "ready")
        waiter = start_in(cgroups("waiter"), build, env5, "alloc", "-s", "1G", "--hold")
        first.wait_for(f"stall waiter pid {waiter.pid}")
        first.p.send_signal(signal.SIGTERM)
        assert first.p.wait(timeout=30) == 0
        t0 = time.monotonic()
        stays(waiter.pid, "T", 2.5)
        while proc_state(waiter.pid) == "T":   # fail-safe: never left stopped with nobody to resume it
            assert time.monotonic() - t0 < 10, "still stopped 10 s after a 5 s handover"
            time.sleep(0.02)
        # its line names the enforcer that died (it named the last pid it had stopped whole)
        assert "resumed" in first.wait_for(f"convgpu watchdog: enforcer {first.p.pid} is gone", 10)
    finally:
        stop_all([holder, waiter], first)
        os.system(f"pkill -f 'watchdog.py {first.p.pid} ' 2>/dev/null")
