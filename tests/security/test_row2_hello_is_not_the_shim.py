"""Issue 24, row 2: a process connects to the 0666 shim socket, says `hello`, then calls
libcuda itself. Before, hello set the "shim" bit of its BPF membership and BPF never stopped
it: 2 GiB under a 256 MiB limit. Now BPF spares only calls made from inside a wrapper of the
enforcer's shim library (a uprobe marks the thread); this process is admitted like anyone and
stopped at its limit. A real shim process still waits in its thread (tests/system/test_shim.py)."""
import textwrap
import time

import pytest

from conftest import MiB, _lines, proc_state, stop_all, wait_state
from shim_attack import as_nobody, enforcer, expect, shim_sock

pytestmark = pytest.mark.system

CHEAT = textwrap.dedent(r'''
    import ctypes, json, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(b'{"op":"hello"}\n')
    print("hello", json.loads(s.makefile("rb").readline())["ok"], flush=True)
    cu = ctypes.CDLL(sys.argv[2])
    cu.cuInit(0)
    d, c = ctypes.c_int(), ctypes.c_void_p()
    cu.cuDeviceGet(ctypes.byref(d), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d)
    cu.cuCtxSetCurrent(c)
    p = ctypes.c_ulonglong()
    for i in range(8):     # 512 MiB, straight into the driver, under a 256 MiB limit
        rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20))
        print("allocated", i + 1, rc, flush=True)
    print("done", flush=True)
    sys.stdin.readline()
''')


def test_row2_hello_then_direct_calls_are_admitted_like_anyones(cgroups, build, env5):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "cheat=256MiB", "--ctx-overhead", "64MiB")
    p = None
    try:
        p = as_nobody(cgroups("cheat"), CHEAT, shim_sock(enf), build / "standin" / "libcuda.so.1", env=env5)
        assert expect(p, "hello")[1] == "True"
        enf.wait_for(f"pid {p.pid} of cheat uses the shim")
        # 64 MiB of context + 3 x 64 MiB fit its 256 MiB; the 4th is stopped before it runs
        got = [expect(p, "allocated", timeout=30)[1:] for _ in range(3)]
        assert got == [["1", "0"], ["2", "0"], ["3", "0"]]
        wait_state(p.pid, "T", timeout=30)      # the 4th call: stopped before it runs
        time.sleep(0.5)
        assert proc_state(p.pid) == "T" and _lines(p.stdout).empty()
        st = enf.ctl(cmd="status")["status"]
        row = next(c for c in st["containers"] if c["name"] == "cheat")
        assert row["gpus"]["0"]["used"] == 3 * 64 * MiB, row
        enf.wait_for(f"pid {p.pid} of cheat called the driver outside the shim")
    finally:
        stop_all([p], enf)
