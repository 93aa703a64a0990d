"""Limits from pods, without an enforcer: the pod-resources List answered by the test-side
kubelet (gRPC), container ids from the kubelet's log links, annotations from an API server
stand-in speaking HTTP/JSON to the real `kubernetes` client."""
import http.server
import json
import queue
import threading
import time
from urllib.parse import parse_qs, urlparse

import pytest

from convgpu.enforcer.tenants.limits import PodLimit
from convgpu.kube import api
from convgpu.kube.pods import ANNOTATION, ApiServerPods, Assigned, KubeletLogPods, PodMeta, limits, list_assigned
from kubelet_side import Kubelet

MiB = 1 << 20
UNIT = 256 * MiB
CID = {n: (c * 64) for n, c in (("train", "a"), ("side", "b"), ("infer", "c"), ("note", "d"))}
UID = {"trainer": "11111111-2222-3333-4444-555555555555", "server": "66666666-7777-8888-9999-000000000000",
       "notebook": "abcdefab-cdef-abcd-efab-cdefabcdefab"}


def pod(m, ns, name, *containers):
    return m.PodResources(namespace=ns, name=name, containers=[
        m.ContainerResources(name=c, devices=[m.ContainerDevices(resource_name=r, device_ids=i) for r, i in devs])
        for c, devs in containers])


@pytest.fixture
def listing(tmp_path):
    d = tmp_path / "device-plugins"
    d.mkdir()
    k = Kubelet(str(d), str(tmp_path / "pod-resources.sock"))
    m, _ = api.podresources()
    k.pods = [
        pod(m, "ml", "trainer", ("train", [("convgpu.io/gpu-memory", ["g::0", "g::1", "g::2"]),
                                           ("example.com/other", ["x"])]), ("side", [])),
        pod(m, "ml", "server", ("infer", [("convgpu.io/gpu-memory", ["g::3"])])),
        pod(m, "dev", "notebook", ("note", [])),
    ]
    k.start()
    yield str(tmp_path / "pod-resources.sock")
    k.stop()


def test_pod_resources_list_gives_each_containers_units(listing):
    assert list_assigned(listing) == [
        Assigned("ml", "trainer", "train", ("g::0", "g::1", "g::2")), Assigned("ml", "trainer", "side", ()),
        Assigned("ml", "server", "infer", ("g::3",)), Assigned("dev", "notebook", "note", ())]


def test_kubelet_log_links_name_container_ids(tmp_path):
    (tmp_path / "pods" / f"ml_trainer_{UID['trainer']}").mkdir(parents=True)
    (tmp_path / "pods" / f"ml_server_{UID['server']}").mkdir(parents=True)
    (tmp_path / "pods" / "not-a-pod-dir").mkdir(parents=True)
    (tmp_path / "containers").mkdir()
    for name in (f"trainer_ml_train-{CID['train']}.log", f"trainer_ml_side-{CID['side']}.log",
                 f"trainer_ml_train-{'e' * 64}.log",          # train restarted: a second id
                 "kube-proxy-x_kube-system_kube-proxy-123.log"):   # not a 64-hex id: ignored
        (tmp_path / "containers" / name).symlink_to("/nonexistent")
    got = KubeletLogPods(str(tmp_path)).pods()
    assert got == {("ml", "trainer"): PodMeta(UID["trainer"], {}, {"train": {CID["train"], "e" * 64},
                                                                   "side": {CID["side"]}}),
                   ("ml", "server"): PodMeta(UID["server"], {}, {})}


def test_limits_units_then_annotation_keyed_by_container_and_single_container_pod(listing):
    metas = {("ml", "trainer"): PodMeta(UID["trainer"], {ANNOTATION: "3GiB"}, {"train": {CID["train"]}, "side": {CID["side"]}},
                                        "Deployment/trainer"),
             ("ml", "server"): PodMeta(UID["server"], {}, {}),          # container not started yet; no owner known
             ("dev", "notebook"): PodMeta(UID["notebook"], {ANNOTATION: "1.5GiB"}, {"note": {CID["note"]}}, "StatefulSet/nb")}
    got = limits(list_assigned(listing), metas, UNIT)
    train = PodLimit(768 * MiB, "pod ml/trainer train: 3 x 256 MiB convgpu.io/gpu-memory", False, (("g", 768 * MiB),),
                     "ml/Deployment/trainer/train")
    note = PodLimit(1536 * MiB, f"pod dev/notebook annotation {ANNOTATION}", True, (), "dev/StatefulSet/nb/note")
    assert got == {
        CID["train"]: train,                                                  # units win
        CID["side"]: PodLimit(3 << 30, f"pod ml/trainer annotation {ANNOTATION}", True, (),
                              "ml/Deployment/trainer/side"),                   # only lowers
        UID["trainer"]: train,          # the pod's uid: its GPU container's grant, sidecar or not
        UID["server"]: PodLimit(256 * MiB, "pod ml/server infer: 1 x 256 MiB convgpu.io/gpu-memory",
                                False, (("g", 256 * MiB),), "ml/Pod/server/infer"),   # by pod uid; the pod is the job
        CID["note"]: note, UID["notebook"]: note}
    # a bad annotation is skipped (the enforcer's rules apply), units unaffected; the sidecar is
    # told "rules" (0, lower_only) so that it does not fall back to its pod's grant
    metas[("dev", "notebook")].annotations[ANNOTATION] = "lots"
    metas[("ml", "trainer")].annotations.clear()
    got = limits(list_assigned(listing), metas, UNIT)
    assert sorted(got) == sorted([CID["train"], CID["side"], UID["trainer"], UID["server"]])
    assert got[CID["side"]] == PodLimit(0, "pod ml/trainer side: no convgpu.io/gpu-memory", True, (),
                                        "ml/Deployment/trainer/side")


def test_a_pods_owner_is_its_controller_and_a_deployments_replica_set_names_the_deployment():
    from types import SimpleNamespace as R
    from convgpu.kube.pods import owner

    def ref(kind, name, controller=True):
        return R(kind=kind, name=name, controller=controller)
    hashed = {"pod-template-hash": "5d4f8c9b7"}
    assert owner([ref("ReplicaSet", "web-5d4f8c9b7")], hashed) == "Deployment/web"
    assert owner([ref("ReplicaSet", "web-5d4f8c9b7")], {}) == "ReplicaSet/web-5d4f8c9b7"     # a bare ReplicaSet
    assert owner([ref("ReplicaSet", "other-1")], hashed) == "ReplicaSet/other-1"
    assert owner([ref("Job", "train-28811520")], None) == "Job/train-28811520"
    assert owner([ref("Node", "n1", controller=False), ref("StatefulSet", "db")], None) == "StatefulSet/db"
    assert owner([ref("Job", "x", controller=None)], None) == "" and owner(None, None) == ""


def test_an_annotation_lowers_units_never_raises_them_and_a_split_grant_has_shares(listing):
    """Row 10 of docs/SECURITY.md on the agent's side: an annotation above the units changes
    nothing, below them lowers the grant and each GPU's share; units over two GPUs keep each
    GPU's share (issue 26 item 1)."""
    ids = [f"GPU-a::{i}" for i in range(3)] + ["GPU-b::0"]
    one = [Assigned("ml", "big", "train", tuple(ids))]
    meta = {("ml", "big"): PodMeta(UID["trainer"], {ANNOTATION: "64GiB"}, {"train": {CID["train"]}})}
    got = limits(one, meta, UNIT)[CID["train"]]
    assert (got.bytes, got.lower_only, got.gpus) == (4 * UNIT, False, (("GPU-a", 3 * UNIT), ("GPU-b", UNIT)))
    meta[("ml", "big")].annotations[ANNOTATION] = "512MiB"
    got = limits(one, meta, UNIT)[CID["train"]]
    assert (got.bytes, got.gpus) == (512 * MiB, (("GPU-a", 512 * MiB), ("GPU-b", UNIT)))
    assert got.source.endswith(f"lowered by annotation {ANNOTATION}")


def _pod(name, uid, cid, annotations=None, rv="10"):
    return {"metadata": {"name": name, "namespace": "ml", "uid": uid, "resourceVersion": rv,
                         "annotations": annotations or {}},
            "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "main"}]},
            "status": {"containerStatuses": [{"name": "main", "containerID": f"containerd://{cid}", "image": "i",
                                              "imageID": "", "ready": True, "restartCount": 0}] if cid else []}}


def test_api_server_pods_one_cached_list_then_a_watch(tmp_path, monkeypatch):
    """Issue 26 item 6: one list served from the API server's cache (resourceVersion=0), then a
    watch from the list's version; a pod added and another's container id learned later come
    through the watch, and asking pods() again and again asks the API server nothing."""
    seen, events, done = [], queue.Queue(), threading.Event()
    listed = {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": [
        _pod("trainer", UID["trainer"], CID["train"], {ANNOTATION: "2GiB"}), _pod("server", UID["server"], None)]}

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"     # the watch's events in chunks, as the API server sends them

        def do_GET(self):
            u = urlparse(self.path)
            q = parse_qs(u.query)
            seen.append((u.path, {k: v for k, v in q.items() if k not in ("timeoutSeconds", "allowWatchBookmarks")}))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if q.get("watch") != ["true"]:
                data = json.dumps(listed).encode()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while not done.is_set():     # the watch: events as the test makes them, until the end
                try:
                    ev = (json.dumps(events.get(timeout=0.1)) + "\n").encode()
                except queue.Empty:
                    continue
                self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                self.wfile.flush()
            self.close_connection = True

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _kubeconfig(tmp_path, monkeypatch, srv.server_address[1])
    src = ApiServerPods("gpu-node-1")
    try:
        got = src.pods()
        assert got == {("ml", "trainer"): PodMeta(UID["trainer"], {ANNOTATION: "2GiB"}, {"main": {CID["train"]}}),
                       ("ml", "server"): PodMeta(UID["server"], {}, {})}
        events.put({"type": "MODIFIED", "object": _pod("server", UID["server"], CID["infer"], rv="11")})
        events.put({"type": "ADDED", "object": _pod("notebook", UID["notebook"], CID["note"], rv="12")})
        events.put({"type": "DELETED", "object": _pod("trainer", UID["trainer"], CID["train"], rv="13")})
        end = time.monotonic() + 10
        while src.pods().get(("ml", "notebook")) is None or ("ml", "trainer") in src.pods():
            assert time.monotonic() < end, src.pods()
            time.sleep(0.02)
        for _ in range(100):
            got = src.pods()
        assert got == {("ml", "server"): PodMeta(UID["server"], {}, {"main": {CID["infer"]}}),
                       ("ml", "notebook"): PodMeta(UID["notebook"], {}, {"main": {CID["note"]}})}
        sel = ["spec.nodeName=gpu-node-1"]
        assert seen == [("/api/v1/pods", {"fieldSelector": sel, "resourceVersion": ["0"],
                                          "resourceVersionMatch": ["NotOlderThan"]}),
                        ("/api/v1/pods", {"fieldSelector": sel, "resourceVersion": ["10"], "watch": ["true"]})]
        assert src.lists == 1
    finally:
        src.stop.set()
        done.set()
        srv.shutdown()
        srv.server_close()


def _kubeconfig(tmp_path, monkeypatch, port):
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "x"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


class _Control:
    """A stand-in enforcer control socket (JSON lines): answers ping with `pid`, records pod-limits."""

    def __init__(self, path):
        from convgpu.enforcer.serving.server import Handler, Server
        ctl = self
        self.pid, self.got = 100, []

        class H(Handler):
            def handle(self, peer, msg):
                if msg["cmd"] == "ping":
                    return {"ok": True, "pid": ctl.pid}
                ctl.got.append(msg)
                return {"ok": True, "keys": len(msg["limits"]), "changed": 0}
        self.server = Server(path, H(), root_only=False)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        from convgpu.enforcer.serving import server
        while not self.stop.is_set():
            server.serve(self.server.sel, 0.05)


def test_pod_sync_sends_on_change_and_to_a_restarted_enforcer(listing, tmp_path):
    from convgpu.kube.pods import PodSync
    ctl = _Control(str(tmp_path / "control.sock"))
    (tmp_path / "log" / "pods" / f"ml_server_{UID['server']}").mkdir(parents=True)
    try:
        sync = PodSync(str(tmp_path / "control.sock"), [KubeletLogPods(str(tmp_path / "log"))], UNIT, listing)
        want = {UID["server"]: PodLimit(UNIT, "pod ml/server infer: 1 x 256 MiB convgpu.io/gpu-memory",
                                        False, (("g", UNIT),), "ml/Pod/server/infer")}   # no API server: no owner
        assert sync.round() == want and sync.round() == want
        assert ctl.got == [{"cmd": "pod-limits", "limits": {UID["server"]: [
            UNIT, want[UID["server"]][1], {"lower_only": False, "gpus": {"g": UNIT}, "job": "ml/Pod/server/infer"}]}}]
        ctl.pid = 101                       # a new enforcer knows nothing: sent again
        sync.round()
        assert len(ctl.got) == 2
        (tmp_path / "log" / "pods" / f"ml_trainer_{UID['trainer']}").mkdir()   # trainer has 2 containers:
        sync.round()                                        # keyed by uid all the same (the GPU one's grant)
        assert len(ctl.got) == 3 and ctl.got[-1]["limits"][UID["trainer"]][0] == 3 * UNIT
        (tmp_path / "log" / "containers").mkdir()
        (tmp_path / "log" / "containers" / f"trainer_ml_train-{CID['train']}.log").symlink_to("/nonexistent")
        assert sync.round()[CID["train"]][:2] == (3 * UNIT, "pod ml/trainer train: 3 x 256 MiB convgpu.io/gpu-memory")
        assert len(ctl.got) == 4 and set(ctl.got[-1]["limits"]) == {UID["server"], UID["trainer"], CID["train"]}
    finally:
        ctl.stop.set()
        ctl.thread.join(timeout=5)


def test_pod_sync_asks_a_source_with_a_ttl_again_only_when_it_must(listing, tmp_path):
    from convgpu.kube import pods
    ctl = _Control(str(tmp_path / "control.sock"))
    clock = [1000.0]

    class Api:
        ttl = 30.0
        calls = 0
        known = {("ml", "trainer"): PodMeta(UID["trainer"], {}, {"train": {CID["train"]}}),
                 ("ml", "server"): PodMeta(UID["server"], {}, {"infer": {CID["infer"]}})}

        def pods(self):
            Api.calls += 1
            return dict(Api.known)
    try:
        sync = pods.PodSync(str(tmp_path / "control.sock"), [Api()], UNIT, listing, clock=lambda: clock[0])
        sync.round()
        assert Api.calls == 1                 # dev/notebook is unknown to it: asked again after 2 s
        clock[0] += 1
        sync.round()
        assert Api.calls == 1
        clock[0] += 1
        sync.round()
        assert Api.calls == 2
        Api.known[("dev", "notebook")] = PodMeta(UID["notebook"], {}, {})
        clock[0] += 2
        sync.round()
        assert Api.calls == 3                 # now everything is known: only the ttl
        clock[0] += 29
        sync.round()
        assert Api.calls == 3
        clock[0] += 1
        assert sync.round()[CID["infer"]][:2] == (UNIT, "pod ml/server infer: 1 x 256 MiB convgpu.io/gpu-memory")
        assert Api.calls == 4
    finally:
        ctl.stop.set()
        ctl.thread.join(timeout=5)
