"""Issue 23: the guarantee for containers shaped like real ones (several GPU processes, several
allocating threads), on the stand-in driver with real uprobes and real cgroups. Each stopped
call waits on its own; an exited process's memory counts against its container until the
driver frees it; a stopped thread does not stop its siblings; circular waits are said.

The stand-in charges every context CTX (as the H100 does ~543 MiB for CuPy) and the enforcer
is told the same (--ctx-overhead). Its shared segment is private to each test, so its exact
peak (standin-usage: the highest sum right after any charge) is the container's."""
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from conftest import Enforcing, GiB, MiB, popen_in

pytestmark = pytest.mark.system
CTX = 544 * MiB


@pytest.fixture
def env(caller_env):
    e = dict(caller_env, CONVGPU_STANDIN_CAPACITY=str(20 * GiB), CONVGPU_STANDIN_CTX_OVERHEAD=str(CTX),
             CONVGPU_STANDIN_SHM=f"/convgpu-waits-{os.getpid()}-{time.monotonic_ns()}")
    yield e
    subprocess.run([e["LD_LIBRARY_PATH"] + "/standin-usage", "--unlink"], env=e, capture_output=True)


def enforcer(build, *args):
    return Enforcing(build, "--gpu-memory", "20GiB", "--ctx-overhead", f"{CTX}B", *args)


def turns(build, cg, env, *args):
    return popen_in(cg, build / "turns", *args, env=env)


def usage(env) -> dict:
    return json.loads(subprocess.run([env["LD_LIBRARY_PATH"] + "/standin-usage", "--json"], env=env,
                                     capture_output=True, text=True, check=True).stdout)


class Sampler:
    """The container's device memory every 50 ms (the issue's NVML sampling), from the
    stand-in's slots: a process's slot stays until its files close (the driver's teardown)."""

    def __init__(self, env):
        self.env, self.most, self.samples = env, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.05):
            self.most = max(self.most, sum(p["used"][0] for p in usage(self.env)["procs"]))
            self.samples += 1

    def stop(self):
        self._stop.set()
        self._t.join()
        return self.most


def finish(procs, timeout, enf=None) -> list[str]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            if enf is not None:
                print(enf.ctl(cmd="status")["status"]["containers"])
                enf.stop()
                print(*enf.log, sep="\n")
            raise
        assert p.returncode == 0, (p.returncode, o, e)
        out.append(o.strip())
    return out


def check_peak(env, sampler, limit, enf, exact=True):
    """The issue's test: sampled every 50 ms, never over by more than 2 MiB; and (exact) the
    stand-in's own peak too (a free is settled at its return, so a sibling is never resumed
    into memory the driver still holds)."""
    sampled, peak = sampler.stop(), usage(env)["devices"][0]["peak"]
    print(f"\nper-container peak {peak / MiB:.0f} MiB (sampled every 50 ms: {sampled / MiB:.0f} MiB, "
          f"{sampler.samples} samples) against {limit / MiB:.0f} MiB")
    assert sampled <= limit + 2 * MiB and (peak <= limit + 2 * MiB or not exact), (peak, enf.log)


def test_four_workers_at_once_each_waits_for_itself(cgroups, build, env):
    """Part 1: four processes, each a context and 256 MiB held 4 s, under 2 GiB: two run at
    once. Before: the books added every waiter's request into one demand, called the container
    over its limit, and the others stayed stopped for good. Now each process waits for itself.
    And not circularly: the two running hold for longer than CIRCULAR_S without a free, but
    they run, so they will free (the H100 run of 2026-11-25f called it circular after 3 s;
    with --over-limit kill that would have killed a waiter)."""
    enf = enforcer(build, "--limit", "par=2GiB")
    cg, procs = cgroups("par"), []
    try:
        sampler = Sampler(env)
        started = time.monotonic()
        procs = [turns(build, cg, env, "-t", 1, "-r", 1, "-s", "256M", "-h", 4000, "-w", 300) for _ in range(4)]
        done = finish(procs, 60, enf)
        took = time.monotonic() - started
        print(f"4 workers finished in {took:.2f} s")

        assert done == [f"done 1 {256 * MiB} pid={p.pid}" for p in procs]
        check_peak(env, sampler, 2 * GiB, enf)
        assert enf.stop() == 0
        assert not [line for line in enf.log if "above its limit" in line or "circular" in line], enf.log
    finally:
        for p in procs:
            p.kill()
        enf.close()


def test_a_call_stopped_again_at_its_recheck_never_holds_its_thread_later(cgroups, build, env):
    """A process's context call waits (a sibling holds the room) and gets a SIGCONT that is
    no grant: its recheck stops it again. Granted later, its call runs on from that stop (the
    recheck probe does not fire twice), then two of its threads allocate and one is stopped:
    the ptrace holder seizes the process. Before: BPF still listed the thread that made the
    context in `held`, the holder took it for a thread stopped at a call, nobody released it,
    and the process never finished (the four-worker test's hang, 1 run in 4)."""
    limit = CTX + 256 * MiB + 128 * MiB   # one context and 256 MiB, not two; one 256 MiB at a time beside it
    enf = enforcer(build, "--limit", f"rst={limit}B")
    cg, procs = cgroups("rst"), []
    try:
        first = turns(build, cg, env, "-t", 1, "-r", 1, "-s", "256M", "-h", 2500)
        procs.append(first)
        deadline = time.monotonic() + 20
        while sum(p["used"][0] for p in usage(env)["procs"]) < CTX + 256 * MiB:
            assert time.monotonic() < deadline and first.poll() is None, enf.log
            time.sleep(0.02)
        second = turns(build, cg, env, "-t", 2, "-r", 1, "-s", "256M", "-h", 300, "-w", 100)
        procs.append(second)
        enf.wait_for(f"stall rst pid {second.pid} on GPU0: placed with")
        os.kill(second.pid, signal.SIGCONT)   # no grant: the recheck stops it again
        enf.wait_for(f"pid {second.pid} of rst resumed without a grant")

        assert finish(procs, 30, enf) == [f"done 1 {256 * MiB} pid={first.pid}", f"done 2 {512 * MiB} pid={second.pid}"]
        assert enf.stop() == 0
        assert not any("stopped before they were placed" in line for line in enf.log), enf.log
    finally:
        for p in procs:
            p.kill()
        enf.close()


def test_an_exited_workers_memory_counts_until_the_driver_frees_it(cgroups, build, env):
    """Part 2: the same under 2560 MiB (three fit), each process's teardown slowed as the real
    driver's (1 GiB of host memory for exit_mm): the fourth starts only once the first's
    memory is gone, never beside it. Before: it was resumed at the exit event, and the
    container's memory passed its limit by a context during the teardown."""
    env = dict(env, CONVGPU_STANDIN_EXIT_MB="1024", CONVGPU_STANDIN_EXIT_FDS="30000")
    enf = enforcer(build, "--limit", "tear=2560MiB")
    cg, procs = cgroups("tear"), []
    try:
        sampler = Sampler(env)
        procs = [turns(build, cg, env, "-t", 1, "-r", 1, "-s", "256M", "-h", 700, "-w", 300) for _ in range(4)]
        assert len(finish(procs, 60)) == 4
        check_peak(env, sampler, 2560 * MiB, enf)
        assert enf.stop() == 0
    finally:
        for p in procs:
            p.kill()
        enf.close()


def test_a_server_and_its_workers(cgroups, build, env):
    """A server holds a context and 512 MiB for the whole run; six workers (a context and
    2 x 256 MiB each) come and go beside it, two at a time fit. Started together, a third
    worker's context would fit but leave none of the three room for its second 256 MiB: it
    waits for the two before it to allocate (Decider._settling). Before: three got a context
    and the container waited on itself for good, said as a circular wait."""
    env = dict(env, CONVGPU_STANDIN_EXIT_MB="128")
    limit = CTX + 512 * MiB + 2 * (CTX + 512 * MiB)
    enf = enforcer(build, "--limit", f"srv={limit}B")
    cg, procs = cgroups("srv"), []
    try:
        sampler = Sampler(env)
        server = popen_in(cg, build / "cgcaller", "alloc", "-n", 1, "-s", 512 * MiB, "--hold", env=env)
        enf.wait_for("container srv GPU0: assigned")
        # -w 300: each makes its context, then starts up for 0.3 s (a framework's start-up), so
        # every context is asked for before any worker allocates
        procs = [turns(build, cg, env, "-t", 1, "-r", 1, "-n", 2, "-s", "256M", "-h", 300, "-w", 300)
                 for _ in range(6)]
        assert len(finish(procs, 90, enf)) == 6
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.wait(timeout=30) == 0
        check_peak(env, sampler, limit, enf)
        assert enf.stop() == 0
        log = "\n".join(enf.log)
        assert "first context waits for pid" in log and "circular" not in log
    finally:
        for p in procs:
            p.kill()
        enf.close()


def test_twelve_short_lived_processes_in_a_row(cgroups, build, env):
    """One after another, each a context and 256 MiB, in a container that fits one: all 12 run."""
    env = dict(env, CONVGPU_STANDIN_EXIT_MB="64")
    limit = CTX + 256 * MiB
    enf = enforcer(build, "--limit", f"loop={limit}B")
    cg = cgroups("loop")
    p = popen_in(cg, "/bin/sh", "-c", f'for i in 1 2 3 4 5 6 7 8 9 10 11 12; do "{build}/turns" -t 1 -r 1 '
                 f'-s 256M -h 20 || exit 1; done', env=env)
    try:
        sampler = Sampler(env)
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0 and out.count(f"done 1 {256 * MiB}") == 12, (out, err)
        check_peak(env, sampler, limit, enf)
        assert enf.stop() == 0
    finally:
        p.kill()
        enf.close()


def test_a_stopped_thread_does_not_stop_its_siblings(cgroups, build, env):
    """Part 3: one process, 8 threads, each 3 times: 256 MiB for 0.5 s; the limit fits the
    context and four. A thread stopped at its allocation is held alone (ptrace), so the
    four holding memory free it, and the threads take turns. Before: the stop held the whole
    process, the frees never came, and it was called over its limit for good. Each free takes
    20 ms in the stand-in (CONVGPU_STANDIN_FREE_MS; a 256 MiB cuMemFree takes milliseconds on
    the H100), the memory counted until it returns: settled at the free's entry, the threads
    resumed into that room had all eight blocks live at once (2,592 MiB exact against 1,638)."""
    env = dict(env, CONVGPU_STANDIN_FREE_MS="20")
    limit = 1638 * MiB
    enf = enforcer(build, "--limit", f"thr={limit}B")
    cg = cgroups("thr")
    sampler = Sampler(env)
    p = turns(build, cg, env, "-t", 8, "-r", 3, "-s", "256M", "-h", 500)
    try:
        enf.wait_for("stall thr")
        started = time.monotonic()
        holds = enf.ctl(cmd="status")["status"].get("holds")
        out, err = p.communicate(timeout=60)
        print(f"8 threads x 3 turns finished {time.monotonic() - started:.2f} s after the first stall")
        assert p.returncode == 0 and out.strip() == f"done 24 {24 * 256 * MiB} pid={p.pid}", (out, err)
        assert holds["threads"] == "ptrace" and holds["whole_process"] == {}, holds
        check_peak(env, sampler, limit, enf)
        assert enf.stop() == 0
        # its siblings ran and freed all along: nothing was reclaimed, no deadlock was said
        assert not [line for line in enf.log if any(w in line for w in ("reclaim", "deadlocked", "above its limit",
                                                                          "circular"))], enf.log
    finally:
        p.kill()
        enf.close()


@pytest.mark.parametrize("over_limit", ["stall", "kill"])
def test_a_circular_wait_is_said_and_over_limit_applies(cgroups, build, env, over_limit):
    """Part 3: two threads each hold 512 MiB and each asks for 512 MiB more, in a limit that
    fits only one more: neither can go on until the other frees, and neither will. It is said
    (log, `status`), and --over-limit applies: stall keeps them (until an operator acts),
    kill ends the process."""
    env = dict(env, CONVGPU_STANDIN_CTX_OVERHEAD="0")
    enf = Enforcing(build, "--gpu-memory", "20GiB", "--limit", "circ=1280MiB", "--over-limit", over_limit)
    cg = cgroups("circ")
    p = turns(build, cg, env, "-t", 2, "-r", 1, "-n", 2, "-b", "-s", "512M", "-h", 100)
    try:
        line = enf.wait_for("container circ GPU0: circular wait", timeout=30)
        assert "2 stopped calls" in line and "each need at least 512.0 MiB more" in line, line
        assert ("killing pid" in line) == (over_limit == "kill"), line
        if over_limit == "kill":
            assert p.wait(timeout=10) == -9
        else:
            gpu = enf.ctl(cmd="status")["status"]["containers"][0]["gpus"]["0"]
            assert gpu["circular"] and [w["size"] for w in gpu["waits"]] == [512 * MiB] * 2, gpu
            assert {w["held"] for w in gpu["waits"]} == {"thread"}, gpu
            assert p.poll() is None
        assert not any("above its limit" in line for line in enf.log), enf.log
        assert enf.stop() == 0
        if over_limit == "stall":   # a clean stop lets both run: then the stand-in refuses nothing
            assert p.wait(timeout=20) == 0
    finally:
        p.kill()
        enf.close()
