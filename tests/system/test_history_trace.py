"""Issue 42 where no enforcer runs: `convgpu trace` keeps each container's run in the job history
from its own accounting (real uprobes on the stand-in, a real cgroup, the CLI as a subprocess).
A caller holding 3 x 64 MiB in one context (charged 32 MiB: --ctx-overhead, no NVML here) is
one run of its cgroup's job, peak 224 MiB, ended when its container had no process left."""
import json
import signal
import subprocess
import sys

import pytest

from conftest import MiB, kill_if_running, read_until, start_in, trace_rows_until

pytestmark = pytest.mark.system


def test_trace_keeps_a_containers_run(root, build, caller_env, cgroups, tmp_path):
    from convgpu.enforcer.history.store import HistoryFile
    from convgpu.enforcer.tenants.containers import cgroup_layout
    lib = str(build / "standin" / "libcuda.so.1")
    state = tmp_path / "state"
    tr = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "trace", "--json", "--no-events", "--interval",
                           "0.2", "--demo", "never", "--no-discover", "--lib", lib, "--ctx-overhead", "32MiB",
                           "--state-dir", str(state), "--run-dir", str(tmp_path / "no-enforcer")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cg = cgroups("job")
    c = None
    try:
        json.loads(tr.stdout.readline())   # probes attached
        c = start_in(cg, build, caller_env, "alloc", "-n", 3, "-s", 64 * MiB, "--hold")
        read_until(c, "ready")
        assert trace_rows_until(tr, lambda rows: rows == [(c.pid, 0, 192 * MiB)], 20) == [(c.pid, 0, 192 * MiB)]
        c.stdin.write("\n")
        c.stdin.flush()
        assert c.wait(timeout=20) == 0
        assert trace_rows_until(tr, lambda rows: rows == [], 20) == []   # gone: its run has ended
        tr.send_signal(signal.SIGINT)
        assert tr.wait(timeout=60) == 0
    finally:
        kill_if_running(tr)
        if c is not None:
            kill_if_running(c)
    path = "/" + str(cg.relative_to(cgroup_layout().v2_root)).strip("/")
    h = HistoryFile(str(state)).read()
    assert list(h.jobs) == [f"cgroup:{path}"], h.jobs
    (run,) = h.jobs[f"cgroup:{path}"]
    assert (run.peak, run.gpus[0].used, run.gpus[0].ctx, run.gpus[0].contexts) == (224 * MiB, 192 * MiB, 32 * MiB, 1)
    assert (run.limit, run.by, run.end, run.allocs, run.container) == (None, "trace", "exit", 3, path)
