"""Issue 39, part 2: what has a size at the call is admitted at the call, before the memory
exists. Tenants as `nobody`, each in its own cgroup, on the stand-in (8,192 resident threads: a
stack byte costs 8,192): a 64 KiB stack (504 MiB) and a 1 GiB graph memory node under 256 MiB
obtain nothing (the stand-in's own per-process count stays at 0); a 16 KiB stack (120 MiB) and
a 128 MiB graph under their limits run, charged exactly, and the graph's charge goes with its
executable graph. Before, both went past the limit unseen (17 GiB and 2.5 GiB on an H200). A
neighbour on the same GPU runs untouched throughout."""
import pytest

from conftest import MiB, StandinNvml, popen_in, start_in, stop_all, until, wait_state
from shim_attack import NOBODY, enforcer, expect, say

pytestmark = pytest.mark.system
RESIDENT = 8192


def tenant(cgroups, build, env, name, *args):
    return popen_in(cgroups(name), *NOBODY, build / "cgcaller", *args, "--hold", env=env)


def row(enf, name):
    return next(c for c in enf.ctl(cmd="status")["status"]["containers"] if c["name"] == name)


def test_row39_a_stack_limit_and_a_graph_node_are_admitted_at_the_call(cgroups, build, env5):
    env = dict(env5, CONVGPU_STANDIN_RESIDENT_THREADS=str(RESIDENT))
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "256MiB", "--limit", "neighbour=1GiB",
                   env=dict(env, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env['LD_LIBRARY_PATH']}"))
    slots = StandinNvml(env["CONVGPU_STANDIN_SHM"])
    procs = []
    try:
        assert any(f"resident threads per GPU (a stack byte costs that many): GPU0 {RESIDENT}" in x for x in enf.log)
        neighbour = start_in(cgroups("neighbour"), build, env, "alloc", "-s", "512M", "--hold")
        procs.append(neighbour)
        assert expect(neighbour, "allocated", timeout=10)[1:3] == ["1", str(512 * MiB)]
        # past the limit: stopped at the call, before the driver took anything
        big_stack = tenant(cgroups, build, env, "bigstack", "stack", "-s", "64K")
        big_graph = tenant(cgroups, build, env, "biggraph", "graph", "-s", "1G")
        procs += [big_stack, big_graph]
        for p in (big_stack, big_graph):
            wait_state(p.pid, "T", timeout=20)
            enf.wait_for("above its limit 256.0 MiB: stalled until the limit is raised")   # said once each
        said = "\n".join(enf.log)
        assert f"stall bigstack pid {big_stack.pid} on GPU0: cuCtxSetLimit 504.0 MiB" in said
        assert f"stall biggraph pid {big_graph.pid} on GPU0: cuGraphInstantiateWithFlags 1.0 GiB" in said
        assert {pid: n for (pid, _), n in slots.process_memory().items() if pid in (big_stack.pid, big_graph.pid)} == {}
        # within the limit: runs, charged exactly what it took
        stack = tenant(cgroups, build, env, "stack", "stack", "-s", "16K")
        graph = tenant(cgroups, build, env, "graph", "graph", "-s", "128M", "--hold-freed")
        procs += [stack, graph]
        expect(stack, "allocated", timeout=20), expect(graph, "allocated", timeout=20)
        taken = {pid: n for (pid, _), n in slots.process_memory().items()}
        assert taken[stack.pid] == RESIDENT * 15 * 1024 == 120 * MiB and taken[graph.pid] == 128 * MiB
        assert row(enf, "stack")["gpus"]["0"]["used"] == 120 * MiB
        assert row(enf, "graph")["gpus"]["0"]["used"] == 128 * MiB
        say(graph)                                  # freed: the executable graph destroyed, trimmed
        expect(graph, "freed", timeout=20)
        until(lambda: row(enf, "graph")["gpus"]["0"]["used"] == 0, 5, "the graph's charge given back")
        g = row(enf, "neighbour")["gpus"]["0"]
        assert (g["used"], g["over_limit"]) == (512 * MiB, False)
        assert open(f"/proc/{neighbour.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T"
    finally:
        stop_all(procs, enf)
