"""Issue 24, row 12: root in a container given the shim directory read-write (as docs/SHIM.md
showed) replaces `shim.sock` with its own; every other container's shim then talks to it.
Now docs/SHIM.md mounts it read-only (the replacement fails: read-only file system), and on a
mount left read-write the enforcer sees its socket replaced within a loop step and binds a new
one there: a neighbour's hello reaches the enforcer again, the impostor gets no one."""
import json
import os
import re
import shutil
import socket
import subprocess
import textwrap
import time
import uuid

import pytest

from conftest import need, stop_all
from shim_attack import enforcer, expect, shim_sock

pytestmark = pytest.mark.system

IMPOSTOR = textwrap.dedent(r'''
    import os, socket, sys
    path = "/run/convgpu/shim/shim.sock"
    s = socket.socket(socket.AF_UNIX)
    for _ in range(100):        # the enforcer may bind again between our unlink and bind: retry
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            print("unlink-failed", e.strerror.replace(" ", "-"), flush=True)
            sys.exit(0)
        try:
            s.bind(path)
            break
        except OSError:
            pass
    else:
        print("never-bound", flush=True)
        sys.exit(0)
    os.chmod(path, 0o666)
    s.listen(16)
    s.settimeout(3)
    print("replaced", flush=True)
    got = 0
    try:
        while True:
            c, _ = s.accept()
            got += 1
            c.sendall(b'{"ok":true,"limit":1099511627776}\n')
    except OSError:
        pass
    print("impostor-served", got, flush=True)
''')


def podman_run(name, mount_opts, run_dir):
    """The shim directory mounted into a container, docs/SHIM.md style (mount_opts: ro or rw)."""
    need(shutil.which("podman") is not None, "podman is not installed")
    rfs = f"/tmp/convgpu-shimsock-rfs-{os.getpid()}"
    for d in ("proc", "sys", "dev", "tmp", "etc", "usr", "lib", "lib64", "bin", "run/convgpu/shim"):
        os.makedirs(f"{rfs}/{d}", exist_ok=True)
    return subprocess.Popen(
        ["podman", "--cgroup-manager=cgroupfs", "--runtime", "runc", "run", "--rm", "-i", "--network", "none",
         "--cgroupns=host", "--name", name, "-v", "/usr:/usr:ro", "-v", "/lib:/lib:ro", "-v", "/lib64:/lib64:ro",
         "-v", "/bin:/bin:ro", "-v", f"{run_dir}/shim:/run/convgpu/shim:{mount_opts}", "--rootfs", rfs,
         "/usr/bin/python3", "-c", IMPOSTOR],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def hello(path) -> dict:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    s.sendall(b'{"op":"hello"}\n')
    return json.loads(s.makefile("rb").readline())


def test_row12_the_docs_mount_is_read_only():
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "SHIM.md")).read()
    mounts = re.findall(r"-v (/run/convgpu/shim):\S*?:(\S+)", text)
    assert mounts and all(opts.split(",")[0] == "ro" for _, opts in mounts), mounts


@pytest.mark.parametrize("opts", ["ro", "rw"])
def test_row12_replacing_the_shim_socket(cgroups, build, opts):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", no_bpf=True)
    c = None
    try:
        c = podman_run(f"convgpu-shimsock-{os.getpid()}-{uuid.uuid4().hex[:8]}", opts, enf.run_dir)
        if opts == "ro":
            assert expect(c, "unlink-failed", timeout=120)[1] == "Read-only-file-system"
            assert hello(shim_sock(enf))["limit"] == 1 << 30
            return
        expect(c, "replaced", timeout=120)
        enf.wait_for("shim.sock was changed")       # seen within a loop step, made again
        time.sleep(0.2)
        assert hello(shim_sock(enf))["limit"] == 1 << 30          # the enforcer's answer, not 1 TiB
        assert expect(c, "impostor-served", timeout=30)[1] == "0"
    finally:
        stop_all([c], enf)
