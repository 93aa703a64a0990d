"""Optional names, labels and images from container engines. Never required: the cgroup path
already identifies a container (containers.py). Never blocking: lookup() answers from a cache at
once and fetches in the background, because podman/crictl can take seconds to answer and the
caller is the event loop that accounts allocations."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

from .containers import _HEX64, Container

log = logging.getLogger(__name__)

DOCKER_SOCKET = "/var/run/docker.sock"


@dataclass(frozen=True)
class Meta:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    image: str | None = None


def _str_labels(labels) -> dict[str, str]:
    if not isinstance(labels, dict):
        return {}
    return {str(k): "" if v is None else str(v) for k, v in labels.items()}


def _run_json(argv: list[str], timeout: float):
    """Run a CLI and parse its JSON stdout; None when absent, failing or slow."""
    exe = shutil.which(argv[0])  # looked up each time: engines get installed and removed
    if exe is None:
        return None
    r = subprocess.run([exe, *argv[1:]], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=timeout, check=False)
    if r.returncode != 0:
        log.debug("%s exited %d: %s", argv[0], r.returncode, r.stderr.strip()[:200])
        return None
    return json.loads(r.stdout)


def fetch_podman(cid: str, timeout: float = 2.0) -> Meta | None:
    data = _run_json(["podman", "inspect", "--type", "container", "--format", "json", cid],
                     timeout)
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    c = data[0]
    name = str(c.get("Name") or "").lstrip("/")
    cfg = c.get("Config") or {}
    return Meta(name or cid[:12], _str_labels(cfg.get("Labels")),
                c.get("ImageName") or cfg.get("Image") or None)


class _UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix socket (the docker API), with no dependency beyond stdlib."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


def fetch_docker(cid: str, sock: str = DOCKER_SOCKET, timeout: float = 1.0) -> Meta | None:
    try:
        conn = _UnixHTTPConnection(sock, timeout)
        conn.connect()
    except (FileNotFoundError, ConnectionRefusedError):
        return None  # no docker here: not worth a log line
    try:
        conn.request("GET", f"/containers/{cid}/json")
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        log.debug("docker: GET /containers/%s/json -> %d", cid[:12], resp.status)
        return None
    c = json.loads(body)
    name = str(c.get("Name") or "").lstrip("/")
    cfg = c.get("Config") or {}
    return Meta(name or cid[:12], _str_labels(cfg.get("Labels")), cfg.get("Image") or None)


def fetch_crictl(cid: str, timeout: float = 2.0) -> Meta | None:
    data = _run_json(["crictl", "inspect", "-o", "json", cid], timeout)
    if not isinstance(data, dict) or not isinstance(data.get("status"), dict):
        return None
    st = data["status"]
    labels = _str_labels(st.get("labels"))
    ctr = labels.get("io.kubernetes.container.name") or (st.get("metadata") or {}).get("name")
    # "namespace/pod/container": what a kubernetes user recognises.
    parts = [labels.get("io.kubernetes.pod.namespace"), labels.get("io.kubernetes.pod.name"), ctr]
    name = "/".join(p for p in parts if p) or cid[:12]
    return Meta(name, labels, (st.get("image") or {}).get("image") or None)


class EngineLookup:
    """Cached, background engine lookups. lookup() never waits on an engine."""

    def __init__(self, *, docker_socket: str = DOCKER_SOCKET, timeout_s: float = 2.0,
                 negative_ttl_s: float = 30.0, positive_ttl_s: float = 300.0,
                 max_workers: int = 2, max_entries: int = 4096, clock=time.monotonic):
        self.docker_socket = docker_socket
        self.timeout_s = timeout_s
        self._ttl = (negative_ttl_s, positive_ttl_s)
        self._max_workers = max_workers
        self._max_entries = max_entries
        self._clock = clock
        self._cache: dict[str, tuple[float, Meta | None]] = {}
        self._inflight: set[str] = set()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    def lookup(self, container: Container) -> Meta | None:
        """The cached Meta (possibly stale while a refresh runs) or None; schedules a fetch
        when there is nothing fresh."""
        if not self._lookable(container):
            return None
        cid = container.id
        with self._lock:
            hit = self._cache.get(cid)
            value = hit[1] if hit else None
            if (hit and hit[0] > self._clock()) or cid in self._inflight or self._closed:
                return value
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._max_workers, thread_name_prefix="convgpu-engines")
            self._inflight.add(cid)
            self._pool.submit(self._fetch_and_store, container)
        return value

    def lookup_sync(self, container: Container) -> Meta | None:
        """Fetch now (blocking, up to the engines' timeouts) and cache the answer."""
        if not self._lookable(container):
            return None
        return self._fetch_and_store(container)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> EngineLookup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _lookable(c: Container) -> bool:
        # Only engine ids (64 hex) are worth asking about; a pod-level cgroup, a systemd unit
        # or a bare cgroup has no engine record (and no odd string reaches a command line).
        return bool(_HEX64.fullmatch(c.id))

    def _fetchers(self, kind: str):
        def docker(cid):  # the API answers fast or not at all: 1 s at most
            return fetch_docker(cid, self.docker_socket, min(self.timeout_s, 1.0))

        def podman(cid):
            return fetch_podman(cid, self.timeout_s)

        def crictl(cid):
            return fetch_crictl(cid, self.timeout_s)

        # containerd: a bare /<parent>/<id> is also what `docker --cgroup-parent` makes;
        # kubernetes: dockershim / cri-dockerd pods are docker containers too.
        return {"docker": [docker], "podman": [podman], "crio": [crictl],
                "kubernetes": [crictl, docker], "containerd": [crictl, docker]}.get(kind, [])

    def _fetch_and_store(self, c: Container) -> Meta | None:
        meta = None
        try:
            for fetch in self._fetchers(c.kind):
                try:
                    meta = fetch(c.id)
                except Exception as e:  # an optional nicety: any failure is just "no name"
                    log.debug("engine lookup of %s (%s) failed: %r", c.id[:12], c.kind, e)
                    meta = None
                if meta is not None:
                    break
        finally:
            with self._lock:
                self._inflight.discard(c.id)
                now = self._clock()
                if len(self._cache) >= self._max_entries:
                    self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                    if len(self._cache) >= self._max_entries:
                        self._cache.clear()
                self._cache[c.id] = (now + self._ttl[meta is not None], meta)
        return meta
