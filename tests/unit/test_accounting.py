"""Accountant: exact overheads from NVML figures, per-device estimates, container grouping
and peaks, with stand-ins for NVML and the pid -> container lookup (no kernel)."""
from convgpu.enforcer.accounting import Accountant
from convgpu.enforcer.tenants.containers import Container
from convgpu.probes.events import Event
from convgpu.probes.nvml import GpuInfo
from convgpu.probes.tracer import ProcUsage

MiB = 1 << 20
A = Container(kind="podman", id="a" * 64, cgroup="/libpod_parent/libpod-" + "a" * 64)
B = Container(kind="cgroup", id="/demo/b", cgroup="/demo/b")
WHERE = {1: A, 2: A, 3: B}


class FakeNvml:
    ok = True

    def __init__(self, per_proc):
        self.per_proc = per_proc

    def process_memory(self):
        return self.per_proc

    def gpus(self):
        return [GpuInfo(0, "H100", 80 << 30, 3000 * MiB)]


def u(pid, live, contexts=1, dev=0, n_alloc=1):
    return ProcUsage(pid=pid, dev=dev, gen=pid, cgroup_id=0, comm="x", live=live, peak=live, n_alloc=n_alloc,
                     n_free=0, bytes_alloc=live, bytes_free=0, n_failed=0, contexts=contexts, last_ns=0)


def ev(pid, op, size, live):
    return Event(ts_ns=0, pid=pid, tid=pid, comm="x", cgroup_id=0, op=op, api="cuMemAlloc_v2", rt_api=None,
                 dev=0, addr=1, size=size, live=live, result=0, flags=0)


def acct(nvml=None, **kw):
    return Accountant(nvml=nvml, container_of_pid=WHERE.__getitem__, **kw)


def test_overhead_measured_from_nvml_and_estimated_for_the_rest():
    a = acct(FakeNvml({(1, 0): 642 * MiB, (2, 0): 519 * MiB}))
    s = a.snapshot([u(1, 123 * MiB), u(2, 0), u(3, 64 * MiB)])
    rows = {p.pid: p for c in s.containers for p in c.processes}
    assert (rows[1].overhead, rows[1].overhead_source) == (519 * MiB, "nvml")
    assert (rows[2].overhead, rows[2].overhead_source) == (519 * MiB, "nvml")
    # pid 3 has no NVML entry yet: the device's median measurement stands in
    assert (rows[3].overhead, rows[3].overhead_source) == (519 * MiB, "estimate")
    assert s.gpus[0].tracked == 123 * MiB + 519 * MiB * 3 + 64 * MiB
    by = {c.id: c for c in s.containers}
    assert by[A.id].live == 123 * MiB and by[A.id].pids == (1, 2) and by[B.id].live == 64 * MiB


def test_estimate_without_nvml_is_the_configured_value_per_context():
    s = acct(ctx_overhead=100 * MiB).snapshot([u(1, 10 * MiB, contexts=2), u(3, 0, contexts=0)])
    rows = {p.pid: p for c in s.containers for p in c.processes}
    assert (rows[1].overhead, rows[1].overhead_source) == (200 * MiB, "estimate")
    assert (rows[3].overhead, rows[3].overhead_source) == (0, "none")
    assert s.gpus[0].name == "GPU 0 (no NVML)" and s.gpus[0].total is None


def test_container_peak_follows_events_between_snapshots():
    a = acct(ctx_overhead=0)
    a.feed([ev(1, "alloc", 100, 100), ev(2, "alloc", 50, 50), ev(1, "free", 100, 0)])
    s = a.snapshot([u(1, 0), u(2, 50)])
    c = next(c for c in s.containers if c.id == A.id)
    assert (c.live, c.peak) == (50, 150)
    a.feed([ev(2, "exit", 50, 0)])
    assert a.events_total == 4


def test_filters_by_pid_and_container():
    a = acct(ctx_overhead=0)
    usage = [u(1, 1), u(2, 2), u(3, 3)]
    assert [p.pid for c in a.snapshot(usage, pids={2}).containers for p in c.processes] == [2]
    assert [c.id for c in a.snapshot(usage, container="b").containers] == [B.id]
    assert [c.id for c in a.snapshot(usage, container="aaaaaa").containers] == [A.id]
    assert a.snapshot(usage, container="nothing").containers == ()


def test_rate_between_snapshots():
    a = acct(ctx_overhead=0)
    a.snapshot([u(1, 0, n_alloc=0)])
    s = a.snapshot([u(1, 0, n_alloc=1000)])
    assert s.containers[0].processes[0].rate > 0


class NoProcessLists(FakeNvml):
    """NVML where a GPU's per-process lists raise (NotSupported: the stand-in's NVML, MIG, some
    cards; or a GPU lost): `convgpu trace` crashed on the first snapshot once process_memory()
    raised instead of reading as "no process" (issue 31)."""

    def process_memory(self):
        raise RuntimeError("Not Supported")


def test_a_gpu_whose_process_lists_fail_leaves_the_view_running_at_the_estimate(caplog):
    a = acct(NoProcessLists({}), ctx_overhead=100 * MiB)
    for _ in range(3):
        s = a.snapshot([u(1, 10 * MiB, contexts=2)])
    rows = {p.pid: p for c in s.containers for p in c.processes}
    assert (rows[1].overhead, rows[1].overhead_source) == (200 * MiB, "estimate")
    assert s.gpus[0].name == "H100" and s.gpus[0].tracked == 210 * MiB   # the GPUs still read
    said = [r.message for r in caplog.records if "NVML process_memory" in r.message]
    assert said == ["NVML process_memory: Not Supported; the view goes on without it (contexts at their estimate)"]
