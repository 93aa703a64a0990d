"""probes/nodes.py (issue 33, principle 1): a driver is known by the entry points its dynamic
table exports, looked up as ld.so does (GNU or SysV hash), whatever the file is called and
whatever its section headers say; /proc/devices gives the GPU's majors. No root, no kernel."""
import os
import shutil
import struct

import pytest

from convgpu.paths import build_dir
from convgpu.probes import btf, nodes, untrusted

STANDIN = build_dir() / "standin" / "libcuda.so.1"


def _exports(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return nodes.exports(fd)
    finally:
        os.close(fd)


def test_a_copy_under_any_name_without_section_headers_is_still_a_driver(tmp_path):
    """strip the section headers (e_shoff, e_shnum = 0: ld.so never reads them) and rename it:
    the entry points are found all the same; the section reader can no longer see them."""
    if not STANDIN.exists():
        pytest.skip("stand-in not built (make)")
    copy = tmp_path / "libgpu.so"
    shutil.copy(STANDIN, copy)
    with open(copy, "r+b") as f:
        f.seek(40)
        f.write(struct.pack("<Q", 0))           # e_shoff
        f.seek(60)
        f.write(struct.pack("<HH", 0, 0))       # e_shnum, e_shstrndx
    got = _exports(copy)
    assert {"cuInit", "cuMemAlloc_v2", "cuDevicePrimaryCtxRetain", "cuGetProcAddress_v2"} <= got
    assert got == _exports(STANDIN)
    fd = os.open(copy, os.O_RDONLY)
    try:
        with pytest.raises(untrusted.Refused):
            untrusted.read_symbols(fd, ["cuMemAlloc_v2"])
    finally:
        os.close(fd)


def test_libraries_that_are_not_drivers_export_none(tmp_path):
    import ctypes.util
    libc = ctypes.util.find_library("c")
    path = next(p for p in ("/lib/x86_64-linux-gnu/" + (libc or ""), "/usr/lib/x86_64-linux-gnu/libc.so.6")
                if os.path.isfile(p))
    assert _exports(path) == set()
    (tmp_path / "x").write_bytes(b"#!/bin/sh\n" * 16)
    with pytest.raises(untrusted.Refused, match="not a 64-bit"):
        _exports(tmp_path / "x")


def test_a_hash_chain_without_end_is_refused_within_its_budget():
    """A GNU hash table whose chain never ends (no low bit set) over a 64 MiB hole: the lookup
    stops at CHAIN_MAX steps or its byte budget, never at the end of the file."""
    class Fake(nodes._Elf):
        def __init__(self):
            self.fd, self.budget = -1, untrusted.Budget(1.0, 1 << 20)
            self.loads = [(0, 1 << 30, 0)]

        def read(self, n, off, what):
            self.budget.take(n, what)
            if what == "GNU hash header":
                return struct.pack("<IIII", 1, 0, 0, 0)
            if what == "a hash bucket":
                return struct.pack("<I", 0)
            return struct.pack("<I", nodes._gnu_hash(b"cuInit") & ~1)   # matches, never ends
    with pytest.raises(untrusted.Refused, match="longer than|past"):
        list(nodes._gnu_chain(Fake(), 0, b"cuInit"))


def test_gpu_majors_come_from_proc_devices(tmp_path, monkeypatch):
    monkeypatch.delenv("CONVGPU_GPU_MAJORS", raising=False)
    p = tmp_path / "devices"
    p.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n234 nvidia-uvm\n\n"
                 "Block devices:\n195 nvidia\n")
    assert nodes.gpu_majors(str(p)) == (195, 234)
    p.write_text("Character devices:\n  1 mem\n")
    assert nodes.gpu_majors(str(p)) == (0, 0)
    monkeypatch.setenv("CONVGPU_GPU_MAJORS", "203")
    assert nodes.gpu_majors(str(p)) == (203, 0)


def test_the_kernel_layout_is_read_from_btf():
    if not os.path.exists(btf.VMLINUX):
        pytest.skip("no kernel BTF")
    with open(btf.VMLINUX, "rb") as f:
        off = btf.members(f.read(), nodes._LAYOUT)
    assert off["fdtable"]["max_fds"] == 0 and off["fdtable"]["fd"] == 8   # stable since 2.6
    assert all(v > 0 for s in ("task_struct", "files_struct", "file", "inode") for v in off[s].values())


def test_the_sweeps_maps_reading_has_a_budget(tmp_path):
    """mapped_inodes reads every process's maps on the loop: past its budget it gives up (the
    caller keeps its copies) instead of reading what a tenant's processes make it read."""
    from convgpu.probes import libs
    for pid in ("1", "2"):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "maps").write_text("7f00-7f10 r-xp 00000000 fe:00 4242 /x/libgpu.so\n")
    assert libs.mapped_inodes(str(tmp_path)) == {4242}
    assert libs.mapped_inodes(str(tmp_path), budget_s=-1) is None
