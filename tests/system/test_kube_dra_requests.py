"""Issue 48, the DRA plugin and the enforcer: one deadline per request, not per claim; nothing kept
that the kubelet was told had failed; an answer for every claim of a request; and the test-side
kubelet sees a restarted plugin (tests/kubelet_side.py watches its registration dir with inotify,
as the kubelet's plugin watcher does, not by inode number, which this filesystem reuses). A real
enforcer on the stand-in driver, the plugin over gRPC, claims read from the API-server double."""
import contextlib
import os
import sys
import threading
import time

import pytest

from apiserver_double import ApiServer, claim
from conftest import GiB, MiB, inprocess_enforcer, serving, until
from convgpu.kube import devices as dv
from convgpu.kube.dra import CdiDir, DraPlugin, Enforcer
from kubelet_side import DraKubelet

pytestmark = pytest.mark.system
DRIVER, NODE = "gpu-memory.convgpu.io", "node-a"
POD = "a1a1a1a1-1111-4111-8111-111111111111"


def plugin_for(short_tmp, srv, enf, timeout=10.0, gpus=None) -> DraPlugin:
    from kubernetes.client import ResourceV1Api
    client = srv.client()
    (short_tmp / "dev").mkdir(exist_ok=True)
    (short_tmp / "dev" / "nvidia0").touch()
    return DraPlugin(NODE, gpus or [dv.Gpu(0, 4 * GiB)],
                     lambda ns, name: ResourceV1Api(client).read_namespaced_resource_claim(name, ns),
                     Enforcer(enf.control_path, timeout), CdiDir(str(short_tmp / "cdi")), str(short_tmp / "registry"),
                     str(short_tmp / "plugins"), dev_root=str(short_tmp / "dev"))


@contextlib.contextmanager
def looping(enf):
    """The loop of an enforcer already started, in a thread, for the with-block."""
    done = threading.Event()

    def step(events):
        if done.is_set():
            sys.exit()

    def run():
        try:
            enf.run(120, on_step=step)
        except SystemExit:
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield enf
    finally:
        done.set()
        t.join(timeout=10)


def test_a_stalled_enforcer_costs_one_timeout_per_request_and_keeps_nothing_it_was_told_failed(root, build, short_tmp):
    """The enforcer is started (its control socket accepts) but its loop does not run: a Prepare
    of two claims waits for it once (3 s here), not once per claim (it took 2 x 10 s), and both
    claims fail. When the loop runs again it reads the request the plugin gave up on and keeps
    nothing (it used to keep both: `holds: ['team/c-1gi', 'team/z']`). The kubelet asks again:
    both are prepared."""
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-stalled", 4 * GiB)
    srv = ApiServer().start()
    one, two = ("team", "0b000000-0000-4000-8000-000000000001", "c-1gi"), ("team", "0b000000-0000-4000-8000-000000000002", "z")
    srv.put_claim(claim("team", "c-1gi", one[1], [("p", POD)], [("gpu", "gpu-0", "1Gi", None)]))
    srv.put_claim(claim("team", "z", two[1], [("p", POD)], [("gpu", "gpu-0", "512Mi", None)]))
    kubelet = DraKubelet(str(short_tmp / "registry"))
    enf.start()
    try:
        plugin = plugin_for(short_tmp, srv, enf, timeout=3.0)
        plugin.serve()
        kubelet.start()
        assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
        t0 = time.monotonic()
        got = kubelet.prepare(DRIVER, [one, two])
        took = time.monotonic() - t0
        assert all(r.error.startswith("the enforcer does not answer on ") for r in got.values()), got
        assert 2.5 <= took < 4.5, took                      # one timeout for the request
        assert os.listdir(short_tmp / "cdi") == []          # told failed: no spec left
        with looping(enf):
            until(lambda: enf.durable.writes == 0 and _answers(enf), 10, "the enforcer's loop answering")
            time.sleep(0.5)                                 # the request it read late is decided by now
            assert enf.rules.claims == {} and enf.durable.value.claims == {}
            got = kubelet.prepare(DRIVER, [one, two])       # the kubelet asks again
            assert {u: r.error for u, r in got.items()} == {one[1]: "", two[1]: ""}
            assert sorted(c.ref for c in enf.rules.claims.values()) == ["team/c-1gi", "team/z"]
            assert plugin.abandoned == set()
            plugin.close()
    finally:
        kubelet.stop()
        srv.stop()
        enf.close()


def _answers(enf) -> bool:
    from convgpu.enforcer.serving.server import request
    try:
        return request(enf.control_path, {"cmd": "ping"}, timeout=1)["ok"]
    except OSError:
        return False


def test_every_claim_of_a_request_gets_an_answer(root, build, short_tmp):
    """1,030 claims in one Prepare (6 got no answer: only the first 1,024 were looked at), decided
    by the enforcer in one call; then one Unprepare of them all."""
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-many", 4 * GiB)
    srv = ApiServer().start()
    claims = [("team", f"0c000000-0000-4000-8000-{i:012x}", f"c{i}") for i in range(1030)]
    for ns, uid, name in claims:
        srv.put_claim(claim(ns, name, uid, [("p", POD)], [("gpu", "gpu-0", "1Mi", None)]))
    kubelet = DraKubelet(str(short_tmp / "registry"))
    kubelet.call_timeout = 300
    try:
        with serving(enf):
            plugin = plugin_for(short_tmp, srv, enf, timeout=240)
            plugin.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
            writes = enf.durable.writes
            got = kubelet.prepare(DRIVER, claims)
            assert len(got) == 1030 and {r.error for r in got.values()} == {""}
            assert len(enf.rules.claims) == 1030 and sum(c.bytes for c in enf.rules.claims.values()) == 1030 * MiB
            assert enf.durable.writes == writes + 1         # decided together: one write
            assert len(os.listdir(short_tmp / "cdi")) == 1030
            got = kubelet.unprepare(DRIVER, claims)
            assert len(got) == 1030 and {r.error for r in got.values()} == {""}
            assert enf.rules.claims == {} and os.listdir(short_tmp / "cdi") == []
            plugin.close()
    finally:
        kubelet.stop()
        srv.stop()


def test_a_restarted_plugin_is_registered_again(root, build, short_tmp):
    """The plugin stops (its sockets go) and a new one starts on the same paths: the kubelet
    registers it again, and calls it. Its new registration socket has the old one's inode number
    here: a kubelet that tracked inodes never saw it."""
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-restart", 4 * GiB)
    srv = ApiServer().start()
    c = ("team", "0d000000-0000-4000-8000-000000000001", "c")
    srv.put_claim(claim(*c[:1], c[2], c[1], [("p", POD)], [("gpu", "gpu-0", "1Gi", None)]))
    kubelet = DraKubelet(str(short_tmp / "registry"))
    try:
        with serving(enf):
            first = plugin_for(short_tmp, srv, enf)
            first.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
            first.close()
            second = plugin_for(short_tmp, srv, enf)
            second.serve()
            info, chosen = kubelet.registrations.get(timeout=10)
            assert (info.name, chosen, second.registered) == (DRIVER, "v1.DRAPlugin", 1)
            assert kubelet.prepare(DRIVER, [c])[c[1]].error == ""
            second.close()
    finally:
        kubelet.stop()
        srv.stop()


def test_an_invalid_cdi_spec_is_never_answered_ok(root, build, short_tmp, monkeypatch):
    """Every spec Prepare answers OK for passes the CDI library's checks (kube/cdi.py validate):
    with no /dev/nvidia* under the device root the spec had `"deviceNodes": []`, which the library
    refuses ("invalid device, empty device edits"), and Prepare answered OK. Now the device's
    edits hold NVIDIA_VISIBLE_DEVICES=void (its nodes come from NVIDIA's spec, named beside it);
    with no NVIDIA spec named (--cdi '') the claim is refused; and a spec that fails the check is
    refused, its file removed, nothing kept by the enforcer."""
    from convgpu.kube import cdi
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "dra-cdi", 4 * GiB)
    srv = ApiServer().start()
    a, b, c = [("team", f"0e000000-0000-4000-8000-00000000000{i}", f"c{i}") for i in range(3)]
    for ns, uid, name in (a, b, c):
        srv.put_claim(claim(ns, name, uid, [("p", POD)], [("gpu", "gpu-0", "1Gi", None)]))
    kubelet = DraKubelet(str(short_tmp / "registry"))
    try:
        with serving(enf):
            plugin = plugin_for(short_tmp, srv, enf)
            plugin.dev_root = str(short_tmp / "no-dev")       # no /dev/nvidia* under it
            plugin.serve()
            kubelet.start()
            assert kubelet.registrations.get(timeout=10)[1] == "v1.DRAPlugin"
            assert kubelet.prepare(DRIVER, [a])[a[1]].error == ""
            import json
            spec = json.loads((short_tmp / "cdi" / f"convgpu-claim-{a[1]}.json").read_text())
            assert all(any(d["containerEdits"].values()) for d in spec["devices"]), spec["devices"]   # no empty edits
            cdi.validate(spec)
            assert spec["cdiVersion"] == "0.5.0" and "NVIDIA_VISIBLE_DEVICES=void" in spec["devices"][0]["containerEdits"]["env"]
            plugin.cdi_kind = ""                                # no NVIDIA spec named: no GPU for its containers
            got = kubelet.prepare(DRIVER, [b])[b[1]].error
            assert got == (f"claim team/c1: no device node of its GPU under {short_tmp / 'no-dev'}, and no CDI kind "
                           "(--cdi) names NVIDIA's spec: its containers would get no GPU"), got
            real = cdi.spec
            monkeypatch.setattr(cdi, "spec", lambda *args: {**real(*args), "containerEdits": {"env": ["=oops"]}})
            plugin.cdi_kind = "nvidia.com/gpu"
            got = kubelet.prepare(DRIVER, [c])[c[1]].error
            assert got == ("claim team/c2: its CDI spec would be refused by the runtime: spec env: invalid "
                           "environment variable '=oops'"), got
            assert sorted(os.listdir(short_tmp / "cdi")) == [f"convgpu-claim-{a[1]}.json"]
            assert sorted(enf.rules.claims) == [a[1]]
            plugin.close()
    finally:
        kubelet.stop()
        srv.stop()
