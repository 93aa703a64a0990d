"""Issue 24, row 6: a peer that sends requests and never reads the replies made the enforcer
buffer them without bound (+111 MiB for 9 MB sent); `alloc` reports grew a process's objects
without bound; every bad request was a log line; one container's flood of requests had the
loop to itself. Now: a peer with more than 256 KiB of unread replies is dropped, objects are
capped per process, log lines are budgeted per container and requests rate-limited per
container (its connections are not read until it is back under: nothing is lost)."""
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import MiB, stop_all
from shim_attack import as_nobody, enforcer, expect, flag_line, lines_of, rss, shim_sock

pytestmark = pytest.mark.system

NO_READ = textwrap.dedent(r'''
    import socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    chunk, sent, err = b"{}\n" * 10000, 0, "none"
    try:
        while sent < int(sys.argv[2]):
            s.sendall(chunk)
            sent += len(chunk)
    except OSError as e:
        err = type(e).__name__
    print("sent", sent, err, flush=True)
    sys.stdin.readline()
''')


def test_row6_requests_never_read(cgroups, build):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", no_bpf=True)
    p = None
    try:
        before = rss(enf.p.pid)
        p = as_nobody(cgroups("noread"), NO_READ, shim_sock(enf), 6_000_000)   # 2 M requests
        _, sent, err = expect(p, "sent", timeout=120)
        time.sleep(0.5)
        grew = rss(enf.p.pid) - before
        assert err in ("BrokenPipeError", "ConnectionResetError"), (sent, err)   # it was dropped
        assert grew < 16 * MiB, grew
        assert f"pid {p.pid} (" in enf.wait_for("of replies unread: disconnected")
        assert enf.ctl(cmd="ping")["ok"]
    finally:
        stop_all([p], enf)


OBJECTS = textwrap.dedent(r'''
    import json, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(b'{"op":"hello"}\n')
    f = s.makefile("rb")
    print("hello", json.loads(f.readline())["ok"], flush=True)
    n = int(sys.argv[2])
    for i in range(0, n, 1000):   # one byte each at a fresh address: no reply to read
        s.sendall(b"".join(b'{"op":"alloc","dev":0,"addr":%d,"size":1}\n' % (4096 * (j + 1)) for j in range(i, i + 1000)))
    s.sendall(b'{"op":"meminfo","dev":0}\n')   # answered once everything before it was handled
    print("done", json.loads(f.readline())["ok"], flush=True)
    sys.stdin.readline()
''')


def test_row6_objects_per_process_are_capped(cgroups, build):
    from convgpu.enforcer.serving.shim import MAX_OBJECTS
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", no_bpf=True)
    p = None
    try:
        p = as_nobody(cgroups("objs"), OBJECTS, shim_sock(enf), MAX_OBJECTS + 20000)
        assert expect(p, "hello")[1] == "True"
        assert expect(p, "done", timeout=120)[1] == "True"
        enf.wait_for(f"pid {p.pid} reports more than {MAX_OBJECTS} live allocations")
        enf.wait_for(flag_line(enf, cgroups("flag")))
        assert len(lines_of(enf, "live allocations")) == 1     # said once
    finally:
        stop_all([p], enf)


BAD = textwrap.dedent(r'''
    import json, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    f = s.makefile("rb")
    s.sendall(b'{"op":"hello"}\n')
    f.readline()
    errors = 0
    for _ in range(50):
        s.sendall(b'{"op":"ask","dev":0,"size":-1}\n' * 100)
        errors += sum("size must be" in json.loads(f.readline()).get("error", "") for _ in range(100))
    print("errors", errors, flush=True)
    sys.stdin.readline()
''')


def test_row6_log_lines_are_budgeted_per_container(cgroups, build):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", no_bpf=True)
    p = None
    try:
        p = as_nobody(cgroups("noisy"), BAD, shim_sock(enf))
        assert expect(p, "errors", timeout=120)[1] == "5000"      # every request answered
        enf.wait_for(flag_line(enf, cgroups("flag")))              # everything before it was logged
        said = lines_of(enf, f"from pid {p.pid} failed")
        assert 1 <= len(said) <= 20, len(said)                     # logged, but 20 a minute
    finally:
        stop_all([p], enf)


def test_row6_one_container_flooding_requests_is_held_others_served(tmp_path):
    """The work budget on its own (a Server in this process, 2,000 requests a second per
    container): a flood is read no faster than its budget, nothing of it is lost, and a
    neighbour's requests are answered in between."""
    from convgpu.enforcer.serving.peers import Caps
    from convgpu.enforcer.serving.server import Handler, Server, serve

    class Echo(Handler):
        def handle(self, peer, msg):
            return {"ok": True, "n": msg.get("n")}

    groups = {}
    srv = Server(str(tmp_path / "s" / "sock"), Echo(), 0o666, root_only=False,
                 caps=Caps(rate=2000.0, per_process=10, per_group=10, total=10),
                 group_of=lambda ident: groups.get(ident.pid, "flood"))
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            serve(srv.sel, 0.01, [srv])
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        flood = socket.socket(socket.AF_UNIX)
        flood.connect(srv.path)
        got = []

        def read_flood():
            f = flood.makefile("rb")
            for _ in range(10000):
                got.append(f.readline())
        r = threading.Thread(target=read_flood, daemon=True)
        t0 = time.monotonic()
        r.start()
        flood.sendall(b'{"n":1}\n' * 10000)
        # the neighbour: another process (its own pid, so its own group), answered at once
        code = ("import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f=s.makefile('rb')\n"
                "for i in range(5):\n t=time.monotonic(); s.sendall(b'{\"n\":2}\\n'); f.readline(); print(time.monotonic()-t)\n")
        nb = subprocess.Popen([sys.executable, "-c", code, srv.path], stdout=subprocess.PIPE, text=True)
        groups[nb.pid] = "neighbour"
        waits = [float(x) for x in nb.communicate(timeout=30)[0].split()]
        flooded = len(got)
        r.join(timeout=30)
        took = time.monotonic() - t0
        assert len(got) == 10000 and all(x == b'{"ok":true,"n":1}\n' for x in got)   # nothing lost
        assert took >= (10000 - 2000) / 2000 * 0.9, took        # no faster than its budget (+1 s burst)
        assert len(waits) == 5 and max(waits) < 0.5, waits      # the neighbour was not behind it
        assert flooded < 10000, flooded                         # ... and was answered while it went on
    finally:
        stop.set()
        t.join(timeout=5)
        srv.close()
