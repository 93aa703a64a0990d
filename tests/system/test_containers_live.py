"""Attribution to cgroups and real podman containers, exact bytes per container, and
`convgpu trace --json` end to end."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MiB, Caller, need
from convgpu.enforcer.accounting import Accountant
from convgpu.enforcer.tenants.engines import EngineLookup

pytestmark = pytest.mark.system


def test_bytes_per_cgroup_exact(tracer, build, caller_env, cgroups):
    callers = []
    try:
        for name, n in (("left", 3), ("right", 5)):
            cg = cgroups(name)
            # join the cgroup in the child before exec, so its first CUDA call is already there
            argv = ["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"',
                    str(build / "cgcaller"), "alloc", "-n", str(n), "-s", str(2 * MiB), "--hold"]
            callers.append((name, n, Caller(argv, caller_env)))
        tracer.poll()
        snap = Accountant(ctx_overhead=64 * MiB).snapshot(tracer.usage())
        rows = {c.name: c for c in snap.containers}
        for name, n, c in callers:
            row = rows[name]
            assert row.kind == "cgroup" and row.cgroup.endswith(f"/{name}")
            assert row.pids == (c.pid,)
            assert (row.live, row.overhead, row.total) == (n * 2 * MiB, 64 * MiB, n * 2 * MiB + 64 * MiB)
    finally:
        for _, _, c in callers:
            c.kill()


@pytest.fixture
def podman(root):
    need(shutil.which("podman") is not None, "podman not installed")
    rootfs = Path("/tmp/convgpu-test-rootfs")
    for d in ("proc", "sys", "dev", "tmp", "etc", "usr", "lib", "lib64", "bin", "build"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    names = []
    yield rootfs, names
    if names:
        subprocess.run(["podman", "rm", "-f", "-t", "0", *names], capture_output=True, timeout=60)


def test_two_podman_containers_attributed_by_name(tracer, build, podman):
    rootfs, names = podman
    callers = []
    for name, n in (("convgpu-test-a", 2), ("convgpu-test-b", 4)):
        names.append(name)
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)
        argv = ["podman", "--cgroup-manager=cgroupfs", "--runtime", "runc", "run", "-i", "--rm",
                "--network", "none", "--cgroupns=host", "--pid=host", "--name", name,
                "--label", "com.nvidia.memory.limit=1GiB"]
        for m in ("/usr", "/lib", "/lib64", "/bin"):
            if os.path.exists(m):
                argv += ["-v", f"{m}:{m}:ro"]
        argv += ["-v", f"{build}:/build:ro", "-e", "LD_LIBRARY_PATH=/build/standin", "--rootfs", str(rootfs),
                 "/build/cgcaller", "alloc", "-n", str(n), "-s", str(3 * MiB), "--hold"]
        c = Caller(argv, dict(os.environ))
        pid = int(next(line for line in c.lines if line.startswith("allocated")).split("pid=")[1])
        callers.append((name, n, pid, c))
    try:
        tracer.poll()
        engines = EngineLookup()
        acct = Accountant(ctx_overhead=0, engines=engines)
        for name, n, pid, c in callers:   # names come from podman, asked once synchronously
            engines.lookup_sync(acct.container(pid))
        snap = acct.snapshot(tracer.usage())
        rows = {c.name: c for c in snap.containers}
        for name, n, pid, c in callers:
            row = rows[name]
            assert row.kind == "podman" and len(row.id) == 64
            assert row.pids == (pid,) and row.live == n * 4 * MiB   # 3 MiB takes two 2 MiB pages
            assert row.labels.get("com.nvidia.memory.limit") == "1GiB"
        engines.close()
    finally:
        for *_, c in callers:
            c.release()


def test_trace_json_end_to_end(root, build, caller_env, run_caller):
    tr = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "trace", "--json", "--interval", "0.2",
                           "--duration", "20", "--no-discover", "--lib", str(build / "standin" / "libcuda.so.1")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(tr.stdout.readline())            # printed once the probes are attached
        assert first["type"] == "snapshot" and first["mode"] == "driver" and first["schema"] == 1
        c = run_caller("alloc", "-n", 5, "-s", 2 * MiB)
        seen_allocs, snap_row = 0, None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and snap_row is None:
            obj = json.loads(tr.stdout.readline())
            if obj["type"] == "event" and obj["pid"] == c.pid and obj["op"] == "alloc":
                seen_allocs += 1
                assert obj["size"] == 2 * MiB and obj["api"] == "cuMemAlloc_v2"
            if obj["type"] == "snapshot":
                for row in obj["containers"]:
                    for p in row["processes"]:
                        if p["pid"] == c.pid:
                            snap_row = p
        assert seen_allocs == 5
        assert (snap_row["live"], snap_row["allocs"], snap_row["contexts"]) == (10 * MiB, 5, 1)
        assert snap_row["overhead_source"] == "estimate"
        c.release()
    finally:
        tr.terminate()          # SIGTERM: detaches cleanly, exit code 0
        assert tr.wait(timeout=20) == 0
