"""Issue 24 row 8: a container given cgroup delegation makes a sub-cgroup named like its
neighbour (libpod-<victim id>) and moves itself in. The innermost name used to win: it was
charged as the victim, and a --stall freezer stall of it froze the victim. Now a container is
the runtime's own cgroup, the outermost match at a place only the runtime makes
(enforcer/tenants/containers.py, runtime_container): the attacker is charged to itself, and its
stall freezes its own cgroup (its sub-cgroup with it), never the victim's. Real enforcer (in a
thread) on the stand-in driver; victim and attacker in podman containers, the attacker as
nobody with its cgroup delegated to it (chowned, cgroup v2 mounted in: what delegation is)."""
import os
import time
from pathlib import Path

import pytest

from conftest import GiB, MiB, inprocess_enforcer, lines_until, remove_cgroup, serving, until
from convgpu.enforcer.failsafe.stall import make_stopper
from convgpu.enforcer.tenants.containers import cgroup_layout
from podman import Container

pytestmark = pytest.mark.system
LIMIT = 256 * MiB
NOBODY = 65534
# the attacker, as nobody: a sub-cgroup of its own named like the victim, itself moved in,
# then an allocation above its limit, so that it is stalled (frozen)
ATTACK = """CG=$(sed -n 's/^0:://p' /proc/self/cgroup); i=0
until mkdir "/cg$CG/libpod-$VICTIM" 2>/dev/null; do i=$((i+1)); [ $i -gt 400 ] && exit 3; sleep 0.05; done
echo $$ > "/cg$CG/libpod-$VICTIM/cgroup.procs" || exit 4
exec /build/cgcaller alloc -n 1 -s 512M --hold"""


def frozen(v2: Path, cgroup: str) -> bool:
    return "frozen 1" in (v2 / cgroup.lstrip("/") / "cgroup.events").read_text()


def test_row8_a_subcgroup_named_like_a_neighbour_is_its_own_container(root, build):
    lay = cgroup_layout()
    v2 = Path(lay.v2_root)
    enf = inprocess_enforcer(build / "standin" / "libcuda.so.1", "row8", LIMIT, capacity={0: 2 * GiB},
                             stopper=make_stopper("freezer-v2"))
    env = {"CONVGPU_STANDIN_CAPACITY": str(4 * GiB)}
    victim = attacker = None
    sub = None
    with serving(enf):
        try:
            victim = Container(build, "/build/cgcaller", "alloc", "-n", 1, "-s", 64 * MiB, "--hold", env=env)
            lines_until(victim.p.stdout, lambda line: line == "ready", [], 30, "victim")
            attacker = Container(build, "/bin/sh", "-c", ATTACK, env={**env, "VICTIM": victim.id},
                                 extra=("-v", f"{v2}:/cg:rw"))
            own = v2 / attacker.cgroup.lstrip("/")
            for f in (own, own / "cgroup.procs"):     # delegated to the tenant
                os.chown(f, NOBODY, NOBODY)
            sub = own / f"libpod-{victim.id}"
            until(lambda: attacker.cgroup.endswith(f"/libpod-{victim.id}"), 30,
                  "the attacker never moved into its sub-cgroup")
            # over its limit: it waits, and with it its whole container, frozen
            until(lambda: any(c["gpus"].get("0", {}).get("waiting") for c in enf.status()["containers"]
                              if attacker.pid in c["pids"]), 30, "the attacker was never stalled")
            charged = next(c for c in enf.status()["containers"] if attacker.pid in c["pids"])
            time.sleep(0.2)     # a freezer stall lands in about 0.1 ms (FACTS.md); this is plenty
            assert not frozen(v2, victim.cgroup), f"the attacker's stall froze the victim ({charged})"
            assert charged["id"] == attacker.id, f"the attacker was charged as {charged['name']} (the victim's id)"
            boxes = {c["id"]: c for c in enf.status()["containers"]}
            a, v = boxes[attacker.id], boxes[victim.id]
            assert a["pids"] == [attacker.pid] and v["pids"] == [victim.pid], boxes
            assert a["cgroup"] == attacker.cgroup.rsplit("/", 1)[0]     # its own: the sub-cgroup's parent
            assert (v["gpus"]["0"]["used"], v["stalls"]) == (64 * MiB, 0)
            assert a["gpus"]["0"]["over_limit"] and a["gpus"]["0"]["reserved"] == 0   # a stopped call holds no reservation (issue 23)
            until(lambda: frozen(v2, a["cgroup"]), 10, "the attacker's own cgroup was not frozen")
            assert frozen(v2, str(sub.relative_to(v2)))                # and its sub-cgroup with it
            assert not frozen(v2, v["cgroup"])
            victim.p.stdin.write("\n")                                # the victim runs on
            victim.p.stdin.flush()
            out: list = []
            lines_until(victim.p.stdout, lambda line: line == "exit", out, 20, "the victim (frozen?)")
            assert out[0] == f"freed 1 {64 * MiB}"
        finally:
            for c in (attacker, victim):
                if c is not None:
                    c.remove()
            if sub is not None:
                remove_cgroup(sub)
                remove_cgroup(sub.parent)
