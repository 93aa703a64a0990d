"""containers.py, cgroupfs.py and engines.py without root or a kernel: real-world cgroup paths, /proc texts
and mount tables (several captured on a hybrid-cgroup Debian 12 host running podman with runc),
a fake /proc, a fake cgroup tree, fake engine executables and a fake docker socket."""
from __future__ import annotations

import http.server
import json
import os
import socketserver
import stat
import threading
import time

import pytest

from convgpu.enforcer.tenants.cgroupfs import CgroupIndex, Layout, cgroup_id, cgroup_layout
from convgpu.enforcer.tenants import containers
from convgpu.enforcer.tenants.containers import (Container, cgroup_of_pid, container_of_path, container_of_pid,
                                                 delegation_cut, parse_proc_cgroup)
from convgpu.enforcer.tenants.engines import EngineLookup, Meta
from convgpu.errors import ConvgpuError, NotFoundError

H1 = "e9f9575998bb1f3900315c1944ac697c99ab4e799c44fccb112e6e8d32ea4e8d"
H2 = "26bb4088d9443b5a65529fdc716ec42fdb5fa0a078775e1852125e6cf13ac425"
UID = "0f2b5c8e-1a2b-4c3d-8e9f-0a1b2c3d4e5f"
UID_ = UID.replace("-", "_")
BURST = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
BEST = f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
ROOTLESS = f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{H1}.scope/container"
KIND_NODE = (f"/system.slice/docker-{H2}.scope/kubelet.slice/kubelet-kubepods.slice/"
             f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_}.slice/"
             f"cri-containerd-{H1}.scope")

# path -> (kind, id, pod, short); the cgroup field is the container's own (CG: where that is
# not the path itself: a sub-cgroup belongs to the container around it)
PATHS = [
    # docker
    (f"/docker/{H1}", "docker", H1, None, H1[:12]),
    (f"/system.slice/docker-{H1}.scope", "docker", H1, None, H1[:12]),
    (f"/docker/{H2}/docker/{H1}", "docker", H2, None, H2[:12]),  # docker-in-docker: the outer one
    # docker-in-docker inside a pod's container: the pod's container
    (f"/kubepods/besteffort/pod{UID}/{H2}/docker/{H1}", "kubernetes", H2, UID, H2[:12]),
    ("/system.slice/docker.service", "systemd", "/system.slice/docker.service", None, "docker"),
    # containerd (nerdctl / ctr)
    (f"/default/{H1}", "containerd", H1, None, H1[:12]),
    (f"/system.slice/nerdctl-{H1}.scope", "containerd", H1, None, H1[:12]),
    # kubernetes, cgroupfs driver
    (f"/kubepods/burstable/pod{UID}/{H1}", "kubernetes", H1, UID, H1[:12]),
    (f"/kubepods/pod{UID}/{H1}", "kubernetes", H1, UID, H1[:12]),
    (f"/kubepods/besteffort/pod{UID}/{H1}", "kubernetes", H1, UID, H1[:12]),
    (f"/kubepods/besteffort/pod{UID}/crio-{H1}", "kubernetes", H1, UID, H1[:12]),
    (f"/kubepods/burstable/pod6d0c2f6c4ae6d5c1f2d8b0b8d7f0c0e5/{H1}", "kubernetes", H1,
     "6d0c2f6c4ae6d5c1f2d8b0b8d7f0c0e5", H1[:12]),  # static pod: the uid is a config hash
    (f"/kubepods/burstable/pod{UID}", "kubernetes", UID, UID, "pod-0f2b5c8e"),
    # kubernetes, systemd driver (underscores in the slice name)
    (f"{BURST}/cri-containerd-{H1}.scope", "kubernetes", H1, UID, H1[:12]),
    (f"{BEST}/crio-{H1}.scope", "kubernetes", H1, UID, H1[:12]),
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/docker-{H1}.scope", "kubernetes", H1, UID,
     H1[:12]),
    (BURST, "kubernetes", UID, UID, "pod-0f2b5c8e"),  # the pod (sandbox) level
    (f"{BEST}/crio-conmon-{H1}.scope", "systemd", f"{BEST}/crio-conmon-{H1}.scope", UID,
     f"crio-conmon-{H1}"),
    # kind seen from the host: the node is one docker container (inside it, with its own cgroup
    # namespace, the pods are at /kubelet.slice/kubelet-kubepods.slice: KIND_IN_NODE)
    (KIND_NODE, "docker", H2, None, H2[:12]),
    (KIND_NODE[KIND_NODE.index("/kubelet.slice"):], "kubernetes", H1, UID, H1[:12]),
    ("/kubepods.slice/kubepods-besteffort.slice", "cgroup",
     "/kubepods.slice/kubepods-besteffort.slice", None, "kubepods-besteffort.slice"),
    # cri-o outside kubernetes
    (f"/system.slice/crio-{H1}.scope", "crio", H1, None, H1[:12]),
    (f"/system.slice/crio-conmon-{H1}.scope", "systemd", f"/system.slice/crio-conmon-{H1}.scope", None,
     f"crio-conmon-{H1}"),
    # podman
    (f"/libpod_parent/libpod-{H1}", "podman", H1, None, H1[:12]),
    (f"/libpod_parent/libpod-{H1}/container", "podman", H1, None, H1[:12]),
    (f"/machine.slice/libpod-{H1}.scope", "podman", H1, None, H1[:12]),
    (f"/machine.slice/libpod-{H1}.scope/container", "podman", H1, None, H1[:12]),
    (f"/machine.slice/libpod-{H1}.scope/init.scope", "podman", H1, None, H1[:12]),
    (f"/machine.slice/libpod-{H1}.scope/system.slice/nginx.service", "podman", H1, None,
     H1[:12]),
    (f"/machine.slice/machine-libpod_pod_{H2}.slice/libpod-{H1}.scope", "podman", H1, None,
     H1[:12]),
    (ROOTLESS, "podman", H1, None, H1[:12]),
    (f"/machine.slice/libpod-conmon-{H1}.scope", "systemd", f"/machine.slice/libpod-conmon-{H1}.scope", None,
     f"libpod-conmon-{H1}"),
    ("/libpod_parent/conmon", "cgroup", "/libpod_parent/conmon", None, "conmon"),
    # systemd units
    ("/system.slice/ssh.service", "systemd", "/system.slice/ssh.service", None, "ssh"),
    ("/user.slice/user-0.slice/session-3.scope", "systemd", "/user.slice/user-0.slice/session-3.scope", None, "session-3"),
    ("/system.slice/run-r1234.scope", "systemd", "/system.slice/run-r1234.scope", None, "run-r1234"),
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/app-org.gnome.Terminal.slice/"
     "vte-spawn-1.scope", "systemd", "/user.slice/user-1000.slice/user@1000.service", None, "user@1000"),  # the outermost unit
    ("/convgpu.run/job1/sub", "cgroup", "/convgpu.run/job1", None, "job1"),
    # plain cgroups and the root
    ("/process_api/adbab065d2549530a65208195c99c9e4", "cgroup",
     "/process_api/adbab065d2549530a65208195c99c9e4", None, "adbab065d2549530a65208195c99c9e4"),
    ("/", "host", "host", None, "host"),
    # issue 24 row 8: names a container (with cgroup delegation) or a plain cgroup makes inside
    # itself, named like a neighbour, never make it that neighbour
    (f"/libpod_parent/libpod-{H1}/libpod-{H2}", "podman", H1, None, H1[:12]),
    (f"/libpod_parent/libpod-{H1}/docker-{H2}.scope", "podman", H1, None, H1[:12]),
    (f"/system.slice/docker-{H1}.scope/system.slice/docker-{H2}.scope", "docker", H1, None, H1[:12]),
    (f"{BURST}/cri-containerd-{H1}.scope/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{H2}.scope",
     "kubernetes", H1, UID, H1[:12]),
    (f"/convgpu-test/a/libpod_parent/libpod-{H2}", "cgroup", f"/convgpu-test/a/libpod_parent/libpod-{H2}",
     None, f"libpod-{H2}"),
    (f"/system.slice/ssh.service/docker-{H2}.scope", "systemd", "/system.slice/ssh.service", None, "ssh"),
    (f"/system.slice/ssh.service/kubepods/pod{UID}/{H2}", "systemd", "/system.slice/ssh.service", None, "ssh"),
    (f"/docker/{H1}/kubepods/pod{UID}/{H2}", "docker", H1, None, H1[:12]),
    # a kubepods tree below plain directories (a test's prefix) is still the kubelet's
    (f"/convgpu-test/kubepods/besteffort/pod{UID}/{H1}", "kubernetes", H1, UID, H1[:12]),
]
CG = {f"/libpod_parent/libpod-{H1}/container": f"/libpod_parent/libpod-{H1}",
      f"/docker/{H2}/docker/{H1}": f"/docker/{H2}",
      f"/kubepods/besteffort/pod{UID}/{H2}/docker/{H1}": f"/kubepods/besteffort/pod{UID}/{H2}",
      KIND_NODE: f"/system.slice/docker-{H2}.scope",
      ROOTLESS: ROOTLESS[:-len("/container")],
      "/user.slice/user-1000.slice/user@1000.service/app.slice/app-org.gnome.Terminal.slice/vte-spawn-1.scope":
          "/user.slice/user-1000.slice/user@1000.service",
      f"/libpod_parent/libpod-{H1}/libpod-{H2}": f"/libpod_parent/libpod-{H1}",
      f"/libpod_parent/libpod-{H1}/docker-{H2}.scope": f"/libpod_parent/libpod-{H1}",
      f"/system.slice/docker-{H1}.scope/system.slice/docker-{H2}.scope": f"/system.slice/docker-{H1}.scope",
      f"{BURST}/cri-containerd-{H1}.scope/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{H2}.scope":
          f"{BURST}/cri-containerd-{H1}.scope",
      "/convgpu.run/job1/sub": "/convgpu.run/job1",
      f"/system.slice/ssh.service/docker-{H2}.scope": "/system.slice/ssh.service",
      f"/system.slice/ssh.service/kubepods/pod{UID}/{H2}": "/system.slice/ssh.service",
      f"/docker/{H1}/kubepods/pod{UID}/{H2}": f"/docker/{H1}"}
CG.update({p: p.rsplit("/", 1)[0] for p in (f"/machine.slice/libpod-{H1}.scope/container",
                                            f"/machine.slice/libpod-{H1}.scope/init.scope")})
CG[f"/machine.slice/libpod-{H1}.scope/system.slice/nginx.service"] = f"/machine.slice/libpod-{H1}.scope"


@pytest.mark.parametrize("path,kind,cid,pod,short", PATHS, ids=[p[0][-60:] for p in PATHS])
def test_container_of_path(path, kind, cid, pod, short):
    c = container_of_path(path)
    assert c == Container(kind, cid, CG.get(path, path), pod)
    assert c.short == short


def test_container_of_path_normalises():
    assert container_of_path("") == Container("host", "host", "/", None)
    assert container_of_path(f"/docker/{H1}/\n") == Container("docker", H1, f"/docker/{H1}", None)
    assert container_of_path("/pod1234/x") == Container("cgroup", "/pod1234/x", "/pod1234/x", None)


def _v1(systemd="/", freezer="/", memory="/", cpu="/", v2="/"):
    return (f"9:name=systemd:{systemd}\n8:pids:/\n7:blkio:/\n6:freezer:{freezer}\n5:devices:/\n"
            f"4:memory:{memory}\n3:cpuset:/\n2:cpu,cpuacct:{cpu}\n" + (f"0::{v2}\n" if v2 else ""))


# texts from /proc/<pid>/cgroup: hybrid (as captured), pure v2 and v1-only hosts
PROC = [
    (_v1(memory="/process_api/adbab065d2549530a65208195c99c9e4"),
     "/process_api/adbab065d2549530a65208195c99c9e4"),  # a sandboxed shell: only memory set
    (_v1(*[f"/libpod_parent/libpod-{H1}"] * 4, v2=f"/libpod_parent/libpod-{H1}"),
     f"/libpod_parent/libpod-{H1}"),  # podman+runc, cgroupfs: runc joins the unified tree too
    (_v1(freezer="/libpod_parent/conmon", memory="/libpod_parent/conmon",
         cpu="/libpod_parent/conmon"), "/libpod_parent/conmon"),  # conmon: v2 and systemd "/"
    (_v1(systemd=f"/docker/{H1}", freezer=f"/docker/{H1}", memory=f"/docker/{H1}"),
     f"/docker/{H1}"),  # v2 line "/" (engine never set it)
    (_v1(freezer=f"/docker/{H1}", memory=f"/docker/{H1}", v2="/system.slice/containerd.service"),
     f"/docker/{H1}"),  # v2 cgroup inherited from the daemon: the v1 one names the container
    (_v1(systemd="/system.slice/ssh.service", v2="/system.slice/ssh.service"),
     "/system.slice/ssh.service"),
    (_v1(systemd="/a", freezer="/b", memory="/c", cpu="/d"), "/a"),
    (_v1(freezer="/b", memory="/c", cpu="/d"), "/b"),
    (_v1(memory="/c", cpu="/d"), "/c"),
    (_v1(cpu="/d"), "/d"),
    (_v1(), "/"),
    (f"0::/system.slice/docker-{H1}.scope\n", f"/system.slice/docker-{H1}.scope"),  # pure v2
    (f"0::{BURST}/cri-containerd-{H1}.scope (deleted)\n", f"{BURST}/cri-containerd-{H1}.scope"),
    ("0::/\n", "/"),
    (_v1(systemd=f"/system.slice/docker-{H1}.scope", memory=f"/docker/{H1}", v2=None),
     f"/system.slice/docker-{H1}.scope"),  # v1-only host
    ("", "/"),
]


@pytest.mark.parametrize("text,path", PROC)
def test_parse_proc_cgroup(text, path):
    assert parse_proc_cgroup(text) == path


HYBRID_MOUNTS = """\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V2_MOUNTS = ("sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n"
             "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,"
             "memory_recursiveprot 0 0\n")
V1_MOUNTS = ("cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0\n"
             "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0\n")


def test_cgroup_layout_from_mounts():
    assert cgroup_layout(mounts_text=HYBRID_MOUNTS) == Layout(
        "hybrid", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/freezer")
    assert cgroup_layout(mounts_text=V2_MOUNTS) == Layout("v2", "/sys/fs/cgroup", None)
    assert cgroup_layout(mounts_text=V1_MOUNTS) == Layout("v1", None, "/sys/fs/cgroup/freezer")
    assert cgroup_layout("/sys/fs/cgroup/", mounts_text="cgroup2 /sys/fs/cgroup cgroup2 rw 0 0"
                         ) == Layout("v2", "/sys/fs/cgroup", None)
    assert cgroup_layout("/mnt/my cg", mounts_text="cgroup2 /mnt/my\\040cg cgroup2 rw 0 0"
                         ) == Layout("v2", "/mnt/my cg", None)


def test_cgroup_layout_from_files(tmp_path):
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("")
    (tmp_path / "freezer").mkdir()
    (tmp_path / "freezer" / "cgroup.procs").write_text("")
    root = str(tmp_path)
    assert cgroup_layout(root, mounts_text="") == Layout(
        "hybrid", f"{root}/unified", f"{root}/freezer")
    (tmp_path / "cgroup.controllers").write_text("")
    assert cgroup_layout(root, mounts_text="") == Layout("v2", root, f"{root}/freezer")


def test_cgroup_id_and_index(tmp_path):
    for d in ("system.slice/ssh.service", f"machine.slice/libpod-{H1}.scope/container"):
        (tmp_path / d).mkdir(parents=True)
    layout = Layout("v2", str(tmp_path), None)
    ino = os.stat(tmp_path / "system.slice" / "ssh.service").st_ino
    assert cgroup_id("/system.slice/ssh.service", layout) == ino
    assert cgroup_id("/", layout) == os.stat(tmp_path).st_ino
    with pytest.raises(NotFoundError):
        cgroup_id("/nope", layout)
    with pytest.raises(ConvgpuError):
        cgroup_id("/", Layout("v1", None, None))

    now = [100.0]
    idx = CgroupIndex(layout, clock=lambda: now[0])
    assert idx.path_of(ino) == "/system.slice/ssh.service"
    assert idx.path_of(cgroup_id("/", layout)) == "/"
    deep = f"/machine.slice/libpod-{H1}.scope/container"
    assert idx.path_of(cgroup_id(deep, layout)) == deep
    assert len(idx) == 6
    (tmp_path / "new").mkdir()
    new = cgroup_id("/new", layout)
    assert idx.path_of(new) is None  # a miss within 1 s of the last walk does not walk
    now[0] += 1.5
    assert idx.path_of(new) == "/new"
    (tmp_path / "new").rmdir()
    now[0] += 1.5
    idx.refresh()
    assert idx.path_of(new) == "/new"  # ids are never reused: a removed cgroup still resolves
    assert CgroupIndex(Layout("v1", None, None)).path_of(ino) is None


def test_container_of_pid_self():
    pid = os.getpid()
    assert container_of_pid(pid) == container_of_path(cgroup_of_pid(pid))
    assert cgroup_of_pid(pid) == parse_proc_cgroup(open(f"/proc/{pid}/cgroup").read())


def test_container_of_pid_gone():
    gone = 4194305  # above the largest possible pid_max (2**22)
    with pytest.raises(NotFoundError) as e:
        container_of_pid(gone)
    assert str(e.value) == f"no process {gone}; check the pid with `ps -p {gone}`"
    with pytest.raises(NotFoundError):
        cgroup_of_pid(gone)


def _fake_proc(tmp_path, pid, start, cgroup):
    d = tmp_path / str(pid)
    d.mkdir(exist_ok=True)
    (d / "stat").write_text(f"{pid} (a) b) S 1 {pid} {pid} 0 -1 4194304 116 0 0 0 0 0 0 0 20 0 "
                            f"1 0 {start} 3133440 360 18446744073709551615\n")
    (d / "cgroup").write_text(cgroup)


def test_container_of_pid_cache(tmp_path):
    proc = str(tmp_path)
    _fake_proc(tmp_path, 77, 5000, f"0::/machine.slice/libpod-{H1}.scope/container\n")
    first = container_of_pid(77, proc)
    assert first == Container("podman", H1, f"/machine.slice/libpod-{H1}.scope")
    (tmp_path / "77" / "cgroup").write_text("0::/\n")
    assert container_of_pid(77, proc) is first  # same pid and start time: cached
    _fake_proc(tmp_path, 77, 5001, "0::/system.slice/ssh.service\n")  # pid reused
    assert container_of_pid(77, proc) == Container("systemd", "/system.slice/ssh.service",
                                                   "/system.slice/ssh.service")
    (tmp_path / "77" / "cgroup").write_text(f"0::/docker/{H2}\n")  # moved: not cached
    assert container_of_pid(77, proc) == Container("docker", H2, f"/docker/{H2}")


PODMAN_JSON = [{"Id": H2, "Name": "convgpu-probe", "ImageName": "docker.io/library/busybox:latest",
                "Config": {"Labels": {"team": "ml", "io.containers.autoupdate": "registry"}}}]


def _script(bindir, name, expect_args, payload):
    bindir.mkdir(exist_ok=True)
    p = bindir / name
    p.write_text(f"#!/bin/sh\nif [ \"$*\" = '{expect_args}' ]; then\ncat <<'EOF'\n"
                 f"{json.dumps(payload)}\nEOF\nexit 0\nfi\necho 'Error: no such container' >&2\n"
                 "exit 125\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_engine_lookup_fake_podman(tmp_path, monkeypatch):
    _script(tmp_path / "bin", "podman", f"inspect --type container --format json {H2}",
            PODMAN_JSON)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    c = container_of_path(f"/machine.slice/libpod-{H2}.scope")
    want = Meta("convgpu-probe", {"team": "ml", "io.containers.autoupdate": "registry"},
                "docker.io/library/busybox:latest")
    with EngineLookup(docker_socket=str(tmp_path / "none.sock")) as eng:
        assert eng.lookup_sync(c) == want
        assert eng.lookup_sync(container_of_path(f"/machine.slice/libpod-{H1}.scope")) is None
    with EngineLookup(docker_socket=str(tmp_path / "none.sock")) as eng:
        assert eng.lookup(c) is None  # nothing cached yet: scheduled, not waited for
        deadline = time.monotonic() + 10
        while eng.lookup(c) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.lookup(c) == want


def test_engine_lookup_fake_crictl(tmp_path, monkeypatch):
    status = {"status": {"id": H1, "metadata": {"name": "trainer", "attempt": 0},
                         "image": {"image": "nvcr.io/nvidia/pytorch:24.01-py3"},
                         "labels": {"io.kubernetes.container.name": "trainer",
                                    "io.kubernetes.pod.name": "job-0",
                                    "io.kubernetes.pod.namespace": "ml"}}}
    _script(tmp_path / "bin", "crictl", f"inspect -o json {H1}", status)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    eng = EngineLookup(docker_socket=str(tmp_path / "none.sock"))
    assert eng.lookup_sync(container_of_path(f"{BURST}/cri-containerd-{H1}.scope")) == Meta(
        "ml/job-0/trainer", status["status"]["labels"], "nvcr.io/nvidia/pytorch:24.01-py3")


def test_engine_lookup_fake_docker_socket(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    body = json.dumps({"Id": H1, "Name": "/trainer",
                       "Config": {"Image": "pytorch:latest", "Labels": {"a": "b"}}}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == f"/containers/{H1}/json"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body) if ok else 0))
            self.end_headers()
            if ok:
                self.wfile.write(body)

        def address_string(self):  # a unix peer has no host name
            return "unix"

        def log_message(self, *a):
            pass

    sock = str(tmp_path / "d.sock")
    srv = socketserver.ThreadingUnixStreamServer(sock, Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        eng = EngineLookup(docker_socket=sock)
        assert eng.lookup_sync(container_of_path(f"/docker/{H1}")) == Meta(
            "trainer", {"a": "b"}, "pytorch:latest")
        assert eng.lookup_sync(container_of_path(f"/docker/{H2}")) is None
    finally:
        srv.shutdown()
        srv.server_close()


def test_engine_lookup_no_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no podman, crictl or docker here
    now = [0.0]
    eng = EngineLookup(docker_socket=str(tmp_path / "docker.sock"), clock=lambda: now[0])
    for path in (f"/machine.slice/libpod-{H1}.scope", f"/docker/{H1}", f"/default/{H1}",
                 f"{BEST}/crio-{H1}.scope", f"/system.slice/crio-{H1}.scope", BURST,
                 "/system.slice/ssh.service", "/", "/process_api/x"):
        assert eng.lookup_sync(container_of_path(path)) is None
    assert eng._cache[H1] == (30.0, None)  # negative answers are cached for 30 s
    eng.close()
    assert eng.lookup(container_of_path(f"/docker/{H1}")) is None



def test_remove_cgroup_retries_until_the_directory_goes(tmp_path, monkeypatch):
    """A cgroup's rmdir fails (EBUSY) until the kernel has moved its last task out: retried
    `tries` times; a directory already gone is done; one that never goes is left, quietly."""
    from convgpu.enforcer.tenants import cgroupfs
    d = tmp_path / "cg"
    d.mkdir()
    calls, busy = [], [2]
    real = os.rmdir

    def rmdir(path):
        calls.append(path)
        if busy[0]:
            busy[0] -= 1
            raise OSError(16, "Device or resource busy")
        real(path)
    monkeypatch.setattr(cgroupfs.os, "rmdir", rmdir)
    cgroupfs.remove_cgroup(d, tries=5, pause=0)
    assert len(calls) == 3 and not d.exists()
    calls.clear()
    cgroupfs.remove_cgroup(d, tries=5, pause=0)          # gone: one try
    assert len(calls) == 1
    calls.clear()
    busy[0] = 99
    cgroupfs.remove_cgroup(tmp_path, tries=4, pause=0)   # never goes: 4 tries, no error
    assert len(calls) == 4 and tmp_path.exists()


class FakeTree:
    """os.stat over a made-up cgroup tree under root: path -> (owner uid, mode); a missing path
    raises, as the kernel's do; a path elsewhere is the real os.stat's (os is one module: pytest
    stats its own files meanwhile). No root needed to make a directory someone else's."""

    def __init__(self, root: str, nodes: dict[str, tuple[int, int]]):
        self.root, self.real = root, os.stat
        self.nodes = {os.path.join(root, k.lstrip("/")): v for k, v in nodes.items()}
        self.followed = []

    def stat(self, path, *a, follow_symlinks=True, **kw):
        if not str(path).startswith(self.root + "/"):
            return self.real(path, *a, follow_symlinks=follow_symlinks, **kw)
        if follow_symlinks:
            self.followed.append(path)       # a symlink in the tree is looked at, never followed
        if path not in self.nodes:
            raise FileNotFoundError(path)
        uid, mode = self.nodes[path]
        return os.stat_result((stat.S_IFDIR | mode, 0, 0, 2, uid, 0, 0, 0, 0, 0))


DELEGATION = {
    # a tree that is root's throughout: the path as it is (a unit's own cgroup, say)
    "/system.slice/victim.service": "/system.slice/victim.service",
    # chowned to its delegate (a user's systemd, rootless podman): cut at the delegated directory
    "/user.slice/user-1000.slice/user@1000.service/app.slice/victim.service":
        "/user.slice/user-1000.slice/user@1000.service",
    # root's, but anyone may write it (mode 0777): delegated to anyone, cut there
    "/open/victim.service": "/open",
    # group-writable (0775): its group may make and name sub-cgroups: cut there
    "/team/victim.service": "/team",
    # the outermost delegated directory is the cut, however deep the tree below it
    "/user.slice/user-1000.slice/user@1000.service/open/deeper": "/user.slice/user-1000.slice/user@1000.service",
    # gone meanwhile (or not in this hierarchy): the path as it is
    "/system.slice/gone.service": "/system.slice/gone.service",
}


@pytest.mark.parametrize("path,cut", list(DELEGATION.items()))
def test_delegation_cut(path, cut, monkeypatch):
    tree = FakeTree("/cg", {
        "/system.slice": (0, 0o755), "/system.slice/victim.service": (0, 0o755),
        "/user.slice": (0, 0o755), "/user.slice/user-1000.slice": (0, 0o755),
        "/user.slice/user-1000.slice/user@1000.service": (1000, 0o755),
        "/user.slice/user-1000.slice/user@1000.service/app.slice": (1000, 0o755),
        "/user.slice/user-1000.slice/user@1000.service/app.slice/victim.service": (1000, 0o755),
        "/user.slice/user-1000.slice/user@1000.service/open": (0, 0o777),
        "/user.slice/user-1000.slice/user@1000.service/open/deeper": (0, 0o755),
        "/open": (0, 0o777), "/open/victim.service": (65534, 0o755),
        "/team": (0, 0o775), "/team/victim.service": (0, 0o755),
    })
    monkeypatch.setattr(containers.os, "stat", tree.stat)
    assert delegation_cut(path, root="/cg") == cut
    assert tree.followed == []


def test_delegation_cut_without_a_cgroup2_mount_is_the_path(monkeypatch):
    monkeypatch.setattr(containers, "_v2_mount", lambda: None)
    assert delegation_cut("/open/victim.service") == "/open/victim.service"
    assert delegation_cut("/", root="/cg") == "/"
