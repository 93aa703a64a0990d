"""Copies of the shim (docs/ENFORCE.md, "Forwarded calls"). A tenant's copy exports the driver's
names and forwards to the driver, so it is probed as a driver: one allocation enters twice on
one thread, and only one of the two is charged or stays reserved. The copy pods mount is the
enforcer's own (paths.offered_shim): marked as the shim's, so its calls wait in the shim."""
import os
import shutil
import time

import pytest

from conftest import Enforcing, GiB, MiB, StateWatch, popen_in, read_until, shim_env, start_in, stop_all, until

pytestmark = pytest.mark.system


def _gpu0(enf, name):
    """The container's row for GPU0; None once it is gone (no process left)."""
    st = enf.ctl(cmd="status")["status"]
    return next((c["gpus"]["0"] for c in st["containers"] if c["name"] == name), None)


def test_a_tenants_copy_probed_as_a_driver_is_admitted_once(cgroups, build, env5, tmp_path):
    from convgpu.paths import shim_library
    copy = tmp_path / "libmine.so"           # a tenant's copy: a file the enforcer never made
    shutil.copy(shim_library(), copy)
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--limit", "tenant=1GiB", "--lib", str(copy))
    a = None
    try:
        enf.wait_for(f"{copy}")              # probed as a driver, like any file exporting its names
        env = dict(shim_env(env5, enf), LD_PRELOAD=str(copy))
        a = start_in(cgroups("tenant"), build, env, "alloc", "-n", 2, "-s", 256 * MiB, "--hold")
        assert f"allocated 2 {512 * MiB} pid={a.pid}" in read_until(a, "ready")
        # each allocation entered the copy's wrapper, then the driver: charged once, and the
        # copy's reservation given back (before the fix: reserved 512 MiB, for good)
        g = _gpu0(enf, "tenant")
        assert (g["used"], g["reserved"]) == (512 * MiB, 0), g
        a.stdin.write("\n")
        a.stdin.flush()
        assert a.wait(timeout=20) == 0
        def gone():
            g = _gpu0(enf, "tenant")
            return g is None or (g["used"], g["reserved"]) == (0, 0)
        until(gone, 10, "the exit gave everything back")
    finally:
        stop_all((a,), enf)


def test_the_copy_pods_mount_is_the_enforcers_and_waits_in_the_shim(cgroups, build, env5):
    from convgpu.kube.agent import offer_shim
    from convgpu.paths import shim_library
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--limit", "big=3GiB", "--limit", "pod=2GiB")
    a = b = None
    try:
        offered = os.path.join(enf.run_dir, "lib", "libconvgpu.so")
        assert open(offered, "rb").read() == open(shim_library(), "rb").read()
        assert any(f"shim wrappers marked in {offered} (" in x for x in enf.log), enf.log
        ino = os.stat(offered).st_ino
        assert offer_shim(enf.run_dir).lib == offered and os.stat(offered).st_ino == ino   # the agent keeps it
        # `big` takes 3 GiB of 4; the pod (under the offered copy) asks 2 GiB: it waits in its
        # thread (state S), never stopped (T) for its assignment, and runs once big is gone
        a = start_in(cgroups("big"), build, env5, "alloc", "-n", 1, "-s", 3 * GiB, "--hold")
        read_until(a, "ready")
        env = dict(shim_env(env5, enf), LD_PRELOAD=offered)
        b = start_in(cgroups("pod"), build, env, "alloc", "-n", 1, "-s", 2 * GiB, "--hold")
        enf.wait_for(f"stall pod pid {b.pid} on GPU0 (shim, waits in its thread)")
        watch = StateWatch(b.pid).start()    # every thread, over a second: asleep, never stopped
        time.sleep(1.0)
        seen = watch.stop()
        assert len(seen) >= 200 and set(seen) == {"S"}, sorted(set(seen))
        a.stdin.write("\n")
        a.stdin.flush()
        assert f"allocated 1 {2 * GiB} pid={b.pid}" in read_until(b, "ready")
        g = _gpu0(enf, "pod")
        assert (g["used"], g["reserved"]) == (2 * GiB, 0), g
    finally:
        stop_all((a, b), enf)


def test_the_same_call_reentered_from_a_signal_handler_stays_counted(cgroups, build, env5):
    """Not a forwarder: the same call at the same site, entered again from a signal handler
    while the first is inside the driver. The first call's allocation is not settled at its
    return (one call slot a thread), so its reservation must stay: the two 256 MiB blocks are
    all counted, 256 MiB used and 256 MiB reserved. Released as for a forwarder, 256 MiB would
    be held and counted nowhere."""
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--limit", "nested=1GiB")
    a = None
    try:
        env = dict(env5, CONVGPU_STANDIN_ALLOC_MS="400")
        a = popen_in(cgroups("nested"), build / "reenter", 256 * MiB, 100, env=env)
        assert f"allocated 2 {512 * MiB} pid={a.pid}" in read_until(a, "ready")
        g = _gpu0(enf, "nested")
        assert (g["used"], g["reserved"]) == (256 * MiB, 256 * MiB), g
    finally:
        stop_all((a,), enf)
