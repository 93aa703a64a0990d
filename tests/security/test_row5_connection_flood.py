"""Issue 24, row 5: an unprivileged process floods the shim socket with ~20,000 connections.
Before, the enforcer accepted every one until accept() failed with EMFILE, uncaught: the daemon
exited (failing open). Now each process may hold 64 connections, each container 512, and all
together a share of the daemon's fds; the rest are accepted and closed at once with one error
line, and a well-behaved shim in another container is served throughout."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import lines_until, popen_in, stop_all
from shim_attack import PY, as_nobody, enforcer, expect, say, shim_sock

pytestmark = pytest.mark.system

FLOOD = textwrap.dedent(r'''
    import socket, sys, time
    path, n = sys.argv[1], int(sys.argv[2])
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX)   # blocking: a full backlog makes connect wait
        try:
            s.connect(path)
        except OSError as e:
            print("connect-failed", i, e, flush=True)
            break
        socks.append(s)
    print("opened", len(socks), flush=True)
    sys.stdin.readline()

    def count():
        served, refused, why = 0, 0, set()
        for s in socks:
            s.setblocking(False)
            try:
                d = s.recv(4096, socket.MSG_PEEK)
            except BlockingIOError:
                served += 1
                continue
            except OSError:
                d = b""
            refused += 1
            why.add(d.decode(errors="replace").strip()[:300] or "EOF")
        return served, refused, why
    last, stable = None, 0
    for _ in range(150):          # until the enforcer has taken every queued connection
        served, refused, why = count()
        stable = stable + 1 if served == last else 0
        last = served
        if stable >= 5:
            break
        time.sleep(0.2)
    print("served", served, "refused", refused, flush=True)
    for w in sorted(why):
        print("why", w, flush=True)
    print("end", flush=True)
    sys.stdin.readline()
''')


def test_row5_twenty_thousand_connections(cgroups, build):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", no_bpf=True)   # the socket is the same
    flood = []
    try:
        cg = cgroups("flood")
        flood = [as_nobody(cg, FLOOD, shim_sock(enf), 1700) for _ in range(12)]   # 20,400
        opened = [int(expect(p, "opened")[1]) for p in flood]
        assert sum(opened) == 12 * 1700, opened
        for p in flood:
            say(p)
        counts = [expect(p, "served") for p in flood]
        served = [int(c[1]) for c in counts]
        assert enf.p.poll() is None, enf.log[-20:]                     # the daemon is up
        assert max(served) <= 64 and sum(served) == 512, served         # per process, per container
        why = {x for p in flood for x in _whys(p)}
        assert any("the cap per process" in w for w in why) and any("the cap per container" in w for w in why), why
        # a shim in another container is served while the flood holds its connections
        ok = popen_in(cgroups("ok"), PY, "-c", NEIGHBOUR, shim_sock(enf))
        out, _ = ok.communicate(timeout=60)
        assert out.split() == ["True", "True", "True"], out
        assert enf.ctl(cmd="status")["status"]["shim_asks"] == 1
    finally:
        stop_all(flood, enf)


# what a shim says first: hello, its context, a 64 MiB request (shim/shim.c)
NEIGHBOUR = textwrap.dedent(r'''
    import json, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    f = s.makefile("rb")
    for m in (b'{"op":"hello"}', b'{"op":"ctx","dev":0,"primary":1}', b'{"op":"ask","dev":0,"size":67108864}',
              b'{"op":"meminfo","dev":0}'):
        s.sendall(m + b"\n")
        if b'"ctx"' not in m:
            r = json.loads(f.readline())
            print(r.get("ok") and (r.get("grant", True) is True), flush=True)
''')


def _whys(p):
    got: list = []
    lines_until(p.stdout, lambda x: x == "end", got, 30, "attacker")
    return [x[4:] for x in got if x.startswith("why ")]


SHED = textwrap.dedent(r'''
    import os, resource, selectors, socket, sys, time
    sys.path[:0] = [sys.argv[3]]
    from convgpu.enforcer.serving.server import Handler, Server, serve
    try:     # no caps: only the fds run out
        from convgpu.enforcer.serving.peers import Caps
        srv = Server(sys.argv[1], Handler(), 0o666, root_only=False,
                     caps=Caps(per_process=10**6, per_group=10**6, total=10**6))
    except ImportError:   # the code before issue 24 had none
        srv = Server(sys.argv[1], Handler(), 0o666, root_only=False)
    fds = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds + 40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print("ready", flush=True)
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        serve(srv.sel, 0.05, [srv]) if hasattr(srv, "tick") else serve(srv.sel, 0.05)
    print("up", len(srv.peers), getattr(srv, "refused", 0), flush=True)
''')


def test_row5_out_of_fds_the_server_sheds_and_stays_up(tmp_path):
    """The caps keep the daemon below its fd limit; if fds run out anyway (its pages, its
    NVML, its cgroup files), accept's EMFILE closes the waiting connection and the loop goes on."""
    path = str(tmp_path / "s" / "shim.sock")
    srv = subprocess.Popen([sys.executable, "-c", SHED, path, "4", os.path.dirname(os.path.dirname(__file__))],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert srv.stdout.readline().split() == ["ready"], srv.stderr.read()
    import socket
    socks = []
    for _ in range(200):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        socks.append(s)
    out, err = srv.communicate(timeout=60)
    assert srv.returncode == 0, err
    word, peers, refused = out.split()
    assert word == "up" and int(peers) + int(refused) == 200 and int(refused) > 100, (out, err)
    assert "Too many open files" in err and "closed unserved" in err
    # each one refused saw its connection closed, not a hang
    closed = 0
    for s in socks:
        s.settimeout(5)
        closed += s.recv(1) == b""
    assert closed == 200   # the server exited: every connection ends
