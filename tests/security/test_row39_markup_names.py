"""Issue 39, part 6, attack 2: a process that renames itself `[/x]` (PR_SET_NAME) and makes CUDA
calls. Before, `convgpu trace`'s live view ended with rich's MarkupError at its next frame
(cli/view.py handed the comm to a table as a str, which rich parses as markup). Now every
string that comes from a process or a container is text: the view draws it as it is."""
import subprocess
import sys
import textwrap

import pytest

from conftest import stop_all
from shim_attack import as_nobody, expect, say

pytestmark = pytest.mark.system

RENAMED = textwrap.dedent(r'''
    import ctypes, sys
    libc = ctypes.CDLL(None)
    libc.prctl(15, b"[/x]", 0, 0, 0)          # PR_SET_NAME
    cu = ctypes.CDLL(sys.argv[1])
    cu.cuInit(0)
    d, c, p = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_ulonglong()
    cu.cuDeviceGet(ctypes.byref(d), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d)
    cu.cuCtxSetCurrent(c)
    print("ready", flush=True)
    import select
    while not select.select([sys.stdin], [], [], 0.1)[0]:   # events for the view, until told
        cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 20))
        cu.cuMemFree_v2(p)
''')


def test_row39_a_process_named_like_markup_is_drawn_as_text(cgroups, build, caller_env):
    lib = build / "standin" / "libcuda.so.1"
    p = as_nobody(cgroups("renamed"), RENAMED, lib, env=caller_env)
    tr = None
    try:
        expect(p, "ready")
        tr = subprocess.run([sys.executable, "-m", "convgpu.cli.main", "trace", "--duration", "3", "--interval",
                             "0.2", "--demo", "never", "--no-discover", "--no-selftest", "--lib", str(lib)],
                            capture_output=True, text=True, timeout=60, env=dict(caller_env, COLUMNS="100"))
        assert tr.returncode == 0, tr.stderr[-2000:]
        assert "MarkupError" not in tr.stderr
        assert f"{p.pid} [/x]" in tr.stdout, tr.stdout[-3000:]
        say(p)
    finally:
        stop_all([p], None)
