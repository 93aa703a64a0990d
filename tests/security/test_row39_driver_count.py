"""Issue 39, part 1: the driver's count is the last word. A tenant (as `nobody`, in its own
cgroup, limited to 256 MiB) obtains memory through calls convgpu does not size at the call; the
stand-in NVML lists each process's memory from the stand-in driver's per-process slots, as
NVML does on a GPU host. Before, such memory went past the limit unseen (`over_limit: false`).
Now the enforcer's backstop stops the tenant within a second or so of the memory appearing,
shows it as over, and a neighbour on the same GPU is untouched throughout."""
import os
import time

import pytest

from conftest import GiB, MiB, StateWatch, popen_in, start_in, stop_all, until, wait_state
from shim_attack import NOBODY, enforcer, expect, say

pytestmark = pytest.mark.system


def nvml_env(build, env):
    """The enforcer sees the stand-in GPU through the stand-in NVML, per-process lists on."""
    return dict(env, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env['LD_LIBRARY_PATH']}", CONVGPU_STANDIN_NVML_PROCS="1")


def row(enf, name):
    return next((c for c in enf.ctl(cmd="status")["status"]["containers"] if c["name"] == name), None)


@pytest.mark.parametrize("over_limit", ["stall", "kill"])
def test_row39_a_module_with_static_data_past_the_limit_is_stopped_by_the_drivers_count(cgroups, build, env5,
                                                                                          over_limit):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "tenant=256MiB", "--limit", "neighbour=1GiB",
                   "--over-limit", over_limit, env=nvml_env(build, env5))
    tenant = neighbour = None
    try:
        neighbour = start_in(cgroups("neighbour"), build, env5, "alloc", "-s", "512M", "--hold")
        assert expect(neighbour, "allocated", timeout=10)[1:3] == ["1", str(512 * MiB)]
        st = enf.ctl(cmd="status")["status"]
        assert st["gpus"]["0"]["backstop"] == "on"
        watch = StateWatch(neighbour.pid).start()      # the neighbour, from before the tenant to the end
        # a module from a file (cuModuleLoad): no probe reads a file's size at the call
        image = os.path.join(enf.run_dir, "module.bin")      # 0755: nobody reads it
        with open(image, "w") as f:
            f.write(f"CONVGPU-STANDIN-MODULE {GiB}\n")
        os.chmod(image, 0o644)
        tenant = popen_in(cgroups("tenant"), *NOBODY, build / "cgcaller", "module", "--image", image, "--from-file",
                          "--hold", env=env5)
        t0 = time.monotonic()
        expect(tenant, "allocated", timeout=10)         # the module is loaded: 1 GiB, no admitted call
        if over_limit == "stall":
            wait_state(tenant.pid, "T", timeout=3)
            took = time.monotonic() - t0
            until(lambda: row(enf, "tenant") and row(enf, "tenant")["gpus"]["0"]["over_by"] > 0, 3, "shown as over")
            g = row(enf, "tenant")["gpus"]["0"]
            assert g["over_limit"] and g["nvml_used"] == GiB and g["over_by"] == GiB - 256 * MiB, g
            assert took < 3, took
            enf.wait_for("container tenant GPU0: over its limit by the driver's count")
        else:
            assert tenant.wait(timeout=3) == -9
            enf.wait_for("container tenant GPU0: over its limit by the driver's count")
            enf.wait_for(f"pid {tenant.pid} killed")
        # the neighbour ran throughout: never stopped (every thread, sampled from before the
        # tenant started until a second after the backstop acted: two more of its passes), its
        # 512 MiB its own
        time.sleep(1.0)
        seen = watch.stop()
        assert len(seen) >= 200 and not set(seen) & {"T", "t"}, sorted(set(seen))
        g = row(enf, "neighbour")["gpus"]["0"]
        assert (g["used"], g["over_by"], g["over_limit"]) == (512 * MiB, 0, False), g
        say(neighbour)
    finally:
        stop_all([tenant, neighbour], enf)
