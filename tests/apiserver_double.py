"""A stand-in for the API server's resource.k8s.io/v1 paths the DRA plugin uses, over real HTTP,
so that the `kubernetes` client talks to it as to a real one: it GETs ResourceClaims, lists,
creates, replaces and deletes ResourceSlices. Objects are kept as the JSON the API serves
(camelCase); errors are Status objects with the API's codes (404, 409 on a stale
resourceVersion). Claims are built by the tests from the client's own models
(claim(...) below), so their field names are the schema's, not typed by hand."""
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

BASE = "/apis/resource.k8s.io/v1"


class ApiServer:
    def __init__(self):
        self.claims: dict = {}       # (namespace, name) -> the claim's JSON (or raw bytes: malformed)
        self.slices: dict = {}       # name -> the slice's JSON, as stored
        self.writes: list = []       # (verb, slice name) in order
        self.version = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def client(self):
        """A `kubernetes` ApiClient for this server."""
        from kubernetes import client
        cfg = client.Configuration(host=self.url)
        return client.ApiClient(cfg)

    def kubeconfig(self, path) -> str:
        """A kubeconfig file naming this server (for `convgpu kube --dra` in a subprocess)."""
        with open(path, "w") as f:
            json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "double",
                       "clusters": [{"name": "double", "cluster": {"server": self.url}}],
                       "users": [{"name": "double", "user": {"token": "t"}}],
                       "contexts": [{"name": "double", "context": {"cluster": "double", "user": "double"}}]}, f)
        return os.fspath(path)

    def put_claim(self, obj, raw: bytes | None = None):
        """A claim: a model of the client, serialized as the API would; `raw`: these bytes are
        served for it instead (a malformed object)."""
        from kubernetes.client import ApiClient
        doc = ApiClient().sanitize_for_serialization(obj)
        self.claims[(doc["metadata"]["namespace"], doc["metadata"]["name"])] = raw if raw is not None else doc

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _status(self, code, reason, message):
                self._send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                  "message": message, "reason": reason, "code": code})

            def _body(self):
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def do_GET(self):
                u = urlparse(self.path)
                parts = u.path[len(BASE):].strip("/").split("/")
                if u.path.startswith(BASE + "/namespaces/") and len(parts) == 4 and parts[2] == "resourceclaims":
                    got = server.claims.get((parts[1], parts[3]))
                    if got is None:
                        return self._status(404, "NotFound", f'resourceclaims "{parts[3]}" not found')
                    return self._send(200, got if isinstance(got, bytes) else got)
                if parts == ["resourceslices"]:
                    sel = dict(kv.split("=", 1) for kv in parse_qs(u.query).get("fieldSelector", [""])[0].split(",") if kv)
                    items = [s for s in server.slices.values()
                             if sel.get("spec.nodeName", s["spec"].get("nodeName")) == s["spec"].get("nodeName")
                             and sel.get("spec.driver", s["spec"]["driver"]) == s["spec"]["driver"]]
                    return self._send(200, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                                            "metadata": {"resourceVersion": str(server.version)}, "items": items})
                if len(parts) == 2 and parts[0] == "resourceslices" and parts[1] in server.slices:
                    return self._send(200, server.slices[parts[1]])
                return self._status(404, "NotFound", f"{u.path} not found")

            def _store(self, obj, created):
                with server.lock:
                    server.version += 1
                    obj["metadata"]["resourceVersion"] = str(server.version)
                    server.slices[obj["metadata"]["name"]] = obj
                    server.writes.append(("create" if created else "replace", obj["metadata"]["name"]))
                self._send(201 if created else 200, obj)

            def do_POST(self):
                obj = self._body()
                if self.path.split("?")[0] != BASE + "/resourceslices":
                    return self._status(404, "NotFound", self.path)
                if obj["metadata"]["name"] in server.slices:
                    return self._status(409, "AlreadyExists", "already exists")
                self._store(obj, True)

            def do_PUT(self):
                obj = self._body()
                name = self.path.split("?")[0].rsplit("/", 1)[1]
                old = server.slices.get(name)
                if old is None:
                    return self._status(404, "NotFound", name)
                if obj["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
                    return self._status(409, "Conflict", "the object has been modified")
                self._store(obj, False)

            def do_DELETE(self):
                name = self.path.split("?")[0].rsplit("/", 1)[1]
                with server.lock:
                    gone = server.slices.pop(name, None)
                    server.writes.append(("delete", name))
                if gone is None:
                    return self._status(404, "NotFound", name)
                self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}})
        return Handler


def claim(namespace, name, uid, pods, results, driver="gpu-memory.convgpu.io", pool="node-a", admin=False):
    """A ResourceClaim allocated by the scheduler, built from the client's models.
    pods: [(name, uid)]; results: [(request, device, memory quantity or None, share id)];
    admin: its requests ask adminAccess (DRAAdminAccess), and its results have it."""
    from kubernetes import client as k
    return k.ResourceV1ResourceClaim(
        api_version="resource.k8s.io/v1", kind="ResourceClaim",
        metadata=k.V1ObjectMeta(namespace=namespace, name=name, uid=uid),
        spec=k.V1ResourceClaimSpec(devices=k.V1DeviceClaim(requests=[
            k.V1DeviceRequest(name=r[0], exactly=k.V1ExactDeviceRequest(
                device_class_name="gpu-memory.convgpu.io", admin_access=admin or None,
                capacity=k.V1CapacityRequirements(requests={"memory": r[2]}) if r[2] else None))
            for r in results])),
        status=k.V1ResourceClaimStatus(
            allocation=k.V1AllocationResult(devices=k.V1DeviceAllocationResult(results=[
                k.V1DeviceRequestAllocationResult(request=r[0], driver=driver, pool=pool, device=r[1], share_id=r[3],
                                                  consumed_capacity={"memory": r[2]} if r[2] else None,
                                                  admin_access=admin or None)
                for r in results])),
            reserved_for=[k.V1ResourceClaimConsumerReference(resource="pods", name=n, uid=u) for n, u in pods]))
