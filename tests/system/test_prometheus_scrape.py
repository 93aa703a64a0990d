"""Issue 50: what an operator sees in Prometheus. A real Prometheus (loopback only, a temporary
data dir, scraping and evaluating every second, the shipped rules with their `for:` and the
held-long threshold made quick: tests/prometheus_side.py) scrapes `convgpu enforce
--metrics-port` on the stand-in driver, NVML's per-process counts on (the backstop runs). One
container waits (it asks 512 MiB under a 256 MiB limit), one goes over its limit by the driver's
count (a 1 GiB module no call sizes, under 256 MiB), one runs within its limit, and a process
on a copy of the driver nobody probes holds 256 MiB no container is charged with. Prometheus's
HTTP API then shows their series exactly, exactly those three alerts firing, every query of the
Grafana dashboard (deploy/grafana/convgpu.json) returning data; a raised limit ends the wait and
its alert; a stopped enforcer fires ConvgpuEnforcerDown.

CONVGPU_DASHBOARD_DUMP=FILE also writes every dashboard query's results over the run to FILE
(bench/dashboard_render.py draws docs/img/dashboard.png from it), and CONVGPU_DASHBOARD_SECONDS=N
holds each phase N seconds longer, for a picture with more time in it."""
import json
import os
import shutil
import time

import pytest

from conftest import GiB, MiB, Enforcing, need, popen_in, start_in, stop_all, wait_state
from prometheus_side import Prometheus, dashboard_targets, free_port, quick_rules

pytestmark = pytest.mark.system
HOLD = float(os.environ.get("CONVGPU_DASHBOARD_SECONDS", "0"))


def nvml_env(build, env):
    """The enforcer sees the stand-in GPU through the stand-in NVML, per-process lists on."""
    return dict(env, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env['LD_LIBRARY_PATH']}", CONVGPU_STANDIN_NVML_PROCS="1")


def first_line(p, word, timeout=20):
    from conftest import lines_until
    got: list = []
    return lines_until(p.stdout, lambda x: x.split()[:1] == [word], got, timeout, f"caller {p.pid}").split()


def test_prometheus_scrapes_the_enforcer_and_fires_the_alerts_an_operator_needs(cgroups, build, env5, tmp_path):
    need(shutil.which("prometheus") is not None, "prometheus not installed (scripts/setup.sh installs it)")
    port = free_port()
    # Prometheus first: it applies a new target 5 s after it starts (its discovery's update
    # interval), while the enforcer starts; until the enforcer answers, ConvgpuEnforcerDown fires
    prom = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{port}"], quick_rules())
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", "--limit", "held=256MiB",
                    "--limit", "over=256MiB", "--metrics-port", str(port), env=nvml_env(build, env5),
                    start_timeout=120)   # a cold BPF cache (this test alone) compiles first
    fits = held = over = stray = None
    try:
        fits = start_in(cgroups("fits"), build, env5, "alloc", "-s", 128 * MiB, "--hold")
        assert first_line(fits, "allocated")[1:3] == ["1", str(128 * MiB)]
        held = start_in(cgroups("held"), build, env5, "alloc", "-s", 512 * MiB, "--hold")
        enf.wait_for("above its limit 256.0 MiB: stalled until the limit is raised")
        wait_state(held.pid, "T")
        image = tmp_path / "module.bin"   # cuModuleLoad of a file: no probe sizes it at the call
        image.write_text(f"CONVGPU-STANDIN-MODULE {GiB}\n")
        over = popen_in(cgroups("over"), build / "cgcaller", "module", "--image", image, "--from-file", "--hold",
                        env=env5)
        first_line(over, "allocated")
        enf.wait_for("container over GPU0: over its limit by the driver's count")
        # a copy of the driver that an enforcer with --no-discover never probes: no admitted
        # call places its process, which proves no hold on the GPU (no device node open)
        (tmp_path / "drv").mkdir()
        shutil.copy(build / "standin" / "libcuda.so.1", tmp_path / "drv" / "libcuda.so.1")
        stray = start_in(cgroups("stray"), build, dict(env5, LD_LIBRARY_PATH=str(tmp_path / "drv")), "alloc", "-s",
                         256 * MiB, "--hold")
        assert first_line(stray, "allocated")[1:3] == ["1", str(256 * MiB)]

        t0 = time.monotonic()
        firing = {("ConvgpuContainerHeldLong", "held"), ("ConvgpuContainerOverLimitByDriver", "over"),
                  ("ConvgpuUnattributedMemory", "0")}
        prom.until(lambda: prom.alerts() == firing, 20, "the three alerts firing, and only those")
        took = time.monotonic() - t0
        time.sleep(HOLD)
        assert prom.alerts() == firing     # nothing else fires: the backstop, probes, GPU, enforcer are well

        # the series as an operator queries them
        c = (("container", "held"), ("gpu", "0"))
        assert prom.values('convgpu_container_waiting{container="held"}') == {c + (("id", cid(prom, "held")),): 1}
        lim = prom.values("convgpu_container_limit_bytes")
        assert {k[0][1]: v for k, v in lim.items()} == {"fits": GiB, "held": 256 * MiB, "over": 256 * MiB}
        assert {k[0][1]: v for k, v in prom.values("convgpu_container_over_limit_bytes").items()} == \
            {"fits": 0, "held": 0, "over": GiB - 256 * MiB}
        assert {k[0][1]: v for k, v in prom.values("convgpu_container_used_bytes").items()} == \
            {"fits": 128 * MiB, "held": 0, "over": 0}            # the module: the driver's count only
        assert {k[0][1]: v for k, v in prom.values("convgpu_container_swapped_bytes").items()} == \
            {"fits": 0, "held": 0, "over": 0}
        [(_, wait_s)] = prom.values('convgpu_container_waiting_seconds{container="held"}').items()
        assert 2 < wait_s < 60
        assert prom.values('convgpu_process_waiting{container="held"}') == \
            {c + (("id", cid(prom, "held")), ("pid", str(held.pid))): 1}
        assert prom.values("convgpu_stalls_total") == {(("container", "held"), ("id", cid(prom, "held"))): 1,
                                                       (("container", "fits"), ("id", cid(prom, "fits"))): 0,
                                                       (("container", "over"), ("id", cid(prom, "over"))): 0}
        gpu = (("gpu", "0"),)
        for name, want in (("convgpu_gpu_capacity_bytes", 4 * GiB), ("convgpu_gpu_backstop_enabled", 1),
                           ("convgpu_gpu_unattributed_bytes", 256 * MiB), ("convgpu_gpu_memory_total_bytes", 5 * GiB),
                           ("convgpu_gpu_memory_used_bytes", (128 + 1024 + 256) * MiB),
                           ("convgpu_gpu_committed_bytes", committed(enf))):
            assert prom.values(name) == {gpu: want}, name
        assert prom.values("convgpu_probed_libraries") == {(): 1}
        assert prom.values('up{job="convgpu"}') == {(): 1}
        assert prom.values("convgpu_status_age_seconds")[()] < 3

        # every panel of the dashboard has data (a query that names a metric the enforcer does
        # not export, or a label it does not have, returns nothing)
        queried = {}
        for panel, target, expr in dashboard_targets():
            got = prom.until(lambda: prom.query(expr), 10, f"no data for {panel['title']!r}: {expr}")
            queried[(panel["id"], target["refId"])] = got
        assert len(queried) >= 25

        # a raised limit ends the wait: the grant shows, and the alert resolves
        assert enf.cli("limit", "set", "held", "1GiB").returncode == 0
        assert first_line(held, "allocated")[1:3] == ["1", str(512 * MiB)]
        prom.until(lambda: prom.alerts() == firing - {("ConvgpuContainerHeldLong", "held")}, 20, "held's alert resolved")
        prom.until(lambda: prom.values('convgpu_grants_total{container="held"}') == {
            (("container", "held"), ("id", cid(prom, "held"))): 1}, 10, "held's grant")
        assert {k[0][1]: v for k, v in prom.values("convgpu_container_used_bytes").items()}["held"] == 512 * MiB
        time.sleep(HOLD)
        if os.environ.get("CONVGPU_DASHBOARD_DUMP"):
            dump(prom, os.environ["CONVGPU_DASHBOARD_DUMP"])

        # the enforcer gone: its target is down, and its series are stale at once
        assert enf.stop() == 0
        prom.until(lambda: ("ConvgpuEnforcerDown", f"127.0.0.1:{port}") in prom.alerts(), 15, "enforcer down fires")
        assert prom.query("convgpu_container_limit_bytes") == []
        print(f"alerts fired {took:.1f} s after the over-limit container was stopped")
    finally:
        stop_all([fits, held, over, stray], enf)
        prom.close()


def cid(prom, name) -> str:
    [r] = prom.query(f'convgpu_container_limit_bytes{{container="{name}"}}')
    return r["metric"]["id"]


def committed(enf) -> int:
    return enf.ctl(cmd="status")["status"]["gpus"]["0"]["committed"]


def dump(prom, path):
    """Every dashboard query over the run (instant ones now), for bench/dashboard_render.py."""
    end = time.time()
    out = {"start": prom.started, "end": end, "panels": {}}
    for panel, target, expr in dashboard_targets():
        res = prom.query(expr) if target.get("instant") else prom.query_range(expr, prom.started, end, 1)
        out["panels"].setdefault(str(panel["id"]), {})[target["refId"]] = {"expr": expr, "result": res}
    with open(path, "w") as f:
        json.dump(out, f)
