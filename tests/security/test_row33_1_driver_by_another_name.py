"""Issue 33, row 1: a copy of the driver under another name, loaded by nobody in its own cgroup
under a 256 MiB limit: `cp libcuda.so.1 /tmp/x/libgpu.so` and dlopen it; a memfd copy; and
dlopen("/proc/self/fd/N") of an open copy. Before: discovery reacted to files *named*
libcuda.so* and the scan kept only paths that looked like it: 512 MiB allocated, nothing in the
log, `status` empty. Now the process is stopped at its open of a GPU device node (matched by
device number in BPF: here the stand-in's nodes carry the cpuid major, CONVGPU_GPU_MAJORS), the
files it maps are looked up by what they export (probes/nodes.py), the copy is probed before it
goes on, and it is stopped at its limit; a neighbour is untouched. Also: a process that opens the
nodes and maps no driver (an NVML-only tool) is let go and not stopped again."""
import os
import shutil
import sys
import textwrap
import time

import pytest

from attack import CPUID, NOBODY, as_nobody, gpu_nodes, scratch  # noqa: F401
from conftest import MiB, cuda_prelude, need, popen_in, proc_state, rest_of, stop_all, wait_state
from shim_attack import enforcer, expect, say

pytestmark = [pytest.mark.system, pytest.mark.exclusive]   # discovery reaches every driver file on the host

ATTACK = textwrap.dedent(r'''
    import ctypes, os, sys
    how, src = sys.argv[1], sys.argv[2]
    if how == "copy":                      # cp libcuda.so.1 /tmp/x/libgpu.so; dlopen it
        path = os.path.join(sys.argv[3], "libgpu.so")
        with open(src, "rb") as f, open(path, "wb") as g:
            g.write(f.read())
    elif how == "memfd":                   # a memfd copy, dlopen'ed through /proc/self/fd
        fd = os.memfd_create("gpu")
        os.write(fd, open(src, "rb").read())
        path = f"/proc/self/fd/{fd}"
    else:                                  # dlopen("/proc/self/fd/N") of a copy held open
        path = os.path.join(sys.argv[3], "x.bin")
        with open(src, "rb") as f, open(path, "wb") as g:
            g.write(f.read())
        path = f"/proc/self/fd/{os.open(path, os.O_RDONLY)}"
    cu = ctypes.CDLL(path)
    cu.cuInit(0)
    d, c = ctypes.c_int(), ctypes.c_void_p()
    cu.cuDeviceGet(ctypes.byref(d), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d)
    cu.cuCtxSetCurrent(c)
    p = ctypes.c_ulonglong()
    for i in range(8):                     # 512 MiB under a 256 MiB limit
        print("allocated", i + 1, cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20)), flush=True)
    print("done", flush=True)
    sys.stdin.readline()
''')
NEIGHBOUR = "{prelude}p=ctypes.c_ulonglong()\nprint('allocated', cu.cuMemAlloc_v2(ctypes.byref(p), " \
            "ctypes.c_size_t(128 << 20)), flush=True)\nsys.stdin.readline()\n"
NVML_ONLY = textwrap.dedent(r'''
    import os, sys, time
    fds = [os.open(os.path.join(sys.argv[1], n), os.O_RDONLY) for n in ("nvidiactl", "nvidia0")]
    print("opened", flush=True)
    for _ in range(20):                    # an exporter polls: opens again and again
        os.close(os.open(os.path.join(sys.argv[1], "nvidia0"), os.O_RDONLY))
        time.sleep(0.01)
    print("polled", flush=True)
    sys.stdin.readline()
''')


def _enforcer(build):
    env = dict(os.environ, CONVGPU_GPU_MAJORS=str(CPUID))
    return enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "256MiB", "--ctx-overhead", "0",
                    "--discover", env=env, start_timeout=120)


@pytest.mark.parametrize("how", ["copy", "memfd", "procfd"])
def test_row33_1_a_renamed_driver_is_probed_before_it_goes_on(cgroups, build, env5, scratch, gpu_nodes, how):
    enf = _enforcer(build)
    env = {k: v for k, v in env5.items() if k != "LD_LIBRARY_PATH"}   # nothing loads libcuda by name
    env["CONVGPU_STANDIN_DEVNODES"] = str(gpu_nodes)
    attacker = neighbour = None
    try:
        neighbour = popen_in(cgroups("neighbour"), sys.executable, "-c",
                             NEIGHBOUR.format(prelude=cuda_prelude(build / "standin" / "libcuda.so.1")), env=env5)
        assert expect(neighbour, "allocated")[1] == "0"
        attacker = popen_in(cgroups("attacker"), *as_nobody(sys.executable, "-c", ATTACK, how,
                                                            build / "standin" / "libcuda.so.1",
                                                            scratch / "attacker"), env=env)
        got = [expect(attacker, "allocated", timeout=60)[1:] for _ in range(4)]
        assert got == [["1", "0"], ["2", "0"], ["3", "0"], ["4", "0"]]      # 256 MiB: its limit
        wait_state(attacker.pid, "T", timeout=30)                          # the fifth: stopped
        time.sleep(0.5)
        assert proc_state(attacker.pid) == "T"
        st = enf.ctl(cmd="status")["status"]
        row = next(c for c in st["containers"] if c["name"].endswith("attacker"))
        assert row["gpus"]["0"]["used"] == 256 * MiB, row
        line = enf.wait_for(f"pid {attacker.pid} opened the GPU and maps", 10)
        assert "exports the driver's entry points under another name: probed before it goes on" in line, line
        if how == "copy":
            assert str(scratch / "attacker" / "libgpu.so") in line
        elif how == "memfd":
            assert "/memfd:gpu" in line
        # the neighbour: never stopped, its 128 MiB counted, nothing else
        assert proc_state(neighbour.pid) != "T"
        row = next(c for c in st["containers"] if c["name"].endswith("neighbour"))
        assert row["gpus"]["0"]["used"] == 128 * MiB, row
        assert [u for u in st["unprobed"] if u["pid"] in (attacker.pid, neighbour.pid)] == [], \
            [x for x in enf.log + rest_of(enf.p.stderr, 1) if str(neighbour.pid) in x or "loop" in x]
    finally:
        stop_all([attacker, neighbour], enf)


def test_row33_1_a_container_copies_its_mounted_driver(root, build, scratch, gpu_nodes):
    """The same in a podman container (runc), as its uid 65534: it copies the driver mounted
    into it (/build/standin, read-only) into a memfd (its /dev/shm and /tmp are noexec or not
    its own), the GPU nodes given with --device. Probed at its cuInit's node open, stopped at
    its 256 MiB."""
    from podman import Container
    enf = _enforcer(build)
    c = None
    try:
        nodes = [f"--device={gpu_nodes / n}:/dev/{n}" for n in ("nvidiactl", "nvidia-uvm", "nvidia0")]
        c = Container(build, "/usr/bin/python3", "-c", ATTACK, "memfd", "/build/standin/libcuda.so.1", "/tmp",
                      extra=nodes, env={"CONVGPU_STANDIN_DEVNODES": "/dev", "LD_LIBRARY_PATH": "",
                                        "CONVGPU_STANDIN_SHM": f"/convgpu-row33-1-{os.getpid()}"})
        got = [expect(c.p, "allocated", timeout=90)[1:] for _ in range(4)]
        assert got == [["1", "0"], ["2", "0"], ["3", "0"], ["4", "0"]]
        wait_state(c.pid, "T", timeout=30)
        line = enf.wait_for(f"pid {c.pid} opened the GPU and maps /memfd:gpu", 10)
        assert "probed before it goes on" in line
        box = next(x for x in enf.ctl(cmd="status")["status"]["containers"] if c.pid in x["pids"])
        assert box["id"] == c.id and box["gpus"]["0"]["used"] == 256 * MiB, box
    finally:
        if c is not None:
            c.remove()
        stop_all([], enf)


def test_row33_1_nvml_only_tools_are_not_stalled(cgroups, build, scratch, gpu_nodes):
    """A process that opens the GPU's nodes and maps no driver (nvidia-smi, an exporter) is
    looked at once, let go, and not stopped again however often it opens them."""
    enf = _enforcer(build)
    tool = None
    try:
        tool = popen_in(cgroups("exporter"), *as_nobody(sys.executable, "-c", NVML_ONLY, gpu_nodes))
        expect(tool, "opened", timeout=20)
        expect(tool, "polled", timeout=20)
        assert proc_state(tool.pid) != "T"
        st = enf.ctl(cmd="status")["status"]
        assert [u for u in st["unprobed"] if u["pid"] == tool.pid] == []
        assert not [x for x in enf.log if f"pid {tool.pid} " in x and "maps" in x]
        assert st["discovery"]["node_stops"] == 1, st["discovery"]   # its first open only
    finally:
        stop_all([tool], enf)
