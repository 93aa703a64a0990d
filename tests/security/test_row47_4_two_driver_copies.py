"""Issue 47, finding 4: a forwarded call across two probed driver copies. A tenant (as `nobody`)
loads a second copy of the driver (another file, dlopen'ed on its own: both are probed) and,
while its cuMemAlloc_v2 of 200 MiB in the first copy sleeps in the driver, calls the second
copy's with the same arguments from a signal handler (`reenter SIZE DELAY COPY`). The inner
entry looks like a forward and took the outer reservation; both calls allocated: 400 MiB held,
`used 200 MiB`. The backstop missed it too: each copy is a client of the driver and NVML lists
the process twice (the stand-in NVML: one row per copy's slot), and `process_memory` took the
larger row.

Now the outer return, which brings a block of its own (not the inner call's), is charged: the
books say 400 MiB; NVML's rows are summed, 400 MiB; past a 300 MiB limit the backstop stops the
tenant within a second. A real forwarder is still charged once (tests/system/test_shim_copies.py)."""
import os
import shutil
import tempfile
import time

import pytest

from conftest import MiB, StandinNvml, popen_in, until, wait_state
from shim_attack import NOBODY, enforcer, expect

pytestmark = pytest.mark.system
BLOCK = 200 * MiB


@pytest.fixture
def second_driver(build):
    """A copy of the stand-in driver under another name, in a directory `nobody` can read."""
    d = tempfile.mkdtemp(prefix="convgpu-copy-")
    os.chmod(d, 0o755)
    path = os.path.join(d, "libcuda-second.so")
    shutil.copy(build / "standin" / "libcuda.so.1", path)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(d, ignore_errors=True)


def nvml_env(build, env):
    """The enforcer sees the stand-in GPU through the stand-in NVML, per-process lists on."""
    return dict(env, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env['LD_LIBRARY_PATH']}", CONVGPU_STANDIN_NVML_PROCS="1")


def gpu0(enf, name):
    st = enf.ctl(cmd="status")["status"]
    return next((c["gpus"]["0"] for c in st["containers"] if c["name"] == name), None)


def tenant(cgroups, build, env, name, copy, *more):
    return popen_in(cgroups(name), *NOBODY, build / "reenter", BLOCK, 100, copy, *more,
                    env=dict(env, CONVGPU_STANDIN_ALLOC_MS="400"))


def test_row47_4_an_outer_call_with_a_block_of_its_own_is_charged(cgroups, build, env5, second_driver):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "copies=1GiB", "--lib", second_driver,
                   env=nvml_env(build, env5))
    t = None
    try:
        assert any(f"probes attached to {second_driver}" in x for x in enf.log), enf.log
        t = tenant(cgroups, build, env5, "copies", second_driver)
        assert expect(t, "allocated", timeout=20)[1:3] == ["2", str(2 * BLOCK)]
        # the driver: two slots of 200 MiB, one per copy; NVML lists the pid twice
        assert StandinNvml(env5["CONVGPU_STANDIN_SHM"]).process_memory()[(t.pid, 0)] == 2 * BLOCK
        g = gpu0(enf, "copies")
        assert (g["used"], g["reserved"]) == (2 * BLOCK, 0), g          # before: 200 MiB used
        until(lambda: gpu0(enf, "copies").get("nvml_used") == 2 * BLOCK, 5,
              f"NVML's two rows summed: {gpu0(enf, 'copies')}")          # before: 200 MiB
    finally:
        if t and t.poll() is None:
            t.kill()
            t.wait()
        enf.close()


def test_row47_4_past_its_limit_the_backstop_stops_it_within_a_second(cgroups, build, env5, second_driver):
    """300 MiB: the inner call fits once the outer one gave its reservation back, and the outer
    call's own block is taken inside the driver, after any check could run: charged at its
    return, and NVML's count (both rows) stops the tenant."""
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "copies=300MiB", "--lib", second_driver,
                   env=nvml_env(build, env5))
    t = None
    try:
        assert any(f"probes attached to {second_driver}" in x for x in enf.log), enf.log
        t = tenant(cgroups, build, env5, "copies", second_driver)
        expect(t, "allocated", timeout=20)
        t0 = time.monotonic()
        wait_state(t.pid, "T", timeout=3)
        took = time.monotonic() - t0
        enf.wait_for("container copies GPU0: over its limit by the driver's count")
        g = gpu0(enf, "copies")
        assert g["over_limit"] and g["nvml_used"] == 2 * BLOCK and g["used"] == 2 * BLOCK, g
        assert took < 1.5, took
    finally:
        if t and t.poll() is None:
            t.kill()
            t.wait()
        enf.close()


def test_row47_4_the_inner_blocks_address_freed_and_taken_again_is_no_forward(cgroups, build, env5, second_driver):
    """The handler frees its block before it returns, and the outer call's block gets the same
    address (the driver hands addresses out again): the same pointer as the inner call's is the
    forward only while the inner call's block is still in the books. Charged: the 200 MiB held."""
    enf = enforcer(build, "--gpu-memory", "4GiB", "--limit", "copies=1GiB", "--lib", second_driver)
    t = None
    try:
        t = tenant(cgroups, build, env5, "copies", second_driver, "free")
        expect(t, "allocated", timeout=20)
        assert expect(t, "reused", timeout=5) == ["reused", "1"]        # the same address, a new block
        assert StandinNvml(env5["CONVGPU_STANDIN_SHM"]).process_memory()[(t.pid, 0)] == BLOCK
        g = gpu0(enf, "copies")
        assert (g["used"], g["reserved"]) == (BLOCK, 0), g               # a pointer compare alone: 0
    finally:
        if t and t.poll() is None:
            t.kill()
            t.wait()
        enf.close()
