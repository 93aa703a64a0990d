"""Issue 33, row 4: a crafted 66 MiB sparse file named libcuda.so.1 (16,383 `.dynsym` sections
of size 0, each linked to one 64 MiB string table), opened once by nobody in its own cgroup.
Before: `read_symbols` re-read the 64 MiB table for every section and checked its deadline
only inside the (empty) symbol loop: minutes on the enforcer's loop, whose heartbeat then
lapsed, and BPF admitted every other container's calls unchecked. Now the file is read off the
loop within a budget checked before each read (probes/untrusted.py, probes/reading.py): it
is refused at once, its opener stays held (--unprobed stall), the loop keeps beating, and a
victim in another cgroup is admitted and stopped at its limit as before."""
import struct
import subprocess
import sys
import time

import pytest

from attack import as_nobody, scratch  # noqa: F401
from conftest import MiB, cuda_prelude, popen_in, proc_state, stop_all, wait_state
from shim_attack import enforcer, expect, say
from test_row03_fifo_libcuda import heartbeat_age

pytestmark = [pytest.mark.system, pytest.mark.exclusive]   # discovery reaches every driver file on the host
SECTIONS = 1 << 14          # untrusted.MAX_SECTIONS: the most the old reader accepted
STRTAB = 64 << 20           # untrusted.MAX_TABLE: the biggest table it read
OPEN = "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); print('opened', flush=True); sys.stdin.readline()"
VICTIM = "{prelude}p=ctypes.c_ulonglong()\nprint('ready', flush=True)\nfor line in sys.stdin:\n" \
         "    print('allocated', cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20)), flush=True)\n"


def crafted(path) -> None:
    """An ELF shared object with SECTIONS - 1 empty .dynsym sections that all link to one
    64 MiB string table at the end of a sparse file (no disk blocks: 66 MiB of holes)."""
    h = bytearray(64)
    h[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<H", h, 16, 3)                          # ET_DYN
    struct.pack_into("<QQ", h, 32, 0, 64)                     # no program headers; sections at 64
    struct.pack_into("<HHHH", h, 54, 56, 0, 64, SECTIONS)
    strtab_at = 2 << 20
    sh = bytearray(64 * SECTIONS)
    for i in range(SECTIONS - 1):                             # SHT_DYNSYM, size 0, link: the last
        struct.pack_into("<IIQQQQIIQQ", sh, i * 64, 0, 11, 0, 0, 0, 0, SECTIONS - 1, 0, 8, 24)
    struct.pack_into("<IIQQQQIIQQ", sh, (SECTIONS - 1) * 64, 0, 3, 0, 0, strtab_at, STRTAB, 0, 0, 1, 0)
    with open(path, "wb") as f:
        f.write(h + sh)
        f.truncate(strtab_at + STRTAB)


def test_row33_4_a_crafted_driver_file_costs_the_loop_nothing(cgroups, build, env5, scratch):
    lib = scratch / "attacker" / "libcuda.so.1"
    crafted(lib)
    enf = enforcer(build, "--gpu-memory", "4GiB", "--default-limit", "256MiB", "--ctx-overhead", "0",
                   "--discover", start_timeout=120)
    attacker = victim = None
    try:
        victim = popen_in(cgroups("victim"), sys.executable, "-c",
                          VICTIM.format(prelude=cuda_prelude(build / "standin" / "libcuda.so.1")), env=env5)
        expect(victim, "ready")
        attacker = popen_in(cgroups("attacker"), *as_nobody(sys.executable, "-c", OPEN, lib), env=env5)
        t0 = time.monotonic()
        line = enf.wait_for(f"pid {attacker.pid} opened {lib}, which cannot be probed", 10)
        took = time.monotonic() - t0
        assert "symbol tables, more than the 4 an ELF file may have" in line and "kept stopped" in line, line
        assert took < 5, took
        wait_state(attacker.pid, "T", timeout=10)            # held: its file was never probed
        # the loop kept beating throughout: status answers at once, the heartbeat stays fresh
        for _ in range(8):
            t = time.monotonic()
            st = enf.ctl(cmd="status")["status"]
            assert time.monotonic() - t < 2 and heartbeat_age(enf.run_dir) < 1.0
            time.sleep(0.25)
        row = next(u for u in st["unprobed"] if u["pid"] == attacker.pid)
        assert row["action"] == "stall" and "symbol tables" in row["reason"], row
        # another container: admitted up to its 256 MiB, its fifth 64 MiB stopped before it runs
        for i in range(4):
            say(victim)
            assert expect(victim, "allocated", timeout=30)[1] == "0", i
        say(victim)
        wait_state(victim.pid, "T", timeout=30)
        time.sleep(0.5)
        assert proc_state(victim.pid) == "T" and proc_state(attacker.pid) == "T"
        st = enf.ctl(cmd="status")["status"]
        row = next(c for c in st["containers"] if c["name"].endswith("victim"))
        assert row["gpus"]["0"]["used"] == 256 * MiB, row
    finally:
        for p in (attacker, victim):
            if p is not None:
                p.kill()
        try:
            stop_all([attacker, victim], enf)
        except subprocess.TimeoutExpired:   # the old code: its loop is still inside the read
            enf.p.kill()
            enf.p.wait()
        subprocess.run(["rm", "-f", str(lib)])
