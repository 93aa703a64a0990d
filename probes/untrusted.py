"""The trust boundary for driver files: a libcuda a container brings is read, never run.

Every file named like a driver that discovery or a scan finds may be a container's: a forged
library with an ELF constructor (issue 24, row 1: the old self-test loaded it with ctypes as
root), a FIFO that blocks whoever opens it (row 3: bcc's own symbol lookup hung the loop), a
symlink out of the container's root, or a file of gigabytes. So a library is
  - opened once, here, O_RDONLY|O_NONBLOCK|O_NOFOLLOW-or-scoped (openat2 RESOLVE_IN_ROOT inside
    a container's root, RESOLVE_NO_MAGICLINKS), and kept open: the probes go on that inode
    through /proc/self/fd/N, a path nobody else can swap between the check and the attach;
  - fstat-ed: a regular file of at most MAX_FILE bytes, else refused with one reason;
  - read, not loaded: its ELF headers, section headers and symbol tables give each probed
    symbol's file offset, as bcc computes it (through the executable PT_LOAD segment that holds
    its address), and the first bytes there (probes/prologue.py classifies them);
  - read on a Budget the file cannot dodge (issue 33 row 4: a deadline checked only inside the
    symbol loop let 16,383 empty .dynsym sections each re-read one 64 MiB string table, minutes
    on the enforcer's loop): time and bytes are checked before every read, each table is read
    once, at most MAX_SYMTABS symbol tables are looked at, and a file on a FUSE mount (whose
    reads a user-space server answers, or never does) is refused.
A call-based self-test stays only for `trusted` files: owned by root, on a host path (not
through /proc), no component writable by anyone else (probes/loader.py)."""
import ctypes as ct
import errno
import os
import stat
import struct
import time
from dataclasses import dataclass

MAX_FILE = 1 << 30          # libcuda 580 is ~100 MiB; a copy above 1 GiB is not a driver
MAX_TABLE = 64 << 20        # one symbol or string table (libcuda's .dynsym + .dynstr: < 1 MiB)
MAX_SECTIONS = 1 << 14
MAX_SYMTABS = 4             # .dynsym and .symtab: a real ELF has at most these two
BUDGET_S = 1.0              # reading one library (the stand-in: < 5 ms; libcuda 580: ~50 ms)
READ_BUDGET = 64 << 20      # bytes read from one library in all (libcuda 580: < 2 MiB)
FUSE_SUPER_MAGIC = 0x65735546
SYS_OPENAT2 = 437           # x86_64
RESOLVE_NO_MAGICLINKS, RESOLVE_IN_ROOT = 0x02, 0x10
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


class Refused(Exception):
    """This file cannot be a driver we probe; str(): why, in a few words."""


class Budget:
    """What reading one file may cost, taken before each read: an input cannot make a read
    happen after its time or bytes are spent (a check inside a loop over what was read can be
    dodged by making that loop empty)."""

    def __init__(self, seconds: float = BUDGET_S, nbytes: int = READ_BUDGET):
        self.seconds, self.nbytes = seconds, nbytes
        self.deadline = time.monotonic() + seconds
        self.left = nbytes

    def take(self, n: int, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise OverBudget(f"reading it took over {self.seconds:g} s")
        if n > self.left:
            raise OverBudget(f"{what} of {n} bytes would take its reading past {self.nbytes >> 20} MiB")
        self.left -= n

    def deadline_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class NotElf(Refused):
    """Not an ELF file at all: no loader can map code from it (a source file named
    libcuda.so.1.c, a text file): whoever opened it is no driver's user for that."""


class Uncheckable(Refused):
    """Refused because it cannot be read within bounds (a FUSE file, a budget spent): never
    taken to mean "no driver in it"."""


class OverBudget(Uncheckable):
    """Reading it would cost more than its Budget."""


class _Statfs(ct.Structure):
    _fields_ = [("f_type", ct.c_long), ("rest", ct.c_byte * 112)]


class _OpenHow(ct.Structure):
    _fields_ = [("flags", ct.c_uint64), ("mode", ct.c_uint64), ("resolve", ct.c_uint64)]


def _openat2(dirfd: int, path: str, resolve: int) -> int:
    how = _OpenHow(OPEN_FLAGS, 0, resolve)
    fd = _libc.syscall(SYS_OPENAT2, dirfd, path.encode(), ct.byref(how), ct.sizeof(how))
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, f"{os.strerror(e)}: {path}")
    return fd


def open_in_root(root: str, path: str) -> int:
    """path as a process whose root is `root` sees it: every symlink (absolute ones too) is
    resolved inside that root, never out of it, and no /proc magic link is followed. Opening
    never blocks (O_NONBLOCK: a FIFO opens at once, and is then refused by check())."""
    if root in ("", "/"):
        return _openat2(-100, path, RESOLVE_NO_MAGICLINKS)        # AT_FDCWD, host paths
    dirfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)   # the container's root
    try:
        return _openat2(dirfd, path.lstrip("/") or ".", RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    finally:
        os.close(dirfd)


def open_process_fd(pid: int, fd: int) -> int:
    """The very file a process holds open as fd (a magic link, on purpose: it is what the
    process opened, even deleted since); non-blocking, so a FIFO cannot hold us."""
    return os.open(f"/proc/{pid}/fd/{fd}", OPEN_FLAGS)


def check(fd: int) -> os.stat_result:
    """fstat of an open library: a regular file of a plausible size, else Refused."""
    st = check_mappable(fd)
    if st.st_size > MAX_FILE:
        raise Refused(f"{st.st_size} bytes, above the {MAX_FILE >> 20} MiB a driver file may have")
    return st


def check_mappable(fd: int) -> os.stat_result:
    """fstat of an open file that may hold code: a regular file (memfds are), not on FUSE."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}.get(stat.S_IFMT(st.st_mode), "not a file")
        raise Refused(f"{kind}, not a regular file")
    sfs = _Statfs()
    if _libc.fstatfs(fd, ct.byref(sfs)) == 0 and sfs.f_type & 0xFFFFFFFF == FUSE_SUPER_MAGIC:
        raise Uncheckable("on a FUSE mount, whose reads a user-space server answers (or never does)")
    return st


def trusted(path: str, st: os.stat_result) -> bool:
    """The host's own driver: a host path (not through /proc), the file and every directory
    above it owned by root and writable by nobody else (a sticky directory such as /tmp
    counts: others may add entries there but never rename or remove root's), and `path` still
    that inode. Only such a file may be loaded by the self-test (nothing in a container can
    change it)."""
    if not path.startswith("/") or path.startswith("/proc/") or os.path.realpath(path) != path:
        return False
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        return False
    p = path
    while True:
        s = os.stat(p, follow_symlinks=False)
        sticky_dir = p != path and s.st_mode & stat.S_ISVTX
        if s.st_uid != 0 or (s.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir):
            return False
        if p == "/":
            return True
        p = os.path.dirname(p)


@dataclass(frozen=True)
class Symbol:
    offset: int         # file offset: where a uprobe link goes
    prologue: bytes     # the first bytes there (probes/prologue.py)


def _pread(fd: int, n: int, off: int, what: str, budget: Budget) -> bytes:
    if n < 0 or off < 0 or n > MAX_TABLE:
        raise Refused(f"{what} of {n} bytes is out of bounds")
    budget.take(n, what)
    b = os.pread(fd, n, off)
    if len(b) != n:
        raise Refused(f"{what} runs past the end of the file")
    return b


def read_symbols(fd: int, names, prologue_bytes: int = 16, budget: Budget | None = None) -> dict[str, Symbol]:
    """{name: Symbol} of each of `names` the file exports as a defined function in an
    executable segment; Refused if the file is not a 64-bit little-endian ELF shared object or
    reading it goes past a cap or its budget (default: Budget())."""
    budget = budget or Budget()
    budget.take(64, "ELF header")
    h = os.pread(fd, 64, 0)
    if len(h) < 64 or h[:4] != b"\x7fELF":
        raise NotElf("not an ELF file")
    if h[4] != 2 or h[5] != 1:
        raise Refused("not a 64-bit little-endian ELF file")
    e_type, = struct.unpack_from("<H", h, 16)
    if e_type != 3:   # ET_DYN
        raise Refused("not an ELF shared object")
    phoff, shoff = struct.unpack_from("<QQ", h, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", h, 54)
    if phentsize != 56 or shentsize != 64 or not 0 < shnum <= MAX_SECTIONS or phnum > 256:
        raise Refused("ELF headers out of bounds")
    exe = []   # (vaddr, filesz, offset) of executable PT_LOAD segments
    ph = _pread(fd, phnum * 56, phoff, "program headers", budget)
    for i in range(phnum):
        p_type, p_flags, p_off, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", ph, i * 56)
        if p_type == 1 and p_flags & 1:
            exe.append((p_vaddr, p_filesz, p_off))
    sh = _pread(fd, shnum * 64, shoff, "section headers", budget)
    secs = [struct.unpack_from("<IIQQQQIIQQ", sh, i * 64) for i in range(shnum)]
    tables = [s for s in secs if s[1] in (2, 11) and s[9] == 24 and s[6] < shnum]   # SHT_SYMTAB, SHT_DYNSYM
    if len(tables) > MAX_SYMTABS:
        raise Refused(f"{len(tables)} symbol tables, more than the {MAX_SYMTABS} an ELF file may have")
    want = {n.encode() for n in names}
    longest = max(map(len, want), default=0) + 1   # a name is looked at this far, never to a NUL
    out: dict[str, Symbol] = {}                    # that a crafted table may leave out
    strtabs: dict[int, bytes] = {}     # each string table read once, whoever links to it
    for sec in tables:
        if sec[6] not in strtabs:
            strsec = secs[sec[6]]
            strtabs[sec[6]] = _pread(fd, strsec[5], strsec[4], "string table", budget)
        strtab = strtabs[sec[6]]
        syms = _pread(fd, sec[5] - sec[5] % 24, sec[4], "symbol table", budget)
        for k, (st_name, st_info, _, shndx, value, _) in enumerate(struct.iter_unpack("<IBBHQQ", syms)):
            if k & 0xFFF == 0:
                budget.take(0, "its symbols")
            if st_info & 0xF != 2 or shndx == 0 or not value:   # STT_FUNC, defined
                continue
            name = strtab[st_name:st_name + longest].split(b"\0", 1)[0]
            if name not in want or name.decode() in out:
                continue
            off = next((value - v + o for v, n, o in exe if v <= value < v + n), None)
            if off is not None:
                budget.take(prologue_bytes, "a prologue")
                out[name.decode()] = Symbol(off, os.pread(fd, prologue_bytes, off))
    return out


def close(fd: int) -> None:
    if fd < 0:
        return
    try:
        os.close(fd)
    except OSError as e:
        if e.errno != errno.EBADF:
            raise
