"""Issue 47, finding 7 (c): a module's static data is sized at the call from an ELF cubin's
`.nv.global*` section sizes (bpf/indirect.bpf.c `image_bytes`), which were summed in a u64 with
wrap-around. A tenant (as `nobody`, 256 MiB) whose image has two such sections of 2^64 - 1 GiB
and 1 GiB + 64 MiB was charged 64 MiB for it and admitted. Now the sum is taken without wrap,
and one past any card is the fail-closed size: the call is never admitted (stopped as over its
limit, before it runs). An honest image of 64 MiB in the same two sections is admitted and
charged exactly that (the parser reads these crafted images)."""
import struct

import pytest

from attack import scratch  # noqa: F401
from conftest import MiB, popen_in, stop_all, until, wait_state
from shim_attack import NOBODY, enforcer, expect

pytestmark = pytest.mark.system
GiB = 1 << 30


def cubin(*sections: tuple[str, int]) -> bytes:
    """An ELF64 image with a section-name table and NOBITS sections of these names and sizes:
    what image_bytes reads of a cubin (the header's section table, each section's name and size)."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n, _ in sections)
    shoff = 64 + len(names)
    shoff += -shoff % 8
    heads = [bytes(64), struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0)]   # null, .shstrtab
    at = len(b"\0.shstrtab\0")
    for n, size in sections:
        heads.append(struct.pack("<IIQQQQIIQQ", at, 8, 3, 0, 0, size, 0, 0, 16, 0))   # SHT_NOBITS, WA
        at += len(n) + 1
    eh = (b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0,
                                                                   64, 0, 0, 64, len(heads), 1))
    body = eh + names
    return body + bytes(shoff - len(body)) + b"".join(heads)


def row(enf, name):
    return next((c for c in enf.ctl(cmd="status")["status"]["containers"] if c["name"] == name), None)


def test_row47_nv_global_sizes_that_wrap_are_never_admitted(cgroups, build, env5, scratch):
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "256MiB")
    procs = []
    try:
        images = {"wrapped": cubin((".nv.global", (1 << 64) - GiB), (".nv.global.init", GiB + 64 * MiB)),
                  "honest": cubin((".nv.global", 32 * MiB), (".nv.global.init", 32 * MiB))}
        for name, image in images.items():
            (scratch / "attacker" / f"{name}.cubin").write_bytes(image)
        honest = popen_in(cgroups("honest"), *NOBODY, build / "cgcaller", "module", "--image",
                          scratch / "attacker" / "honest.cubin", "--hold", env=env5)
        procs.append(honest)
        expect(honest, "allocated", timeout=20)
        until(lambda: row(enf, "honest") is not None, 10, "placed")
        assert row(enf, "honest")["gpus"]["0"]["used"] == 64 * MiB
        wrapped = popen_in(cgroups("wrapped"), *NOBODY, build / "cgcaller", "module", "--image",
                           scratch / "attacker" / "wrapped.cubin", "--hold", env=env5)
        procs.append(wrapped)
        wait_state(wrapped.pid, "T", timeout=20)
        enf.wait_for(f"stall wrapped pid {wrapped.pid} on GPU0: cuModuleLoadData")
        enf.wait_for("above its limit 256.0 MiB: stalled until the limit is raised")
        g = row(enf, "wrapped")["gpus"]["0"]
        assert (g["used"], g["waiting"]) == (0, True), g
    finally:
        stop_all(procs, enf)
