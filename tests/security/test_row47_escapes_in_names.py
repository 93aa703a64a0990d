"""Issue 47, finding 6: a process that names itself `\\x1b]0;PWNED\\x07\\x1b[8m` (PR_SET_NAME: set
the terminal's title, then hide what follows) put those escapes raw into 9 lines of `convgpu
trace`. Now every name a tenant chooses is shown printable: as nobody, that process, in a cgroup
whose own name carries escapes too, making CUDA calls: `convgpu trace` (alone, and asking a
running enforcer), `convgpu status` and the enforcer's log lines carry no raw ESC or BEL and show
the escaped form; `status --json` is valid JSON that gives the name back exactly."""
import json
import subprocess
import sys
import textwrap

import pytest

from conftest import stop_all
from shim_attack import as_nobody, enforcer, expect, say

pytestmark = pytest.mark.system

NAME = "\x1b]0;PWNED\x07\x1b[8m"           # 14 bytes: fits a comm (15)
SHOWN = "\\x1b]0;PWNED\\x07\\x1b[8m"
CGROUP = "c\x1b]0;OWNED\x07"                # a cgroup's name is its creator's too
CG_SHOWN = "c\\x1b]0;OWNED\\x07"
RENAMED = textwrap.dedent(r'''
    import ctypes, select, sys
    ctypes.CDLL(None).prctl(15, sys.argv[2].encode(), 0, 0, 0)     # PR_SET_NAME
    print("started", flush=True)
    sys.stdin.readline()                                             # moved into its cgroup meanwhile
    cu = ctypes.CDLL(sys.argv[1])
    cu.cuInit(0)
    d, c, p = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_ulonglong()
    cu.cuDeviceGet(ctypes.byref(d), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d)
    cu.cuCtxSetCurrent(c)
    print("ready", open("/proc/self/comm").read().strip() == sys.argv[2], flush=True)
    while not select.select([sys.stdin], [], [], 0.1)[0]:   # events for the view, until told
        cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 20))
        cu.cuMemFree_v2(p)
''')


def clean(out: str, what: str):
    """No raw title, bell or conceal escape; the view's own colours are not asked for (a pipe)."""
    for raw in ("\x1b]", "\x07", "\x1b[8m", "\x1b"):
        assert raw not in out, (what, raw, out[-3000:])


def seen(out: str, pid: int):
    """The view's rows: the container, its process (the cell cut at 22 columns) and the events'
    comm (its column holds 12 characters since issue 52's layout: the escaped form's first ones,
    then an ellipsis), each escaped."""
    assert CG_SHOWN in out and f"{pid} \\x1b]0;PWNED" in out and "\\x1b]0;PWNE…" in out, out[-3000:]


def trace(lib, env, *more) -> str:
    r = subprocess.run([sys.executable, "-m", "convgpu.cli.main", "trace", "--duration", "3", "--interval", "0.2",
                        "--demo", "never", "--no-discover", "--no-selftest", "--lib", str(lib), *more],
                       capture_output=True, text=True, timeout=60, env=dict(env, COLUMNS="100"))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_row47_terminal_escapes_in_names_are_shown_escaped(cgroups, build, caller_env):
    lib = build / "standin" / "libcuda.so.1"
    p = as_nobody(cgroups("plain"), RENAMED, lib, NAME, env=caller_env)
    enf = None
    try:
        expect(p, "started")
        (cgroups(CGROUP) / "cgroup.procs").write_text(str(p.pid))   # by root: no shell reads the name
        say(p)
        assert expect(p, "ready") == ["ready", "True"]
        out = trace(lib, caller_env)                      # no enforcer: trace's own view
        clean(out, "trace")
        seen(out, p.pid)
        enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB")
        enf.wait_for(f"container {CG_SHOWN} (cgroup): limit 1.0 GiB")   # placed at its next call, said printable
        st = enf.cli("status")
        clean(st.stdout, "status")
        assert CG_SHOWN in st.stdout, st.stdout
        raw = enf.cli("status", "--json").stdout
        clean(raw, "status --json")
        [c] = [c for c in json.loads(raw)["containers"] if p.pid in c["pids"]]
        assert c["name"] == CGROUP
        out = trace(lib, caller_env, "--run-dir", enf.run_dir)   # the enforcer's view, asked for
        clean(out, "trace of the enforcer")
        seen(out, p.pid)
        say(p)
        enf.stop()
        clean("\n".join(enf.log), "the enforcer's log")
        assert any(CG_SHOWN in x for x in enf.log)
    finally:
        stop_all([p], *([enf] if enf else []))
