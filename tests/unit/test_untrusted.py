"""probes/untrusted.py, the trust boundary for driver files (docs/SECURITY.md rows 1, 3): files
are opened without blocking and without leaving a root, and an ELF is read within caps, never
loaded. No root, no kernel beyond openat2 (Linux >= 5.6)."""
import logging
import os
import struct

import pytest

from convgpu.paths import build_dir
from convgpu.probes import untrusted
from convgpu.probes.said import Said
from convgpu.probes.table import CUDA, PROBES

STANDIN = build_dir() / "standin" / "libcuda.so.1"


def _open(path):
    return untrusted.open_in_root("/", str(path))


def test_an_absolute_symlink_stays_inside_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "libcuda.so.1").symlink_to("/secret")
    (tmp_path / "secret").write_text("host")      # what a symlink out of the root would reach
    (root / "secret").write_text("container")
    fd = untrusted.open_in_root(str(root), "/lib/libcuda.so.1")
    try:
        assert os.read(fd, 64) == b"container"
    finally:
        os.close(fd)
    (root / "lib" / "up").symlink_to("../../../../../../../../etc/passwd")
    with pytest.raises(OSError):                   # ".." stops at the root: no /etc/passwd there
        untrusted.open_in_root(str(root), "/lib/up")


def test_a_fifo_opens_at_once_and_is_refused(tmp_path):
    fifo = tmp_path / "libcuda.so.1"
    os.mkfifo(fifo)
    fd = _open(fifo)                               # O_NONBLOCK: no writer needed
    try:
        with pytest.raises(untrusted.Refused, match="a FIFO, not a regular file"):
            untrusted.check(fd)
    finally:
        os.close(fd)


def test_a_directory_and_an_oversized_file_are_refused(tmp_path):
    fd = _open(tmp_path)
    try:
        with pytest.raises(untrusted.Refused, match="a directory"):
            untrusted.check(fd)
    finally:
        os.close(fd)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(untrusted.MAX_FILE + 1)         # sparse: costs nothing
    fd = _open(big)
    try:
        with pytest.raises(untrusted.Refused, match="above the 1024 MiB"):
            untrusted.check(fd)
    finally:
        os.close(fd)


def test_the_standin_symbols_are_read_with_their_prologues():
    if not STANDIN.exists():
        pytest.skip("stand-in not built (make)")
    fd = _open(STANDIN)
    try:
        untrusted.check(fd)
        syms = untrusted.read_symbols(fd, [p.symbol for p in PROBES if p.library == CUDA] + ["nope"])
        data = open(STANDIN, "rb").read()
    finally:
        os.close(fd)
    assert "nope" not in syms and {"cuMemAlloc_v2", "cuMemFree_v2", "cuDevicePrimaryCtxRetain"} <= set(syms)
    for s in syms.values():   # the stand-in is built to start like driver 580: push %rbp
        assert s.prologue == data[s.offset:s.offset + 16] and s.prologue[0] == 0x55


def _elf(shoff=64, shnum=1, shentsize=64, phnum=0, e_type=3, cls=2):
    h = bytearray(64)
    h[:6] = b"\x7fELF" + bytes([cls, 1])
    struct.pack_into("<H", h, 16, e_type)
    struct.pack_into("<QQ", h, 32, 64, shoff)
    struct.pack_into("<HHHH", h, 54, 56, phnum, shentsize, shnum)
    return bytes(h)


@pytest.mark.parametrize("data, why", [
    (b"not an ELF file\n" * 8, "not an ELF file"),
    (b"\x7fELF", "not an ELF file"),
    (_elf(cls=1), "not a 64-bit"),
    (_elf(e_type=2), "not an ELF shared object"),
    (_elf(shnum=60000), "ELF headers out of bounds"),
    (_elf(shoff=1 << 40), "section headers runs past the end"),
])
def test_malformed_elf_is_refused_in_a_line(tmp_path, data, why):
    p = tmp_path / "libcuda.so.1"
    p.write_bytes(data)
    fd = _open(p)
    try:
        with pytest.raises(untrusted.Refused, match=why):
            untrusted.read_symbols(fd, ["cuMemAlloc_v2"])
    finally:
        os.close(fd)


def test_a_huge_symbol_table_is_refused_not_read(tmp_path):
    """A section header that claims a 1 TiB symbol table: refused before any read."""
    h = _elf(shoff=64, shnum=2)
    sh = bytearray(128)
    struct.pack_into("<IIQQQQIIQQ", sh, 64, 0, 11, 0, 0, 0, 1 << 40, 0, 0, 8, 24)   # SHT_DYNSYM, link 0
    p = tmp_path / "libcuda.so.1"
    p.write_bytes(h + bytes(sh))
    fd = _open(p)
    try:
        with pytest.raises(untrusted.Refused, match="out of bounds"):
            untrusted.read_symbols(fd, ["cuMemAlloc_v2"])
    finally:
        os.close(fd)


def test_trusted_only_for_roots_own_host_files(tmp_path):
    if not STANDIN.exists():
        pytest.skip("stand-in not built (make)")
    real = os.path.realpath(STANDIN)
    assert untrusted.trusted(real, os.stat(real)) == all(
        os.stat(d).st_uid == 0 and (not os.stat(d).st_mode & 0o022 or (d != real and os.stat(d).st_mode & 0o1000))
        for d in _parents(real))
    assert not untrusted.trusted(f"/proc/self/root{real}", os.stat(real))
    if os.geteuid() != 0 or any(os.stat(d).st_uid != 0 for d in _parents(str(tmp_path))):
        return   # the cases below need a tree of root's
    for mode, ok in ((0o777, False), (0o1777, True), (0o755, True)):   # anyone may replace it; sticky; root's
        d = tmp_path / f"d{mode:o}"
        d.mkdir()
        d.chmod(mode)
        mine = d / "libcuda.so.1"
        mine.write_bytes(b"x")
        assert untrusted.trusted(str(mine), os.stat(mine)) is ok, oct(mode)
        os.chown(mine, 65534, 65534)                   # nobody's own file: never
        assert not untrusted.trusted(str(mine), os.stat(mine))


def _parents(p):
    while True:
        yield p
        if p == "/":
            return
        p = os.path.dirname(p)


def test_said_once_per_key_then_counts(caplog):
    caplog.set_level(logging.INFO, logger="convgpu.probes.said")
    say = Said(every=3600)
    for i in range(50):
        say(logging.WARNING, ("c1", "not ELF"), "copy %d", i)
        say(logging.WARNING, ("c2", "not ELF"), "other %d", i)
    assert [r.getMessage() for r in caplog.records] == ["copy 0", "other 0"]
    say.every = 0
    say(logging.WARNING, ("c1", "not ELF"), "copy %d", 99)
    assert caplog.records[-1].getMessage() == "copy 99 (49 more like it left out)"
    small = Said(keys=3)
    for i in range(10):
        small(logging.INFO, i, "k")
    assert len(small.last) == 3


# --- budgets (issue 33 row 4): what a file makes us read is bounded before each read ---

def _tables(tmp_path, sections, tail=0):
    """An ELF of the given section headers (tuples of 10 fields), sparse to `tail` bytes."""
    h = _elf(shoff=64, shnum=len(sections))
    sh = b"".join(struct.pack("<IIQQQQIIQQ", *s) for s in sections)
    p = tmp_path / "libcuda.so.1"
    with open(p, "wb") as f:
        f.write(h + sh)
        f.truncate(max(tail, len(h) + len(sh)))
    return _open(p)


def test_empty_symbol_tables_by_the_thousand_are_refused_unread(tmp_path):
    """16,383 empty .dynsym sections linked to one 64 MiB string table: the old reader read the
    table once per section (minutes); now the count alone refuses the file."""
    n = untrusted.MAX_SECTIONS
    big = untrusted.MAX_TABLE
    secs = [(0, 11, 0, 0, 0, 0, n - 1, 0, 8, 24)] * (n - 1) + [(0, 3, 0, 0, 2 << 20, big, 0, 0, 1, 0)]
    fd = _tables(tmp_path, secs, (2 << 20) + big)
    try:
        with pytest.raises(untrusted.Refused, match=f"{n - 1} symbol tables, more than the 4"):
            untrusted.read_symbols(fd, ["cuMemAlloc_v2"])
    finally:
        os.close(fd)


def test_bytes_are_budgeted_per_file_before_each_read(tmp_path):
    """Two symbol tables, each linked to a string table of its own, 40 MiB each: the second
    string table would take the file past READ_BUDGET, and is not read."""
    t = 40 << 20
    secs = [(0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
            (0, 11, 0, 0, 4096, 0, 3, 0, 8, 24), (0, 11, 0, 0, 4096, 0, 4, 0, 8, 24),
            (0, 3, 0, 0, 1 << 20, t, 0, 0, 1, 0), (0, 3, 0, 0, (1 << 20) + t, t, 0, 0, 1, 0)]
    fd = _tables(tmp_path, secs, (1 << 20) + 2 * t)
    try:
        with pytest.raises(untrusted.Refused, match="string table of 41943040 bytes would take its reading past 64 MiB"):
            untrusted.read_symbols(fd, ["cuMemAlloc_v2"])
        b = untrusted.Budget(seconds=0.0)
        with pytest.raises(untrusted.Refused, match="reading it took over 0 s"):
            untrusted.read_symbols(fd, ["cuMemAlloc_v2"], budget=b)   # time: before the first read
    finally:
        os.close(fd)


def test_a_string_table_without_a_nul_costs_each_symbol_only_its_name(tmp_path):
    """200,000 defined functions whose names all start at offset 0 of a 16 MiB string table
    with no NUL: the old reader searched the whole table for each (20 s between two deadline
    checks); now each name is looked at no further than the longest name wanted."""
    import time
    n, t = 200_000, 16 << 20
    symoff, stroff = 1 << 20, 8 << 20
    secs = [(0, 0, 0, 0, 0, 0, 0, 0, 0, 0), (0, 11, 0, 0, symoff, n * 24, 2, 0, 8, 24),
            (0, 3, 0, 0, stroff, t, 0, 0, 1, 0)]
    os.close(_tables(tmp_path, secs, stroff + t))
    with open(tmp_path / "libcuda.so.1", "r+b") as f:
        f.seek(symoff)
        f.write(struct.pack("<IBBHQQ", 0, 2, 0, 1, 0x1000, 0) * n)     # STT_FUNC, defined, name at 0
        f.seek(stroff)
        f.write(b"A" * t)
    fd = _open(tmp_path / "libcuda.so.1")
    try:
        t0 = time.monotonic()
        assert untrusted.read_symbols(fd, ["cuMemAlloc_v2"]) == {}
        assert time.monotonic() - t0 < 0.5 * untrusted.BUDGET_S
    finally:
        os.close(fd)


def test_the_reader_runs_jobs_off_the_caller_and_keeps_their_errors():
    import threading
    from convgpu.probes.reading import Reader, Spent
    r = Reader()
    ok = r.submit(lambda: threading.current_thread().name)
    bad = r.submit(untrusted.read_symbols, -1, ["x"])
    assert ok.result(timeout=5) == "convgpu-reader" and isinstance(bad.exception(timeout=5), OSError)
    assert ok.took >= 0
    s = Spent(limit=1.0, window=60)
    s.add("a", 0.6)
    assert not s.over("a")
    s.add("a", 0.5)
    assert s.over("a") and not s.over("b")
