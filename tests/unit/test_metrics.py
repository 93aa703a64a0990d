"""The metrics through prometheus_client: label values escaped and read back exactly, the
per-process and per-GPU families, content negotiation, and a server that closes and never keeps
the process alive. No root: the server binds 127.0.0.1 on a free port."""
import socket
import subprocess
import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from convgpu.enforcer.metrics import MetricsServer, StatusCollector, render
from convgpu.probes.nvml import GpuInfo
from convgpu.probes.tracer import ProcUsage
from conftest import prom_samples

GiB = 1 << 30
MiB = 1 << 20
NASTY = 'say "hi" \\ then\nnew line'   # a double quote, a backslash and a newline


def row(pid, dev, live, contexts):
    return ProcUsage(pid=pid, dev=dev, gen=1, cgroup_id=7, comm="x", live=live, peak=live, n_alloc=1, n_free=0,
                     bytes_alloc=live, bytes_free=0, n_failed=0, contexts=contexts, last_ns=0)


def status(name=NASTY):
    return {"ctx_overhead": None, "unchecked_calls": 4,   # the per-GPU estimate counts, not the flag
            "gpus": {"0": {"capacity": 5 * GiB, "assigned": 3 * GiB, "ctx_estimate": {"bytes": 300 * MiB}}},
            "containers": [{"name": name, "id": "abc", "limit": 2 * GiB, "stalled_s": 1.5, "stalls": 3, "grants": 2,
                            "over_limit_events": 1, "pids": [41, 42, 43],
                            "gpus": {"0": {"assigned": GiB, "used": 512, "context_overhead": 7, "waiting": True,
                                           "waiting_pids": [42, 43]}}}]}


def labels_of(text, name, parse=text_string_to_metric_families):
    return [s.labels for f in parse(text) for s in f.samples if s.name == name]


def test_a_container_name_with_quotes_a_backslash_and_a_newline_is_escaped():
    text = render(status(), usage=[row(41, 0, GiB, 1)])
    # on the wire: one sample a line, the three characters escaped as the format says
    [line] = [x for x in text.splitlines() if x.startswith("convgpu_container_limit_bytes{")]
    assert 'container="say \\"hi\\" \\\\ then\\nnew line"' in line
    assert all(x.startswith(("#", "convgpu_")) for x in text.splitlines())
    # read back by prometheus_client's parser: the very name, in every family that carries it
    for name in ("convgpu_container_limit_bytes", "convgpu_stalls_total", "convgpu_process_memory_used_bytes"):
        assert {lab["container"] for lab in labels_of(text, name)} == {NASTY}, name


def test_families_per_container_process_and_gpu():
    nv = GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", total=80 * GiB, used=9 * GiB, uuid="GPU-1234")
    text = render(status("train"), usage=[row(41, 0, 2 * GiB, 1), row(42, 0, 0, 1), row(99, 0, MiB, 0)],
                  excess={(41, 0): (500 * MiB, 1)}, gpus=[nv])   # Charges.excess: NVML's 500 MiB for 1 context
    c = (("container", "train"), ("id", "abc"))

    def p(pid, container=c):
        return (("container", container[0][1]), ("gpu", "0"), ("id", container[1][1]), ("pid", str(pid)))
    nobody = (("container", ""), ("id", ""))
    want = {
        ("convgpu_container_limit_bytes", c[:1] + (("gpu", "0"),) + c[1:], 2 * GiB),
        ("convgpu_container_waiting", c[:1] + (("gpu", "0"),) + c[1:], 1),
        ("convgpu_container_stalled_seconds_total", c, 1.5),   # the container's, once (not per GPU)
        ("convgpu_stalls_total", c, 3), ("convgpu_grants_total", c, 2), ("convgpu_over_limit_total", c, 1),
        # per process: live bytes; the per-context charge plus NVML's measured excess; stalled or not
        ("convgpu_process_memory_used_bytes", p(41), 2 * GiB),
        ("convgpu_process_context_overhead_bytes", p(41), 500 * MiB),
        ("convgpu_process_waiting", p(41), 0),
        ("convgpu_process_memory_used_bytes", p(42), 0),
        ("convgpu_process_context_overhead_bytes", p(42), 300 * MiB),
        ("convgpu_process_waiting", p(42), 1),
        ("convgpu_process_waiting", p(43), 1),     # stopped before the probes had a row for it
        ("convgpu_process_memory_used_bytes", p(99, nobody), MiB),   # in no container convgpu knows
        # per GPU: convgpu's books, then NVML's card
        ("convgpu_gpu_capacity_bytes", (("gpu", "0"),), 5 * GiB),
        ("convgpu_gpu_assigned_bytes", (("gpu", "0"),), 3 * GiB),
        ("convgpu_gpu_memory_total_bytes", (("gpu", "0"),), 80 * GiB),
        ("convgpu_gpu_memory_used_bytes", (("gpu", "0"),), 9 * GiB),
        ("convgpu_gpu_info", (("gpu", "0"), ("name", "NVIDIA H100 80GB HBM3"), ("uuid", "GPU-1234")), 1),
        ("convgpu_unchecked_calls_total", (), 4),
    }
    got = prom_samples(text)
    assert want <= got, sorted(want - got)
    assert not [s for s in got if s[0] == "convgpu_process_memory_used_bytes" and ("pid", "43") in s[1]]
    assert "# TYPE convgpu_gpu_info gauge" in text.splitlines()


class FakeNvml:
    ok = True

    def __init__(self, fail=False):
        self.fail = fail

    def gpus(self):
        if self.fail:
            raise RuntimeError("NVML_ERROR_UNINITIALIZED")
        return [GpuInfo(index=0, name="H100", total=80 * GiB, used=GiB, uuid="GPU-1")]


def test_collector_reads_nvml_at_scrape_time_and_survives_its_errors():
    col = StatusCollector(FakeNvml())
    col.publish(status(), [row(41, 0, GiB, 1)], {})
    names = {f.name for f in col.collect()}
    assert {"convgpu_gpu_memory_total_bytes", "convgpu_gpu_memory_used_bytes", "convgpu_process_memory_used_bytes"} <= names
    col.nvml = FakeNvml(fail=True)
    names = {f.name for f in col.collect()}
    assert "convgpu_container_limit_bytes" in names and "convgpu_gpu_memory_used_bytes" not in names


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port, accept=None, query=""):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics{query}", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


def test_server_negotiates_the_format_and_closes():
    port = free_port()
    srv = MetricsServer(port, "127.0.0.1", nvml=FakeNvml())
    try:
        assert srv.thread.daemon   # never what keeps the enforcer's process alive
        srv.publish(status(), [row(41, 0, GiB, 1)], {})
        ctype, text = scrape(port)   # no Accept header: Prometheus text 0.0.4
        assert ctype.startswith("text/plain; version=0.0.4")
        assert ("convgpu_container_used_bytes", (("container", NASTY), ("gpu", "0"), ("id", "abc")), 512) \
            in prom_samples(text)
        ctype, text = scrape(port, "application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
        assert ctype.startswith("application/openmetrics-text; version=1.0.0")
        assert text.endswith("# EOF\n")
        fams = {f.name: f for f in om_families(text)}   # the strict parser: the whole exposition is valid
        assert fams["convgpu_stalls"].type == "counter"
        assert [(s.name, s.labels["container"], s.value) for s in fams["convgpu_stalls"].samples] == \
            [("convgpu_stalls_total", NASTY, 3)]
        assert fams["convgpu_gpu_memory_total_bytes"].samples[0].value == 80 * GiB
        # ?name[]= : only the families asked for (the registry knows them from describe())
        _, text = scrape(port, query="?name[]=convgpu_gpu_memory_used_bytes&name[]=convgpu_stalls_total")
        assert prom_samples(text) == {("convgpu_gpu_memory_used_bytes", (("gpu", "0"),), GiB),
                                      ("convgpu_stalls_total", (("container", NASTY), ("id", "abc")), 3)}
    finally:
        srv.close()
    assert not srv.thread.is_alive()
    with socket.socket() as s:   # the port is free again at once
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_an_open_server_does_not_keep_the_process_alive():
    code = ("from convgpu.enforcer.metrics import MetricsServer\n"
            "m = MetricsServer(0, '127.0.0.1')\nprint(m.port)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and int(r.stdout) > 0, r.stderr


def test_tenant_chosen_label_values_are_bounded_in_length_and_stay_distinct():
    """A container's name is whatever its owner typed: 10,000 characters would be a series of
    that size (and a scrape Prometheus refuses whole past its label_value_length_limit). Cut
    to 64 characters, with a hash of the whole: the same name gives the same value, two that
    share their first 100 characters stay apart. An engine's 64-hex id passes whole."""
    from convgpu.enforcer.families import MAX_LABEL
    long_a, long_b = "x" * 100 + "a" * 9900, "x" * 100 + "b" * 9900
    st = status(long_a)
    st["containers"].append(dict(st["containers"][0], name=long_b, id="/convgpu.run/" + "y" * 5000, pids=[]))
    st["containers"][0]["id"] = "c" * 64
    got = prom_samples(render(st, usage=[row(41, 0, GiB, 1)]))
    names = {dict(s[1])["container"] for s in got if s[0] == "convgpu_container_limit_bytes"}
    ids = {dict(s[1])["id"] for s in got if s[0] == "convgpu_container_limit_bytes"}
    assert len(names) == 2 and all(len(n) == MAX_LABEL and n.startswith("x" * 51) for n in names), names
    assert "c" * 64 in ids and all(len(i) <= MAX_LABEL for i in ids), ids
    again = prom_samples(render(st, usage=[row(41, 0, GiB, 1)]))   # the same name: the same series
    assert names == {dict(s[1])["container"] for s in again if s[0] == "convgpu_container_limit_bytes"}
    for s in got:
        assert all(len(v) <= MAX_LABEL for k, v in s[1] if k in ("container", "id")), s


def test_a_container_of_a_thousand_processes_makes_nine_process_series_a_family():
    """--max-processes lets one container have 1,024 processes: by pid that was 3 series each,
    and one tenant could push the node's scrape past Prometheus's sample_limit (which fails it
    whole). At most 8 by pid (those waiting first, then those holding most), the rest summed
    as pid "other"."""
    st = status("train")
    st["containers"][0]["pids"] = list(range(1000, 2000))
    st["containers"][0]["gpus"]["0"]["waiting_pids"] = [1500]
    usage = [row(pid, 0, (pid - 1000) * MiB, 1) for pid in range(1000, 2000)]
    got = prom_samples(render(st, usage=usage))
    used = {dict(s[1])["pid"]: s[2] for s in got if s[0] == "convgpu_process_memory_used_bytes"}
    assert set(used) == {"1500", "1999", "1998", "1997", "1996", "1995", "1994", "1993", "other"}
    assert used["other"] == sum(range(1000)) * MiB - sum(used[p] for p in used if p != "other")
    waiting = {dict(s[1])["pid"]: s[2] for s in got if s[0] == "convgpu_process_waiting"}
    assert waiting["1500"] == 1 and waiting["other"] == 0 and sum(waiting.values()) == 1
    ctx = {dict(s[1])["pid"]: s[2] for s in got if s[0] == "convgpu_process_context_overhead_bytes"}
    assert ctx["other"] == 992 * 300 * MiB and ctx["1999"] == 300 * MiB   # the GPU's estimate each
