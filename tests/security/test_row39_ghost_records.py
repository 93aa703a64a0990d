"""Issue 39, part 6, attack 1 (ghost records): a process that never opened a GPU says `hello`
and `ask`s for 1 MiB on the 0666 shim socket, then exits. Before, each left a container record
with its first assignment (the 1 GiB default) and no process, which nothing removed: four of
them, from four cgroups, took a 4 GiB GPU, and a victim asking for 64 MiB under its 1 GiB limit
was assigned 0 B and waited for good (the empty records counted as running, so no reclaim).
Now a record belongs to a live process: what a message alone makes is not kept, and a record
whose processes are all gone is dropped at once, its assignment back in the pool; and each
ghost's ask is refused (the replies are checked, not only the records: issue 47)."""
import json
import os
import textwrap
import time

import pytest

from conftest import GiB, MiB, start_in, stop_all
from shim_attack import as_nobody, enforcer, expect, say, shim_sock

pytestmark = pytest.mark.system

GHOST = textwrap.dedent(r'''
    import json, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    f = s.makefile("rb")
    for msg in sys.argv[2:]:
        s.sendall(msg.encode() + b"\n")
        print("reply", json.dumps(json.loads(f.readline())), flush=True)
    print("end", flush=True)
    sys.stdin.readline()
''')
HELLO = '{"op":"hello"}'
ASK = '{"op":"ask","dev":0,"size":%d}'


def test_row39_ghost_records_take_nothing_once_their_process_is_gone(cgroups, build, env5):
    # NVML knows the GPU (the stand-in's), as on a GPU host: a message from a process that opened
    # none of its nodes does not make it a member
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB", "--ctx-overhead", "64MiB",
                   env=dict(os.environ, LD_LIBRARY_PATH=str(build / "standin-nvml")))
    ghosts, victim = [], None
    try:
        for i in range(4):
            g = as_nobody(cgroups(f"ghost{i}"), GHOST, shim_sock(enf), HELLO, ASK % MiB, env=env5)
            hello, ask = (json.loads(" ".join(expect(g, "reply")[1:])) for _ in range(2))
            expect(g, "end")
            # told its limit (what a hello is for), and its ask refused: nothing it opened
            # makes it a member, so nothing may be granted to it (a grant here was a ghost's
            # bytes counted against the GPU until the record went)
            assert {k: v for k, v in hello.items() if k != "credit"} == \
                {"ok": True, "limit": GiB, "devices": {"0": GiB}}, hello
            assert ask == {"ok": True, "deny": f"pid {g.pid} has opened no GPU: nothing to allocate on"}, ask
            say(g)
            g.wait(timeout=30)
            ghosts.append(g)
        names = lambda: [c["name"] for c in enf.ctl(cmd="status")["status"]["containers"]]
        end = time.monotonic() + 5
        while any(n.startswith("ghost") for n in names()) and time.monotonic() < end:
            time.sleep(0.1)
        assert names() == [], "records of processes that are gone"
        # the victim: a CUDA process under its 1 GiB limit asking for 64 MiB runs at once
        victim = start_in(cgroups("victim"), build, env5, "alloc", "-s", "64M", "--hold")
        assert expect(victim, "allocated", timeout=10)[1:3] == ["1", str(64 * MiB)]
        st = enf.ctl(cmd="status")["status"]
        assert [c["name"] for c in st["containers"]] == ["victim"], st["containers"]
        assert st["containers"][0]["gpus"]["0"]["assigned"] == 1024 * MiB
        say(victim)
    finally:
        stop_all(ghosts + [victim], enf)
