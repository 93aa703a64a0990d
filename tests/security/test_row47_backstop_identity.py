"""Issue 47, findings 1, 2 and 5 (SECURITY.md rows 47.1, 47.2, 47.5), and the watchdog that
resumes what the backstop stopped. The backstop acts only on what it can prove.

A tenant (as `nobody`, in its own cgroup) allocates, passes every descriptor it has (the stand-in
driver's files among them) to a child that made no CUDA call, and leaves: the stand-in NVML goes
on listing the memory under the dead pid, as a driver whose files another process keeps does.
- Finding 1: that pid, reused by a `sleep` of another container or of the host, was taken for the
  memory's holder, placed, charged the tenant's bytes and stopped or killed. Now a pid's process
  must show that it holds the memory (the GPU's node open, started before the memory was
  listed); memory a gone member left stays its container's.
- Finding 2: that memory was counted nowhere (a tenant held 1,200 MiB under 256 MiB). Now it
  is its container's for as long as NVML lists it: the container's next call waits for it, and
  a container over its limit by it is stopped (or its processes holding the GPU's files killed).
  Memory NVML names no process for shows in the GPU's total alone: unattributed, counted.
- Finding 5: a process NVML lists as graphics was never placed. Now it is, in a container; a
  host's display server is counted and never stopped.
The stand-in's device nodes are character devices of the cpuid major (attack.gpu_nodes)."""
import os
import shutil
import signal
import subprocess
import time

import pytest

from attack import CPUID, gpu_nodes, scratch  # noqa: F401  (fixtures)
from conftest import GiB, MiB, need, popen_in, proc_state, stop_all, until, wait_state
from shim_attack import NOBODY, enforcer, expect

pytestmark = pytest.mark.system


def envs(build, env5, nodes, **more):
    """(the enforcer's env: the stand-in NVML with per-process lists and the nodes' major; a
    caller's env: the stand-in opens the nodes at cuInit)."""
    enf = dict(env5, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env5['LD_LIBRARY_PATH']}",
               CONVGPU_STANDIN_NVML_PROCS="1", CONVGPU_GPU_MAJORS=str(CPUID), **more)
    return enf, dict(env5, CONVGPU_STANDIN_DEVNODES=str(nodes))


def status(enf) -> dict:
    return enf.ctl(cmd="status")["status"]


def left(enf) -> list:
    """(name, bytes, pids) of each container with no process placed that holds what its gone
    processes left on GPU 0."""
    return [(r["name"], r["bytes"], r["pids"]) for r in status(enf)["gpus"]["0"]["left_by_exited"]]


class Orphan:
    """cgcaller as nobody in cg: allocates `size`, hands its descriptors to a child that made
    no call (the holder), leaves. The holder keeps them until its stdin (this object's pipe)
    closes: keep the object for as long as the memory should live."""

    def __init__(self, cg, build, env, size: str):
        self.p = popen_in(cg, *NOBODY, build / "cgcaller", "alloc", "-s", size, "--orphan", env=env)
        expect(self.p, "allocated", timeout=20)
        self.holder = int(expect(self.p, "orphaned", timeout=20)[1].split("=")[1])
        assert self.p.wait(timeout=10) == 0
        self.gone = self.p.pid

    def close(self):
        kill(self.holder)
        self.p.stdin.close()


def spawn_at(pid: int, argv, cg=None) -> subprocess.Popen:
    """argv started as `pid` (ns_last_pid: the pid the kernel handed out last): a reused pid."""
    for _ in range(500):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = popen_in(cg, *argv) if cg else subprocess.Popen(list(argv))
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    need(False, f"pid {pid} could not be had again (other processes took it first)")


def never_stopped(p, seconds: float):
    """p runs throughout (looked at every 10 ms: the backstop samples every 0.25 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert p.poll() is None, f"pid {p.pid} died ({p.returncode})"
        assert proc_state(str(p.pid)) not in "Tt", f"pid {p.pid} was stopped"
        time.sleep(0.01)


def dead(pid: int) -> bool:
    """Killed: gone, or a zombie its new parent has not reaped yet."""
    try:
        return proc_state(str(pid)) in "ZX"
    except OSError:
        return True


def kill(pid: int):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("over_limit", ["stall", "kill"])
def test_row47_1_a_reused_pid_never_gets_another_tenant_or_the_host_stopped(cgroups, build, env5, gpu_nodes,
                                                                            over_limit):
    e, caller = envs(build, env5, gpu_nodes)
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "tenant=512MiB", "--limit", "victim=256MiB",
                   "--default-limit", "256MiB", "--over-limit", over_limit, env=e, start_timeout=120)
    victim = host = o = None
    try:
        o = Orphan(cgroups("tenant"), build, caller, "400M")
        gone = o.gone
        until(lambda: left(enf) == [("tenant", 400 * MiB, [gone])], 10, "the gone process's memory shown")
        # its pid, now a `sleep` of another tenant (limit 256 MiB: 400 MiB would put it over),
        # then one of the host: neither holds the GPU, neither is placed, stopped or killed
        victim = spawn_at(gone, [*NOBODY, "sleep", "60"], cgroups("victim"))
        never_stopped(victim, 2.0)
        victim.kill()
        victim.wait()
        host = spawn_at(gone, ["sleep", "60"])
        never_stopped(host, 2.0)
        assert left(enf) == [("tenant", 400 * MiB, [gone])]          # still the tenant's, all along
        assert [c["name"] for c in status(enf)["containers"]] == []   # nobody placed by it
        assert proc_state(str(o.holder)) not in "Tt"                  # 400 MiB: within the tenant's 512 MiB
        assert not any(f"pid {gone} of" in x and "placed by what it holds" in x for x in enf.log), enf.log
    finally:
        o and o.close()
        stop_all([victim, host], enf)


def test_row47_2_memory_its_process_left_stays_its_containers_and_holds_its_next_call(cgroups, build, env5,
                                                                                     gpu_nodes):
    """Six times 200 MiB under a 256 MiB limit held 1,200 MiB before: the second now waits."""
    e, caller = envs(build, env5, gpu_nodes)
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "tenant=256MiB", env=e, start_timeout=120)
    cg = cgroups("tenant")
    o, waiters = None, []
    try:
        o = Orphan(cg, build, caller, "200M")
        until(lambda: left(enf) == [("tenant", 200 * MiB, [o.gone])], 10, "the gone process's memory shown")
        st = status(enf)["gpus"]["0"]
        assert st["unassigned"] == 4 * GiB and st["unattributed"] == 0
        for _ in range(5):
            p = popen_in(cg, *NOBODY, build / "cgcaller", "alloc", "-s", "200M", "--orphan", env=caller)
            waiters.append(p)
            wait_state(p.pid, "T", timeout=10)   # at its allocation: its container holds 200 MiB already
            until(lambda: any(c["gpus"]["0"]["waiting"] for c in status(enf)["containers"]), 5, "shown waiting")
            c = status(enf)["containers"][0]["gpus"]["0"]
            assert (c["left_by_exited"], c["used"], c["waiting"]) == (200 * MiB, 0, True), c
            p.kill()
            p.wait()
        used = subprocess.run([f"{build}/standin/standin-usage"], env=caller, capture_output=True, text=True)
        assert used.stdout.startswith(f"dev=0 used={200 * MiB} "), used.stdout   # the driver: 200 MiB, not 1,200
    finally:
        o and o.close()
        stop_all(waiters, enf)


@pytest.mark.parametrize("over_limit", ["stall", "kill"])
def test_row47_2_a_container_over_by_what_its_gone_processes_left_is_stopped_within_a_second(cgroups, build, env5,
                                                                                            gpu_nodes, over_limit):
    """Two in quick succession: the second is admitted while the driver may still be tearing the
    first down (DEPARTED_GRACE), then the first's memory is charged: over, and its holders (no
    call made: found in the container's cgroup) are stopped, or killed and the memory freed."""
    e, caller = envs(build, env5, gpu_nodes)
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "tenant=512MiB", "--over-limit", over_limit, env=e,
                   start_timeout=120)
    cg, first, second = cgroups("tenant"), None, None
    try:
        first = Orphan(cg, build, caller, "300M")
        second = Orphan(cg, build, caller, "300M")
        holders = (first.holder, second.holder)
        until(lambda: status(enf)["gpus"]["0"]["left_by_exited"], 5, "its gone processes' memory charged")
        t0 = time.monotonic()
        if over_limit == "stall":
            until(lambda: all(proc_state(str(h)) in "Tt" for h in holders), 3, "the holders stopped")
            took = time.monotonic() - t0
            until(lambda: status(enf)["gpus"]["0"]["left_by_exited"][0]["over_by"] == 88 * MiB, 3, "shown over")
        else:
            until(lambda: all(dead(h) for h in holders), 3, "the holders killed")
            took = time.monotonic() - t0
            until(lambda: left(enf) == [], 5, "the memory freed")
        enf.wait_for("container tenant GPU0: over its limit by the driver's count")
        assert took < 1.0, took   # the next sample (0.25 s) and the stop
    finally:
        first and first.close()
        second and second.close()
        stop_all([], enf)


def test_row47_2_memory_no_process_is_listed_for_counts_against_the_gpu(cgroups, build, env5, gpu_nodes):
    """A driver that lists no pid for memory whose process is gone: the GPU's total shows it."""
    e, caller = envs(build, env5, gpu_nodes, CONVGPU_STANDIN_NVML_DEAD="hide")
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "tenant=1GiB", "--limit", "big=4GiB", env=e,
                   start_timeout=120)
    o = big = None
    try:
        o = Orphan(cgroups("tenant"), build, caller, "300M")
        until(lambda: status(enf)["gpus"]["0"]["unattributed"] == 300 * MiB, 10, "counted against the GPU")
        big = popen_in(cgroups("big"), build / "cgcaller", "alloc", "-s", "1M", "--hold", env=caller)
        expect(big, "allocated")   # assigned what is free: the capacity less what nobody holds
        assert [c["gpus"]["0"]["assigned"] for c in status(enf)["containers"]] == [4 * GiB - 300 * MiB]
        o.close()
        until(lambda: status(enf)["gpus"]["0"]["unattributed"] == 0, 10, "freed: counted no more")
    finally:
        o and o.close()
        stop_all([big], enf)


def unprobed_copy(build, scratch):
    """A copy of the stand-in driver nobody probes (an enforcer with --no-discover never finds
    it), where `nobody` can load it: its calls are admitted by nothing."""
    d = scratch / "drv"
    d.mkdir()
    shutil.copy(build / "standin" / "libcuda.so.1", d / "libcuda.so.1")
    os.chmod(d, 0o755)
    return d


def test_row47_5_a_graphics_process_is_placed_in_its_container_and_a_display_server_never(cgroups, build, env5,
                                                                                       gpu_nodes, scratch):
    """Through a copy of the driver nobody probes (no call admitted) and listed as graphics."""
    e, caller = envs(build, env5, gpu_nodes)
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "256MiB", env=e, start_timeout=120)
    gfx = dict(caller, LD_LIBRARY_PATH=str(unprobed_copy(build, scratch)), CONVGPU_STANDIN_GRAPHICS="1")
    tenant = display = None
    try:
        tenant = popen_in(cgroups("tenant"), *NOBODY, build / "cgcaller", "alloc", "-s", "1G", "--hold", env=gfx)
        expect(tenant, "allocated")
        wait_state(tenant.pid, "T", timeout=3)
        until(lambda: status(enf)["containers"] and status(enf)["containers"][0]["gpus"]["0"]["over_by"] > 0, 3,
              "shown over")
        assert status(enf)["containers"][0]["gpus"]["0"]["over_by"] == GiB - 256 * MiB
        display = popen_in(cgroups("gdm.service"), build / "cgcaller", "alloc", "-s", "2G", "--hold", env=gfx)
        expect(display, "allocated")
        never_stopped(display, 1.5)
        assert status(enf)["gpus"]["0"]["unattributed"] == 2 * GiB
        assert [c["name"] for c in status(enf)["containers"]] == ["tenant"]
    finally:
        stop_all([tenant, display], enf)


@pytest.mark.parametrize("stall", ["signal", "freezer"])
@pytest.mark.parametrize("delay", [0.0, 0.4])
def test_row47_the_watchdog_resumes_what_the_backstop_stopped_however_soon_the_enforcer_dies(
        cgroups, build, env5, gpu_nodes, scratch, stall, delay):
    """kill -9 of the enforcer right after the backstop stopped a container: resumed at once.
    Before, a death 0.3-0.5 s after the stop left it stopped (the state file came later)."""
    e, caller = envs(build, env5, gpu_nodes)
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "256MiB", "--stall", stall, env=e, start_timeout=120)
    tenant = None
    try:
        tenant = popen_in(cgroups("tenant"), *NOBODY, build / "cgcaller", "alloc", "-s", "1G", "--hold",
                          env=dict(caller, LD_LIBRARY_PATH=str(unprobed_copy(build, scratch))))
        expect(tenant, "allocated")
        wait_state(tenant.pid, "T", timeout=5) if stall == "signal" else \
            until(lambda: "frozen 1" in (cg_events(tenant.pid) or ""), 5, "frozen")
        time.sleep(delay)
        enf.p.kill()
        enf.p.wait()
        until(lambda: proc_state(str(tenant.pid)) not in "Tt" and "frozen 1" not in (cg_events(tenant.pid) or ""),
              2, "resumed by the watchdog")
    finally:
        stop_all([tenant], enf)


def cg_events(pid: int) -> str | None:
    """cgroup.events of pid's v2 cgroup (the freezer's state)."""
    from convgpu.enforcer.tenants.containers import cgroup_layout
    try:
        path = open(f"/proc/{pid}/cgroup").read().splitlines()[-1].split(":", 2)[2]
        return open(f"{cgroup_layout().v2_root}{path}/cgroup.events").read()
    except (OSError, IndexError):
        return None
