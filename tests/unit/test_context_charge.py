"""The ContextCharge part (enforcer/overhead.py) built alone: fakes of the tracer, NVML, the
measurement's child and Admission; real charges (ctxest.Charges) and books. No Enforcer, no
kernel, no root: a context measured at start, newcomers held for it and released with the
figure measured, NVML's per-process measurement turned into each container's charge."""
import logging
import subprocess
import time
from types import SimpleNamespace

import pytest

from convgpu.enforcer import ctxest, overhead
from convgpu.enforcer.books import Books, Box
from convgpu.enforcer.ctxmeasure import Outcome
from convgpu.enforcer.overhead import ContextCharge
from convgpu.enforcer.tenants.containers import Container
from convgpu.probes.nvml import GpuInfo
from convgpu.probes.table import CUDA

MiB, GiB = 1 << 20, 1 << 30
H200 = GpuInfo(0, "NVIDIA H200", 140 * GiB, 0, "GPU-h200")
H100_MIG = GpuInfo(1, "NVIDIA H100 80GB HBM3", 80 * GiB, 0, "GPU-h100", migs=("MIG-1",))
H100 = GpuInfo(2, "NVIDIA H100 80GB HBM3", 80 * GiB, 0, "GPU-h100b")


def usage(pid, dev, live=0, contexts=1, made=0, freed=0):
    return SimpleNamespace(pid=pid, dev=dev, live=live, contexts=contexts, n_alloc=made, n_free=freed)


class Tracer:
    def __init__(self):
        self.b = object()        # the program is loaded: a new estimate is written at once
        self.rows = []
        self.libraries = [SimpleNamespace(path="/host/libcuda.so.1", kind=CUDA, trusted=True)]
        self.gpumap = SimpleNamespace(cache={})
        self.mapped = set()

    def usage(self):
        return self.rows


class Nvml:
    ok, driver = True, "580.159.04"

    def __init__(self, gpus=(H200, H100_MIG, H100)):
        self.list = list(gpus)

    def gpus(self):
        return self.list


class Admission:
    def __init__(self):
        self.rewrites, self.exempt = 0, []

    def rewrite(self):
        self.rewrites += 1

    def exempt_measuring(self, pid, on):
        self.exempt.append((pid, on))


class Measurement:
    """ctxmeasure.Measurement's face: the test says when its child has answered."""
    made = []

    def __init__(self, model_key, dev, visible, lib, nvml, exempt):
        self.model_key, self.dev, self.visible, self.lib, self.exempt = model_key, dev, visible, lib, exempt
        self.outcome = None
        Measurement.made.append(self)

    def start(self):
        return self

    def result(self, now=None):
        return self.outcome


def part(tmp_path, nvml=None):
    nvml = nvml or Nvml()
    gpus = {g.index: g for g in nvml.gpus()}
    capacity = {d: 8 * GiB for d in gpus}
    charges = ctxest.Charges(ctxest.devices(capacity, gpus, Nvml.driver), None, ctxest.MeasuredStore(str(tmp_path)))
    books = Books(capacity, dict(capacity), lambda box, dev: None, charges.ctx, lambda box, dev: box.limit)
    tracer, written, adm = Tracer(), [], Admission()
    charge = ContextCharge(tracer, nvml, gpus, charges, books,
                           lambda box, dev: written.append((box.name, dev, box.extra.get(dev))), adm)
    return charge, charges, books, tracer, written, adm


def box(books, key, name, pids, devs):
    b = Box(key, Container("cgroup", f"/{name}", f"/{name}"), name, 0.0, 4 * GiB, "test", set(pids),
            assigned={d: GiB for d in devs})
    books.boxes[b.container.id] = books.by_key[key] = b
    return b


def first_call(pid, dev, api="cuDevicePrimaryCtxRetain", size=0):
    return SimpleNamespace(pid=pid, tid=pid, dev=dev, size=size, api=api, result=1)


@pytest.fixture
def measured(monkeypatch):
    Measurement.made = []
    monkeypatch.setattr(overhead.ctxmeasure, "Measurement", Measurement)


def test_a_gpu_never_seen_holds_its_newcomers_until_its_context_is_measured(tmp_path, measured, caplog):
    caplog.set_level(logging.INFO, logger="convgpu")
    charge, charges, books, _, written, adm = part(tmp_path, Nvml([H200, H100_MIG]))
    kid = subprocess.Popen(["sleep", "30"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        charge.plan()
        assert charge.queue == [("NVIDIA H200 driver 580.159.04", 0)] and charges.waiting == {0}
        assert charges.unmeasured["NVIDIA H100 80GB HBM3 driver 580.159.04"].startswith("MIG mode")
        assert {d: (e.source, e.bytes) for d, e in charges.est.items()} == {0: ("conservative", GiB),
                                                                            1: ("table-hint", 550 * MiB)}
        assert charges.newcomer_charge() == 550 * MiB   # GPU0's newcomers wait: not its 1 GiB
        x = box(books, 1, "early", [10], [0])
        charges.excess = {(10, 0): (600 * MiB, 1)}
        assert charge.hold_newcomer(first_call(kid.pid, 0), ())
        assert charge.hold_newcomer(first_call(gone.pid, 0), ())
        assert not charge.hold_newcomer(first_call(kid.pid, 1), ())   # a GPU whose figure is known
        assert charge.hold_newcomer(first_call(gone.pid, 1), (0,))    # mapped to both: it waits
        assert charge.measuring() and charge.measured(time.monotonic()) is None   # nothing runs yet
        charge.measure_next()
        [m] = Measurement.made
        assert (m.model_key, m.dev, m.visible, m.lib) == ("NVIDIA H200 driver 580.159.04", 0, "GPU-h200",
                                                          "/host/libcuda.so.1")
        m.exempt(4242, True)
        assert adm.exempt == [(4242, True)] and charge.measured(time.monotonic()) is None   # no answer yet
        m.outcome = Outcome(518 * MiB, "a bare context")
        released = list(charge.measured(time.monotonic()))
        # 518 MiB + 1/16 in whole 2 MiB pages; a newcomer that died meanwhile is dropped
        assert [(e.pid, also, size) for e, also, size in released] == [(kid.pid, (), 552 * MiB)]
        assert charges.waiting == set() and charge.held_new == {} and charge.measuring_now is None
        assert (charges.est[0].source, charges.est[0].bytes) == ("measured-at-start", 552 * MiB)
        # GPU0's estimate changed: its containers' extra is rewritten with it, and so is control
        assert written == [("early", 0, 600 * MiB - 552 * MiB)] and adm.rewrites == 1
        assert ctxest.MeasuredStore(str(tmp_path)).measured == {"NVIDIA H200 driver 580.159.04": 518 * MiB}
    finally:
        kid.kill()
        kid.wait()
    assert x.extra == {0: 48 * MiB}


def test_nvml_measures_each_process_and_its_container_is_charged_that_never_twice(tmp_path, caplog):
    charge, charges, books, tracer, written, _ = part(tmp_path)
    a = box(books, 1, "a", [10, 11], [2])
    b = box(books, 2, "b", [20], [2])
    sample = {(10, 2): (518 * MiB, 1), (20, 2): (2566 * MiB, 1)}
    charge.sampler = SimpleNamespace(take=lambda: dict(sample), ok_at=time.monotonic(), seq=1, error="", raw={})
    assert charge.measure_overhead()
    assert (a.extra, b.extra) == ({2: 518 * MiB - 550 * MiB}, {2: 2016 * MiB})   # 11: its estimate still
    assert written == [("a", 2, -32 * MiB), ("b", 2, 2016 * MiB)]
    assert not charge.measure_overhead() and len(written) == 2   # the same sample: nothing rewritten
    assert charges.est[2].bytes == 550 * MiB                    # and the estimate is nobody's to move
    charge.sampler.ok_at = time.monotonic() - overhead.NVML_STALE - 1
    charge.sampler.take = lambda: None
    caplog.set_level(logging.INFO, logger="convgpu")
    assert not charge.measure_overhead() and not charge.measure_overhead()
    charge.sampler.ok_at = time.monotonic()
    charge.measure_overhead()
    said = [r.message for r in caplog.records]
    assert [m.split(" (")[0] for m in said] == ["NVML has not answered for 4 s", "NVML answers again: contexts are measured again"]
    assert a.extra == {2: -32 * MiB}   # kept at its last measurement meanwhile


def test_what_the_backstop_is_handed(tmp_path):
    charge, charges, _, tracer, _, _ = part(tmp_path)
    tracer.rows = [usage(10, 2, live=300 * MiB, contexts=2, made=5, freed=2)]
    charge.sampler = SimpleNamespace(raw={(10, 2): 3 * GiB})
    charge.saw_call(10, "cuCtxSetLimit")
    charge.saw_call(10, "cuCtxSetLimit")
    charge.saw_call(10, "cuGraphInstantiateWithFlags")
    assert charge.calls_of(10, 2) == ("3.0 GiB by the driver's count, 300.0 MiB in 3 live admitted allocations "
                                      "(5 made), 2 contexts, other calls: cuCtxSetLimit x2, "
                                      "cuGraphInstantiateWithFlags x1")
    assert charge.accounted() == {(10, 2): 300 * MiB + 2 * 550 * MiB}
    charge.forget(10)
    assert charge.calls_of(10, 2).endswith("2 contexts")
    assert charge.backstop_off({0: 1, 1: 1, 2: 1}) == {1: "MIG mode: NVML counts no process's memory on the whole GPU"}
    charge.nvml = None
    assert charge.backstop_off({0: 1}) == {0: "no NVML"}
