"""The NVML sampler against real probes: the stand-in driver's per-process slots play NVML's
per-process memory (the driver's own count: allocations and each context's overhead, which the
probes do not see), and CONVGPU_STANDIN_FREE_MS makes cuMemFree_v2 keep its bytes for a while,
as a large free does on the H100 (BPF settles a free at its return: bpf exit_free).
In-process enforcer on the stand-in, real cgroups."""
import sys
import time
from pathlib import Path

import pytest

from conftest import GiB, MiB, StandinNvml, inprocess_enforcer, serving, until

sys.path.append(str(Path(__file__).resolve().parents[2]))
from bench.sched.resume import Worker  # noqa: E402

pytestmark = pytest.mark.system
CTX = 64 * MiB          # what the stand-in driver counts per context; the enforcer charges 0
FREE_MS = 4500          # a free spanning four samples (one a second), and longer than SETTLE_NS


def standin_env(caller_env: dict, free_ms: int) -> dict:
    return dict(caller_env, CONVGPU_STANDIN_CAPACITY=str(16 * GiB), CONVGPU_STANDIN_CTX_OVERHEAD=str(CTX),
                CONVGPU_STANDIN_FREE_MS=str(free_ms))


def enforcer(lib, env):
    """Capacity 4 GiB, limits 3 GiB, no per-context charge: a context is what NVML measures."""
    return inprocess_enforcer(lib, "sampler", 3 * GiB, ctx_overhead=0, nvml=StandinNvml(env["CONVGPU_STANDIN_SHM"]))


def overhead(enf) -> int:
    return enf.status()["containers"][0]["gpus"]["0"]["context_overhead"]


def test_a_free_in_the_driver_is_neither_context_nor_room(root, build, cgroups, caller_env):
    """The H100 case (docs/SCHEDULING.md, "Two stalls that never ended"): samples taken during
    a process's own long free read its freed bytes as context, and its next allocation was
    stalled over its limit (BPF had settled the free at its entry; NVML still counted it).
    Frees are settled at their return now: during the free BPF counts the bytes as NVML does,
    so no sample reads them as context, and the 2 GiB allocated again after the free returns
    fit its 3 GiB limit beside its context: no stall."""
    lib = build / "standin" / "libcuda.so.1"
    env = standin_env(caller_env, FREE_MS)
    w = Worker(cgroups("sampled"), lib, env)      # before the enforcer: the segment exists
    try:
        enf = enforcer(lib, env)
        told, seen = [], []
        with serving(enf, lambda events: told.extend(e for e in events if e.pid == w.p.pid)):
            w.send(f"a {2 * GiB}")          # the enforcer places the process at this first call
            w.stamp()
            until(lambda: enf.status()["containers"] and overhead(enf) == CTX, 5,
                  "the sampler never measured the context")
            # free the 2 GiB (the stand-in keeps them FREE_MS) and allocate them again at once
            w.send("r")
            deadline = time.monotonic() + FREE_MS / 1000
            while time.monotonic() < deadline:
                seen.append(overhead(enf))
                time.sleep(0.05)
            d = w.line(timeout=FREE_MS / 1000 + 3)
            assert d.startswith("d "), d
            assert set(seen) == {CTX}, seen                  # never the free's bytes
            assert [e.op for e in told if e.op in ("unknown", "stall", "over_limit")] == ["unknown"]
            assert overhead(enf) == CTX
    finally:
        w.kill()


def test_samples_during_frees_still_in_the_driver_are_not_taken_as_context(root, build, cgroups, caller_env):
    """A process frees and allocates 2 GiB back to back, each free 300 ms inside the driver.
    Every sample lands inside a free (in flight: `freeing`) or within SETTLE_NS of a change,
    so none is taken, and its context stays exactly what it is (read while it was quiet).
    Without the settle window the samples in its frees read 2 GiB of context."""
    lib = build / "standin" / "libcuda.so.1"
    env = standin_env(caller_env, 300)
    w = Worker(cgroups("freeing"), lib, env)
    try:
        enf = enforcer(lib, env)
        with serving(enf):
            given, sample = [], enf.charge.sampler.sample     # every value the sampler gives out
            enf.charge.sampler.sample = lambda: given.append(sample()) or given[-1]
            w.send(f"a {2 * GiB}")
            w.stamp()
            until(lambda: enf.status()["containers"] and overhead(enf) == CTX, 5,
                  "the sampler never measured the context")
            n = len(given)
            for _ in range(24):              # about 7 s: seven samples, nearly all inside a free
                w.send("r")
                assert w.line(timeout=5).startswith("d ")
            out = [g.get((w.p.pid, 0)) for g in given[n:]]
            assert len(out) >= 5 and set(out) == {(CTX, 0)}, out   # made before the probes: 0 seen
    finally:
        w.kill()
