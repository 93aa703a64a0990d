"""The shim-only enforcer (`--no-probes`) follows exec and exit without eBPF: the kernel's
process connector (netlink, through pyroute2) reports them, as BPF's sched_process_exec/exit
tracepoints do in probe mode. An exec replaces the process image and the driver releases its
memory with it, so the books must drop what the old image held; the new image, under the shim
again, starts empty."""
import subprocess
import sys
import time

import pytest

from conftest import MiB, Enforcing, cuda_prelude, popen_in, shim_env

pytestmark = pytest.mark.system


def _used(enf, name):
    for c in enf.ctl(cmd="status")["status"]["containers"]:
        if c["name"] == name:
            return {int(d): (g["used"], g["contexts"]) for d, g in c["gpus"].items()}
    return None


def test_exec_drops_what_the_old_image_held(cgroups, build, env5):
    enf = Enforcing(build, "--gpu-memory", "5GiB", "--limit", "execs=2GiB", no_bpf=True)
    lib = str(build / "standin" / "libcuda.so.1")
    # the new image: a context and 8 MiB, then one line, then it waits
    after = cuda_prelude(lib) + (
        f"p=ctypes.c_ulonglong(); assert cu.cuMemAlloc_v2(ctypes.byref(p), {8 * MiB}) == 0\n"
        "print('after', flush=True); sys.stdin.readline()\n")
    before = cuda_prelude(lib) + (
        "p=ctypes.c_ulonglong()\n"
        f"assert cu.cuMemAlloc_v2(ctypes.byref(p), {64 * MiB}) == 0\n"
        "print('before', flush=True); sys.stdin.readline()\n"
        f"os.execv(sys.executable, [sys.executable, '-c', {after!r}])\n")
    p = popen_in(cgroups("execs"), sys.executable, "-c", before, env=shim_env(env5, enf))
    try:
        assert p.stdout.readline().strip() == "before"
        deadline = time.monotonic() + 10
        while _used(enf, "execs") != {0: (64 * MiB, 1)} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _used(enf, "execs") == {0: (64 * MiB, 1)}
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "after"
        deadline = time.monotonic() + 10
        while _used(enf, "execs") != {0: (8 * MiB, 1)} and time.monotonic() < deadline:
            time.sleep(0.05)
        # the old image's 64 MiB and context are gone: the new image's are all that is charged
        assert _used(enf, "execs") == {0: (8 * MiB, 1)}
    finally:
        p.kill()
        p.wait()
        enf.close()


@pytest.mark.parametrize("connector", [True, False], ids=["connector", "image-check"])
def test_the_ledger_sees_an_exec(root, connector):
    """The ledger alone: the connector's event, or (no connector: a kernel without
    CONFIG_PROC_EVENTS, or one before 6.6 without CAP_NET_ADMIN) the image comparison once a
    second, turns an exec into the same event BPF's exec tracepoint gives, with what it held."""
    from convgpu.probes.ledger import IMAGE_CHECK_S, Ledger
    led = Ledger().start()
    if not connector:
        led._pe.close()
        led._pe = None
    p = subprocess.Popen(["/bin/sh", "-c", "read x; exec /bin/sleep 30"], stdin=subprocess.PIPE, text=True)
    try:
        time.sleep(0.1)   # sh runs (the fork's own exec is behind us)
        led.watch(p.pid)
        led.alloc(p.pid, 0, 3 * MiB)
        assert led.poll()[-1].op == "alloc"
        p.stdin.write("\n")
        p.stdin.flush()
        deadline = time.monotonic() + IMAGE_CHECK_S + 2
        got = []
        while time.monotonic() < deadline and not got:
            got = [(e.op, e.pid, e.size) for e in led.poll() if e.op in ("exec", "exit")]
            time.sleep(0.02)
        assert got == [("exec", p.pid, 4 * MiB)]    # footprint: 2 MiB pages above 1 MiB
        assert [u for u in led.usage() if u.pid == p.pid] == []
    finally:
        p.kill()
        p.wait()
        led.close()
