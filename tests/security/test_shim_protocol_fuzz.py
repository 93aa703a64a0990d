"""Property-based fuzz of the shim protocol (issue 24): hypothesis builds what a hostile process
sends on the shim socket (valid ops with hostile fields, ops out of order, non-objects, raw
bytes, oversized lines, deep nesting, lines split anywhere, several connections, half-closed or
abandoned connections) and runs it from a fresh process in a cgroup of its own against one real
enforcer. After every example: the enforcer is up, a witness in another container is answered
on its open connection, the witness's books are exactly what it reported, and once the
fuzzing process has exited its container holds exactly nothing. Shim-only mode (`--no-probes`):
there the reports are the books, the most a message can touch."""
import json
import os
import sys
import textwrap
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from conftest import MiB, need, popen_in, remove_cgroup  # noqa: E402
from shim_attack import enforcer, shim_sock  # noqa: E402

pytestmark = pytest.mark.system

CHILD = textwrap.dedent(r'''
    import json, os, socket, sys, time
    plan = json.loads(sys.stdin.readline())
    conns = []
    for _ in range(plan["conns"]):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sys.argv[1])
        conns.append(s)
    for i, chunk in plan["chunks"]:
        try:
            conns[i].sendall(bytes.fromhex(chunk))
        except OSError:
            pass
    for s in conns:
        try:
            if plan["end"] == "half":        # half-closed: we stop sending, and read what comes
                s.shutdown(socket.SHUT_WR)
                s.settimeout(2)
                while s.recv(65536):
                    pass
            elif plan["end"] == "read":
                s.settimeout(0.2)
                s.recv(65536)
        except OSError:
            pass
    os._exit(0)                              # "abandon": connections close with the process
''')

ints = st.one_of(st.integers(-3, 70), st.integers(-(2 ** 65), 2 ** 65), st.sampled_from([0, 1, 2 ** 50, 2 ** 64 - 1]))
field = st.one_of(ints, st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=8), st.just([1]))
ops = st.sampled_from(["hello", "ask", "alloc", "free", "ctx", "meminfo", "launch", "", None])
message = st.one_of(
    st.fixed_dictionaries({"op": ops}, optional={"dev": field, "size": field, "addr": field, "primary": field,
                                                  "minor": field, "pid": ints}).map(lambda m: json.dumps(m).encode() + b"\n"),
    st.builds(lambda d, s, a: b'{"op":"alloc","dev":%d,"addr":%d,"size":%d}\n' % (d, a, s),
              st.integers(0, 1), st.integers(0, 1 << 31), st.integers(1, 1 << 40)),
    st.builds(lambda a: b'{"op":"free","addr":%d}\n' % a, st.integers(0, 1 << 40)),
    st.binary(max_size=64),
    st.sampled_from([b"[1,2]\n", b"7\n", b'"x"\n', b"{\n", b"\n", b"[" * 5000 + b"\n", b"x" * 5000,
                     b"1" * 5000 + b"\n", b'{"op":"hello"}' * 300 + b"\n"]))
plan = st.fixed_dictionaries({
    "conns": st.integers(1, 3),
    "msgs": st.lists(st.tuples(st.integers(0, 2), message), max_size=25),
    "cut": st.integers(1, 64),
    "end": st.sampled_from(["half", "read", "abandon"]),
})


def _cgroup(name):
    from convgpu.enforcer.tenants.containers import cgroup_layout
    lay = cgroup_layout()
    need(lay.v2_root is not None, "no cgroup2 hierarchy")
    d = f"{lay.v2_root}/convgpu-fuzz-{os.getpid()}-{name}"
    os.makedirs(d, exist_ok=True)
    return d


WITNESS = ("import socket, sys\ns = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile('rb')\n"
           "for line in sys.stdin:\n    s.sendall(line.encode())\n"
           "    if '\"alloc\"' not in line and '\"ctx\"' not in line:\n        print(f.readline().decode().strip() or 'closed', flush=True)\n")


class Witness:
    """A process in another container with one open connection: what every other shim sees."""

    def __init__(self, cg, path):
        self.p = popen_in(cg, sys.executable, "-c", WITNESS, path)

    def send(self, msg: dict, reply: bool = True):
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()
        if reply:
            line = self.p.stdout.readline().strip()
            assert line and line != "closed", "the enforcer closed the witness's connection"
            return json.loads(line)


@pytest.fixture(scope="module")
def stand(root, build):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", no_bpf=True)
    fuzz, wcg = _cgroup("fuzz"), _cgroup("witness")
    w = Witness(wcg, shim_sock(enf))
    yield enf, w, fuzz, wcg
    w.p.kill()
    w.p.wait()
    enf.close()
    for d in (fuzz, wcg):
        remove_cgroup(d)


def _status(enf, name):
    st_ = enf.ctl(cmd="status")["status"]
    return next((c for c in st_["containers"] if c["name"] == name), None)


def test_witness_setup(stand):
    enf, w, _, wcg = stand
    assert w.send({"op": "hello"})["ok"]
    w.send({"op": "ctx", "dev": 0, "primary": 1}, reply=False)      # as the shim does
    assert w.send({"op": "ask", "dev": 0, "size": 100 * MiB})["grant"]
    w.send({"op": "alloc", "dev": 0, "addr": 4096, "size": 100 * MiB}, reply=False)
    assert w.send({"op": "meminfo", "dev": 0})["ok"]
    assert _status(enf, os.path.basename(wcg))["gpus"]["0"]["used"] == 100 * MiB


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(p=plan)
def test_shim_protocol_fuzz(stand, p):
    enf, w, fuzz, wcg = stand
    stream = {i: b"" for i in range(p["conns"])}
    for i, m in p["msgs"]:
        stream[i % p["conns"]] += m
    chunks = [(i, data[k:k + p["cut"]].hex()) for i, data in stream.items() for k in range(0, len(data), p["cut"])]
    child = popen_in(fuzz, sys.executable, "-c", CHILD, shim_sock(enf))
    child.communicate(json.dumps({"conns": p["conns"], "chunks": chunks, "end": p["end"]}) + "\n", timeout=60)
    assert enf.p.poll() is None, enf.log[-20:]
    # the witness is answered, and its books are what it reported, exactly
    assert w.send({"op": "meminfo", "dev": 0})["ok"]
    assert _status(enf, os.path.basename(wcg))["gpus"]["0"]["used"] == 100 * MiB
    # the fuzzing process has exited: its container holds nothing (it may take a loop step)
    deadline = time.monotonic() + 5
    while True:
        row = _status(enf, os.path.basename(fuzz))
        if row is None or all(g["used"] == 0 and not g.get("shim_credit") for g in row["gpus"].values()):
            break
        assert time.monotonic() < deadline, row
        time.sleep(0.05)
