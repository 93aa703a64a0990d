"""Issue 24, row 9: a shim connection outlives its process (a child keeps the socket) until the
pid is reused; before, its `hello` and `ask` then acted for the new owner of the pid: the
victim was marked a shim user (BPF stopped admitting it) and the attacker's requests were held
against the victim's container. Now a peer is its process (a pidfd from SO_PEERPIDFD, taken at
connect): once that process has exited, its connection is closed before any request acts."""
import subprocess
import sys
import textwrap

import pytest

from conftest import popen_in, read_until, stop_all
from shim_attack import as_nobody, enforcer, expect, flag_line, lines_of, say, shim_sock

pytestmark = pytest.mark.system

ATTACKER = textwrap.dedent(r'''
    import json, os, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    f = s.makefile("rb")
    s.sendall(b'{"op":"hello"}\n')
    print("hello", json.loads(f.readline())["ok"], flush=True)
    if os.fork():
        os._exit(0)                     # the process that connected is gone; its child keeps the socket
    print("child", os.getpid(), flush=True)
    sys.stdin.readline()                # until the pid was reused
    try:
        s.sendall(b'{"op":"hello"}\n{"op":"ask","dev":0,"size":%d}\n' % (768 << 20))
        for _ in range(2):
            line = f.readline()
            print("reply", line.decode().strip() or "closed", flush=True)
    except OSError as e:
        print("reply closed", e, flush=True)
    sys.stdin.readline()
''')

# clone3 with set_tid (root only): a process with exactly the pid we name
WITH_PID = textwrap.dedent(r'''
    import ctypes, os, struct, sys
    libc = ctypes.CDLL(None, use_errno=True)
    tid = (ctypes.c_int * 1)(int(sys.argv[1]))
    args = ctypes.create_string_buffer(struct.pack("11Q", 0, 0, 0, 0, 17, 0, 0, 0, ctypes.addressof(tid), 1, 0), 88)
    r = libc.syscall(435, args, ctypes.c_size_t(88))
    if r == 0:
        os.execv(sys.argv[2], sys.argv[2:])
    if r < 0:
        sys.exit(f"clone3: {os.strerror(ctypes.get_errno())}")
    sys.exit(os.waitstatus_to_exitcode(os.waitpid(r, 0)[1]))
''')


def test_row9_a_connection_cannot_act_for_a_reused_pid(cgroups, build):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", no_bpf=True)   # the broker is the same
    a = v = child = None
    try:
        a = as_nobody(cgroups("attacker"), ATTACKER, shim_sock(enf))
        assert expect(a, "hello")[1] == "True"
        child = int(expect(a, "child")[1])
        pid = a.pid
        assert a.wait(timeout=30) == 0          # reaped: its pid is free
        enf.wait_for(f"pid {pid} of attacker")  # it was a shim user while it lived
        # the victim gets that pid: a process in a container of its own
        vcg = cgroups("victim")
        v = popen_in(vcg, sys.executable, "-c", WITH_PID, pid, "/bin/sh", "-c",
                     f'echo $$ > {vcg}/cgroup.procs && echo ready && exec sleep 600')
        read_until(v, "ready")
        assert open(f"/proc/{pid}/cgroup").read().strip().endswith("/victim"), "the pid was not reused"
        say(a)                                  # the child speaks on the dead process's connection
        replies = [expect(a, "reply")[1:] for _ in range(2)]
        assert replies[0][0] == "closed", replies
        enf.wait_for(flag_line(enf, cgroups("flag")))
        assert not lines_of(enf, f"pid {pid} of victim"), lines_of(enf, f"pid {pid}")
        st = enf.ctl(cmd="status")["status"]
        assert not [c for c in st["containers"] if c["name"] == "victim"], st   # nothing acted for it
    finally:
        if child:
            subprocess.run(["kill", "-9", str(child)])
        stop_all([a, v], enf)
