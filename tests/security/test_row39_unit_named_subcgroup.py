"""Issue 39, part 6, attack 3: a tenant with a delegated plain cgroup makes TENANT/victim.service
and moves itself into it. Before, that joined the container of the unit victim.service (a unit
was named by its last component): the tenant allocated 512 MiB against its own 256 MiB limit,
charged to the victim, and the victim's next process stalled within its 1 GiB. Now a container
is its cgroup path, and a delegated tree is its delegate's: the tenant is held at its own
256 MiB, and the victim runs untouched. Delegated by chown, or by a root-owned directory that
anyone may write (issue 47's mutation audit: that case had no test)."""
import os
import textwrap

import pytest

from conftest import MiB, start_in, stop_all, wait_state
from shim_attack import as_nobody, enforcer, expect, say

pytestmark = pytest.mark.system

MOVE_THEN_ALLOCATE = textwrap.dedent(r'''
    import ctypes, os, sys
    sub = os.path.join(sys.argv[1], "victim.service")
    os.mkdir(sub)                                   # its delegated cgroup: its to make
    with open(os.path.join(sub, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    print("moved", open("/proc/self/cgroup").read().strip().split("::")[-1], flush=True)
    cu = ctypes.CDLL(sys.argv[2])
    cu.cuInit(0)
    d, c, p = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_ulonglong()
    cu.cuDeviceGet(ctypes.byref(d), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d)
    cu.cuCtxSetCurrent(c)
    for i in range(8):                              # 512 MiB under its 256 MiB
        rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20))
        print("allocated", i + 1, rc, flush=True)
    sys.stdin.readline()
''')


def delegate(cg, user="nobody"):
    """cgroup v2 delegation (Documentation/admin-guide/cgroup-v2.rst): the directory and its
    cgroup.procs, cgroup.threads and cgroup.subtree_control to the delegate."""
    import pwd
    uid = pwd.getpwnam(user).pw_uid
    for f in ("", "cgroup.procs", "cgroup.threads", "cgroup.subtree_control"):
        os.chown(os.path.join(cg, f), uid, -1)


def open_to_all(cg):
    """A root-owned cgroup anyone may write (a careless set-up, not delegation proper): anyone
    can make sub-cgroups in it and move processes between them, so it is delegated to anyone."""
    for f, mode in (("", 0o777), ("cgroup.procs", 0o666), ("cgroup.threads", 0o666)):
        os.chmod(os.path.join(cg, f), mode)


@pytest.mark.parametrize("how", ["chown", "world-writable"])
def test_row39_a_unit_named_sub_cgroup_stays_its_delegates(cgroups, build, env5, how):
    tenant, victim_cg = cgroups("tenant"), cgroups("victim.service")
    if how == "chown":
        delegate(tenant)
    else:
        open_to_all(tenant)
        assert os.stat(tenant).st_uid == 0
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "tenant=256MiB", "--limit", "victim=1GiB")
    t = v = None
    try:
        t = as_nobody(tenant, MOVE_THEN_ALLOCATE, tenant, build / "standin" / "libcuda.so.1", env=env5)
        assert expect(t, "moved")[1].endswith("/tenant/victim.service")
        assert [expect(t, "allocated", timeout=30)[1:] for _ in range(4)] == [[str(i), "0"] for i in range(1, 5)]
        wait_state(t.pid, "T", timeout=30)          # the 5th: past its own 256 MiB, stopped before it ran
        v = start_in(victim_cg, build, env5, "alloc", "-s", "256M", "--hold")
        assert expect(v, "allocated", timeout=10)[1:3] == ["1", str(256 * MiB)]
        st = {c["name"]: c for c in enf.ctl(cmd="status")["status"]["containers"]}
        assert st["tenant"]["cgroup"].endswith("/tenant") and st["tenant"]["limit"] == 256 * MiB
        assert st["tenant"]["gpus"]["0"]["used"] == 256 * MiB
        assert st["victim"]["cgroup"].endswith("/victim.service") and st["victim"]["limit"] == 1024 * MiB
        assert st["victim"]["gpus"]["0"]["used"] == 256 * MiB
        say(v)
    finally:
        stop_all([t, v], enf)
