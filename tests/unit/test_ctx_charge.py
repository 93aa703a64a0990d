"""The enforcer's context charge, without BPF (the ledger stands in for the maps): every
context costs its device's estimate from its first moment; once NVML has measured a process,
extra_overhead turns its estimate into the measurement, never both; what a process holds above
the estimate is its own container's charge, and teaches no one's estimate (issue 39). charged()
in bpf/books.bpf.c is used + contexts x ctx_charge
+ extra_overhead: charged() below is the same sum over what the enforcer wrote."""
import os
import subprocess

from convgpu.enforcer.tenants.containers import Container
from convgpu.enforcer.daemon import Enforcer
from convgpu.enforcer.tenants.limits import LimitRules
from convgpu.probes.ledger import Ledger
from convgpu.probes.nvml import GpuInfo

MiB, GiB = 1 << 20, 1 << 30


class Nvml:
    ok, driver = True, "580.159.04"

    def gpus(self):
        return [GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * GiB, 0, "GPU-0"), GpuInfo(1, "NVIDIA A100", 80 * GiB, 0, "GPU-1")]


def enforcer(tmp_path, box_of=None):
    """No --ctx-overhead, and never started (nothing measured at start): GPU0 is charged the
    table's hint, GPU1 (a model the table lacks) the conservative 1 GiB."""
    led = Ledger().start()
    box_of = box_of or {10: "a", 11: "a", 20: "b"}
    enf = Enforcer(led, "fifo", {0: 8 * GiB, 1: 8 * GiB}, LimitRules({}, 4 * GiB),
                   container_of=lambda pid: Container("cgroup", box_of[pid], "/" + box_of[pid]),
                   run_dir=str(tmp_path / "run"), nvml=Nvml(), state_dir=str(tmp_path))
    return enf, led


def sampler(sample: dict):
    """probes.nvml.Sampler's face: its next sample, and NVML answering (ok_at: now)."""
    import time
    return type("S", (), {"take": lambda self: sample, "ok_at": time.monotonic(), "error": ""})()


def charged(enf, box, dev):
    t = enf.maps.table("assign")
    a = t[t.Key(container=box.key, dev=dev)]
    used, contexts, _ = enf.books.usage(box, dev)
    return max(0, used + contexts * a.ctx_charge + a.extra_overhead)


def test_estimate_from_the_first_context_then_the_measurement_alone(tmp_path):
    enf, led = enforcer(tmp_path)
    assert {d: (e.source, e.bytes) for d, e in enf.charges.est.items()} == {0: ("table-hint", 550 * MiB),
                                                                            1: ("conservative", 1024 * MiB)}
    assert enf.maps.leaf == {} and enf.admission.write(True) == 0 and enf.maps.leaf["ctx_overhead"] == 1024 * MiB
    for pid in (10, 11, 20):
        led.context(pid, 0, True)
        enf.placement.place(pid, 0, 0)
    led.alloc(10, 0, 100 * MiB)
    a, b = enf.books.boxes["a"], enf.books.boxes["b"]
    assert charged(enf, a, 0) == 100 * MiB + 2 * 550 * MiB and charged(enf, b, 0) == 550 * MiB
    # NVML measures pid 10 (518 MiB) and pid 20 (600 MiB, above the estimate); 11 not yet
    enf.charges.excess = {(10, 0): (518 * MiB, 1), (20, 0): (600 * MiB, 1)}
    assert enf.charge.recharge()
    assert charged(enf, a, 0) == 100 * MiB + 518 * MiB + 550 * MiB
    assert charged(enf, b, 0) == 600 * MiB
    st = {c["id"]: c["gpus"]["0"] for c in enf.status()["containers"]}
    assert st["a"]["context_source"] == "measured+table-hint" and st["b"]["context_source"] == "measured"
    assert st["a"]["context_overhead"] == 518 * MiB + 550 * MiB
    assert enf.status()["gpus"]["0"]["ctx_estimate"]["source"] == "table-hint"
    assert enf.books.demand(b, 0) == 600 * MiB and enf.books.held(a, 0) == 100 * MiB + 518 * MiB + 550 * MiB


def test_what_a_process_holds_above_the_estimate_is_its_own_containers_never_the_next_tenants(tmp_path):
    """Issue 39 part 3: a job whose graph node took 2 GiB beside its context left, and the
    learned median of its device moved to 1.5 GiB for every context after it, across restarts.
    Now the excess is its container's charge while it runs, and the estimate stays."""
    enf, led = enforcer(tmp_path)
    enf.admission.write(True)
    for pid in (10, 20):
        led.context(pid, 0, True)
        enf.placement.place(pid, 0, 0)
    enf.charge.sampler = sampler({(10, 0): (518 * MiB + 2048 * MiB, 1), (20, 0): (520 * MiB, 1)})
    enf.charge.measure_overhead()
    a, b = enf.books.boxes["a"], enf.books.boxes["b"]
    assert charged(enf, a, 0) == 2566 * MiB and charged(enf, b, 0) == 520 * MiB   # each its own
    enf.placement.gone(10)
    enf.charge.measure_overhead()
    assert (enf.charges.est[0].source, enf.charges.est[0].bytes) == ("table-hint", 550 * MiB)
    led.context(21, 0, True)
    box_of = {21: "c"}
    enf.placement.container_of = lambda pid: Container("cgroup", box_of[pid], "/" + box_of[pid])
    enf.placement.place(21, 0, 0)
    assert charged(enf, enf.books.boxes["c"], 0) == 550 * MiB
    enf2, _ = enforcer(tmp_path)           # and the same after a restart
    assert (enf2.charges.est[0].source, enf2.charges.est[0].bytes) == ("table-hint", 550 * MiB)


def test_an_exiting_process_holds_its_measurement_or_the_estimate(tmp_path):
    """Until the driver has freed it (its pidfd), what an exiting process held stays counted."""
    kids = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    p, q = (k.pid for k in kids)
    try:
        enf, led = enforcer(tmp_path, {p: "a", q: "b"})
        for pid in (p, q):
            led.context(pid, 0, True)
            enf.placement.place(pid, 0, 0)
        enf.charges.excess = {(p, 0): (518 * MiB, 1)}
        enf.exits.exiting(p, 64 * MiB, contexts=1)
        enf.exits.exiting(q, 0, contexts=1)
        assert {x.pid: x.held[0] for x in enf.books.exits.values()} == {p: 64 * MiB + 518 * MiB, q: 550 * MiB}
    finally:
        for k in kids:
            k.kill()
            k.wait()
        for fd in list(enf.books.exits):
            os.close(fd)


def test_status_table_names_the_estimate_and_where_each_charge_comes_from():
    from rich.console import Console

    from convgpu.cli.status import table
    st = {"pid": 1, "policy": "fifo", "stall": "signal",
          "gpus": {"0": {"assigned": 2 * GiB, "capacity": 6 * GiB,
                         "ctx_estimate": {"bytes": 550 * MiB, "source": "architecture", "detail": "H100"}}},
          "containers": [{"name": "c0", "limit": 2 * GiB, "stalled_s": 1.0, "stalls": 1,
                          "gpus": {"0": {"assigned": 2 * GiB, "used": 1472 * MiB, "context_overhead": 522 * MiB,
                                         "context_source": "measured", "over_limit": True, "waiting": True,
                                         "waiting_s": 1.0}}}]}
    c = Console(width=120, record=True)
    c.print(table(st))
    out = c.export_text()
    assert "GPU0 context 550.0 MiB (architecture)" in out and "measured" in out and "522.0 MiB" in out
    assert max(len(line) for line in out.splitlines()) <= 110
    # a GPU never seen, its context being measured; the shim's view of a context beside it
    st["gpus"]["0"].update(ctx_estimate={"bytes": GiB, "source": "conservative", "detail": "-"}, ctx_measuring=True)
    st["shim_ctx_ceiling"] = {"0": {"bytes": 1152 * MiB, "source": "estimate", "detail": "-"}}
    c = Console(width=120, record=True)
    c.print(table(st))
    assert "GPU0 context 1.0 GiB (conservative, being measured: newcomers wait), shim view 1.1 GiB" in c.export_text()


def test_doctor_says_per_gpu_what_a_context_is_charged_and_why(tmp_path):
    """No enforcer answers: what a start would charge with the state dir as it is."""
    from convgpu.cli.doctor import context_checks
    from convgpu.enforcer.ctxest import MeasuredStore

    class H200:
        ok, driver = True, "580.159.04"

        def gpus(self):
            return [GpuInfo(0, "NVIDIA H200", 140 * GiB, 0, "GPU-h2"), GpuInfo(1, "NVIDIA H100 80GB HBM3", 80 * GiB, 0, "GPU-h1")]

    def checks(nv, cuda=("libcuda",)):
        return {c.name: c for c in context_checks(nv, list(cuda), str(tmp_path), str(tmp_path / "no-enforcer"))}
    fresh = checks(H200())
    assert fresh["context GPU0"].ok and "measured at start first" in fresh["context GPU0"].detail
    assert "(conservative;" in fresh["context GPU0"].detail               # until it is measured
    assert "(table-hint;" in checks(H200(), cuda=())["context GPU1"].detail   # no driver to measure with
    store = MeasuredStore(str(tmp_path))
    store.set_measured("NVIDIA H200 driver 580.159.04", 518 * MiB)
    store.save()
    kept = checks(H200())["context GPU0"]
    assert kept.ok and kept.detail.startswith("552.0 MiB per context (measured-at-start; a start with")
    none = checks(type("NoNvml", (), {"ok": False, "driver": ""})())
    assert list(none) == ["context GPU0"] and not none["context GPU0"].ok and "(no NVML)" in none["context GPU0"].detail
