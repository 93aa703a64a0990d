"""Swap (issue 46) end to end on the stand-in driver: real uprobes, real cgroups, holders as
nobody (build/holder, its device memory backed by host memory and filled with a pattern of its
pid: CONVGPU_STANDIN_BACKED=1), the stand-in's checkpoint (a driver thread in each process does
the work, as the real driver's does), NVML's per-process counts on (the stand-in NVML), and the
enforcer as a subprocess whose child (enforcer/swap/agent.py) makes the driver's calls."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import GiB, MiB, Enforcing, _lines, popen_in, proc_state, run_dir_for, stop_all, until
NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")   # as tests/security

pytestmark = pytest.mark.system


def envs(build, env5, capacity):
    """(the enforcer's env: the stand-in NVML with per-process lists; the holders' env: backed
    memory), both on a stand-in GPU of `capacity` bytes."""
    base = dict(env5, CONVGPU_STANDIN_CAPACITY=str(capacity))
    return (dict(base, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env5['LD_LIBRARY_PATH']}", CONVGPU_STANDIN_NVML_PROCS="1"),
            dict(base, CONVGPU_STANDIN_BACKED="1"))


def asker(cg, build, env, size: str):
    """cgcaller as nobody in cg: one allocation of size, held until its stdin ends; returns once
    it is allocated (within 20 s)."""
    p = popen_in(cg, *NOBODY, build / "cgcaller", "alloc", "-s", size, "--hold", env=env)
    line = _lines(p.stdout).get(timeout=20)
    assert line.startswith("allocated 1"), line
    return p


def plain(env: dict) -> dict:
    """A holder whose contents nobody checks: unbacked (the stand-in touches no host memory)."""
    return {k: v for k, v in env.items() if k != "CONVGPU_STANDIN_BACKED"}


class Holder:
    """build/holder -s SIZE as nobody in cgroup cg: its pid and pattern CRC from `ready`."""

    def __init__(self, cg, build, env, size: str, timeout: float = 120, fill: bool = True):
        """fill False (-z): ready once allocated (its contents are nobody's concern). Its pattern
        is written into real host memory (backed) and summed: 3 GiB took over 30 s on a loaded
        2-CPU CI machine."""
        self.p = popen_in(cg, *NOBODY, build / "holder", "-s", size, *(() if fill else ("-z",)), env=env)
        line = self.answer(timeout)
        assert line and line.startswith("ready"), (line, self.p.stderr.read() if self.p.poll() is not None else "")
        f = dict(kv.split("=") for kv in line.split()[1:])
        self.pid, self.crc = int(f["pid"]), f["crc"]

    def answer(self, timeout: float) -> str | None:
        try:
            line = _lines(self.p.stdout).get(timeout=timeout)
        except Exception:   # queue.Empty: no answer (a call that blocks)
            return None
        return line.rstrip() if line else None

    def send(self, line: str):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def leave(self):
        self.p.stdin.close()
        self.p.wait(timeout=30)


def row(enf, name: str) -> dict:
    return next((c["gpus"]["0"] for c in enf.ctl(cmd="status")["status"]["containers"] if c["name"] == name), {})


def args(*more):
    """A 4 GiB GPU; A's limit what it holds, B's what it asks: every grant stays safe (the banker's
    check: docs/SCHEDULING.md), so B's wait is the full GPU's alone, which the swap ends."""
    return ("--gpu-memory", "4GiB", "--limit", "a=3GiB", "--limit", "b=2GiB", "--swap-idle", "1", *more)


def test_an_idle_holder_goes_out_for_a_waiter_and_comes_back_at_its_next_call(cgroups, build, env5):
    """The issue's first case: A holds 3 GiB and idles, B asks 2 GiB on a 4 GiB GPU: B runs
    within 10 s while A is out; after B exits, A's next call returns within 10 s, bytes intact."""
    e, caller = envs(build, env5, 4 * GiB)
    enf = Enforcing(build, *args(), env=e, start_timeout=120)
    a = b = None
    try:
        a = Holder(cgroups("a"), build, caller, "3G")
        t0 = time.monotonic()
        b = asker(cgroups("b"), build, plain(caller), "2G")
        took = time.monotonic() - t0
        assert took < 10, took
        g = row(enf, "a")
        assert (g["swapped"], [s["state"] for s in g["swaps"]]) == (3 * GiB, ["out"]), g
        enf.wait_for(f"swap out a pid {a.pid} (idle")
        usage = subprocess.run([f"{build}/standin/standin-usage"], env=caller, capture_output=True, text=True).stdout
        assert f"proc pid={a.pid} " not in usage and f"proc pid={b.pid} used={2 * GiB}" in usage, usage
        b.stdin.close()
        assert b.wait(timeout=30) == 0
        t1 = time.monotonic()
        a.send("launch")                           # its next call: blocked in the driver until restored
        assert a.answer(10) == "launched"
        assert time.monotonic() - t1 < 10
        a.send("check")                            # every byte as it was
        assert a.answer(60) == f"intact crc={a.crc}"
        until(lambda: row(enf, "a").get("swapped") == 0, 5, "shown back")
        enf.wait_for(f"swap in a pid {a.pid}: back on the GPU")
    finally:
        stop_all([a and a.p, b], enf)


def test_by_hand_out_and_in(cgroups, build, env5):
    e, caller = envs(build, env5, 2 * GiB)
    enf = Enforcing(build, "--gpu-memory", "2GiB", "--limit", "a=2GiB", env=e, start_timeout=120)
    a = None
    try:
        a = Holder(cgroups("a"), build, caller, "512M")
        r = enf.cli("swap", "out", "a")
        assert f"pid {a.pid}: out, 512.0 MiB in host memory" in r.stdout, r.stdout
        g = row(enf, "a")
        assert (g["swapped"], g["used"]) == (512 * MiB, 512 * MiB), g   # used: the probes' count, kept
        r = enf.cli("swap", "in", "a")
        assert f"pid {a.pid}: back on the GPU" in r.stdout, r.stdout
        assert row(enf, "a")["swapped"] == 0
        a.send("check")
        assert a.answer(10) == f"intact crc={a.crc}"
        bad = enf.cli("swap", "in", "a", check=False)
        assert bad.returncode == 1 and "nothing of 'a' is swapped out" in bad.stderr, bad.stderr
        bad = enf.cli("swap", "out", "nosuch", check=False)
        assert bad.returncode == 1 and "no container or CUDA process 'nosuch'" in bad.stderr, bad.stderr
    finally:
        stop_all([a and a.p], enf)


def test_a_kill_9_while_out_leaves_it_to_the_successor(cgroups, build, env5):
    e, caller = envs(build, env5, 4 * GiB)
    run_dir, state_dir = run_dir_for("swap-run"), run_dir_for("swap-state")
    enf = Enforcing(build, *args(), env=e, start_timeout=120, run_dir=run_dir, state_dir=state_dir)
    nxt = a = b = None
    try:
        a = Holder(cgroups("a"), build, caller, "3G")
        b = asker(cgroups("b"), build, plain(caller), "2G")
        assert row(enf, "a")["swapped"] == 3 * GiB
        enf.p.kill()
        enf.p.wait()
        kept = json.load(open(os.path.join(state_dir, "swap.json")))["procs"]
        assert [(r["pid"], r["state"]) for r in kept.values()] == [(a.pid, "out")]
        nxt = Enforcing(build, *args(), env=e, start_timeout=120, run_dir=run_dir, state_dir=state_dir)
        until(lambda: row(nxt, "a").get("swapped") == 3 * GiB, 10, "still out, the successor's")
        b.stdin.close()
        assert b.wait(timeout=30) == 0
        a.send("launch")
        assert a.answer(10) == "launched"
        a.send("check")
        assert a.answer(60) == f"intact crc={a.crc}"
    finally:
        stop_all([a and a.p, b], nxt, enf)


def test_a_deadlock_of_two_containers_is_broken_by_a_swap_not_a_kill(cgroups, build, env5):
    """Each holds 1 GiB of a 2 GiB GPU, then (their limits raised at run time: a state the
    banker's check never makes) each asks 512 MiB more: both wait, none can run. One side goes
    out, the other runs; once that one is done, the first comes back and runs, bytes intact."""
    e, caller = envs(build, env5, 2 * GiB)
    # --swap-idle 60: the deadlock alone swaps here (no holder is idle that long in the test)
    enf = Enforcing(build, "--gpu-memory", "2GiB", "--limit", "a=1GiB", "--limit", "b=1GiB", "--swap-idle", "60",
                    env=e, start_timeout=120)
    a = b = None
    try:
        a = Holder(cgroups("a"), build, caller, "1G")
        b = Holder(cgroups("b"), build, caller, "1G")
        enf.cli("limit", "set", "a", "1536MiB")
        enf.cli("limit", "set", "b", "1536MiB")
        a.send("alloc 512M")
        b.send("alloc 512M")
        got = {}
        deadline = time.monotonic() + 30
        while len(got) < 1 and time.monotonic() < deadline:
            for h, name in ((a, "a"), (b, "b")):
                line = h.answer(0.1)
                if line:
                    got[name] = line
        assert list(got.values()) == ["allocated 536870912"], got     # one side ran
        first = next(iter(got))
        other, o = ("b", b) if first == "a" else ("a", a)
        assert row(enf, other)["swapped"] == GiB
        enf.wait_for(f"swap out {other} pid {o.pid} (GPU0 deadlocked")
        (a if first == "a" else b).leave()
        assert o.answer(15) == "allocated 536870912"                  # back, and its call ran
        o.send("check")
        assert o.answer(10) == f"intact crc={o.crc}"
        assert o.p.poll() is None and not any("killing" in x for x in enf.log)
    finally:
        stop_all([a and a.p, b and b.p], enf)
