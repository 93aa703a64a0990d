"""A driver is what it is, not what it is called (issue 33, principle 1).

Issue 33 row 1: a copy of the driver under another name (`cp libcuda.so.1 /tmp/x/libgpu.so`,
a memfd, `dlopen("/proc/self/fd/N")`) was never probed: discovery reacted to opens of files
*named* libcuda.so*, and the scan kept only mapped paths that looked like it. Two facts no name
can hide (FACTS.md, 2026-11-27): the GPU's device nodes a process opens (NVIDIA's character
majors: `nvidia` for /dev/nvidiactl and /dev/nvidiaN, `nvidia-uvm`, which CUDA opens and NVML
alone does not), matched in BPF by the device number the kernel has for the opened file; and the
driver entry points a mapped ELF exports, looked up as the dynamic loader does (its GNU or SysV
hash table), in the files the kernel lists as the process's executable mappings
(/proc/PID/maps and /proc/PID/map_files, by inode: memfds and deleted files included).

So BPF stops a process at its open of a GPU node unless it was checked since it last mapped
executable code (bpf/discovery.bpf.c), and `check` (run on the reader thread,
probes/reading.py, within a budget) names every mapped file that exports a driver entry point.
An NVML-only tool maps none: it is let go and remembered as checked, and opens no node again
unstopped until it maps new code. Everything read here is the process's (hostile): capped,
non-blocking, never followed out of /proc."""
import collections
import logging
import os
import re
import struct

from . import untrusted
from .btf import VMLINUX, members
from .table import CUDA, PROBES

log = logging.getLogger(__name__)
# What makes an ELF a driver: it exports one of these (the probed calls, and the two any
# runtime starts with: cuInit, and cuGetProcAddress, which hands out all the others).
ENTRY_POINTS = tuple(sorted({p.symbol for p in PROBES if p.library == CUDA}
                            | {"cuInit", "cuGetProcAddress", "cuGetProcAddress_v2"}))
MAPS_CAP = 8 << 20          # /proc/PID/maps read: ~65,530 mappings (vm.max_map_count) fit
FILE_BUDGET_S = 0.2         # looking one mapped file up (a few KiB read; the H100's libcuda: < 1 ms)
FILE_BYTES = 4 << 20
CHECK_BUDGET_S = 2.0        # one process, all its files
CHAIN_MAX = 4096            # hash-chain steps per name (a real chain: a handful)
PLAIN_CACHE = 65536         # files known to export no entry point, by identity
_MAPS = re.compile(rb"^([0-9a-f]+-[0-9a-f]+) (\S{4}) \S+ (\S+) (\d+)", re.M)
_LAYOUT = {"task_struct": ("files",), "files_struct": ("fdt",), "fdtable": ("max_fds", "fd"),
           "file": ("f_inode",), "inode": ("i_rdev",)}


def gpu_majors(proc_devices: str = "/proc/devices") -> tuple[int, int]:
    """(nvidia, nvidia-uvm) character majors as the kernel registered them (0: none).
    CONVGPU_GPU_MAJORS=M[,U] (tests: a major the stand-in's nodes have) replaces them."""
    env = os.environ.get("CONVGPU_GPU_MAJORS")
    if env:
        got = [int(x) for x in env.split(",")[:2]]
        return got[0], got[1] if len(got) > 1 else 0
    nv = uvm = 0
    try:
        with open(proc_devices) as f:
            chars = f.read(1 << 16).split("Block devices:")[0]
    except OSError:
        return 0, 0
    for line in chars.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            if parts[1] in ("nvidia-frontend", "nvidia"):
                nv = int(parts[0])
            elif parts[1] == "nvidia-uvm":
                uvm = int(parts[0])
    return nv, uvm


def configure(b) -> bool:
    """The `nodecfg` map: the majors and where the running kernel keeps an open file's device
    number (from its own BTF, as kernel headers cannot say: FACTS.md). False (and a warning)
    where neither is known: no node open is then matched."""
    nv, uvm = gpu_majors()
    try:
        with open(VMLINUX, "rb") as f:
            off = members(f.read(), _LAYOUT)
    except (OSError, ValueError, struct.error) as e:
        log.warning("cannot read the kernel's file layout from its BTF (%s): a driver copy under "
                    "another name is found by the periodic scan only", e)
        return False
    t = b[b"nodecfg"]
    leaf = t.Leaf()
    leaf.major[0], leaf.major[1] = nv, uvm
    t[t.Key(0)] = t.Leaf(major=leaf.major, known=1,
                         task_files=off["task_struct"]["files"], files_fdt=off["files_struct"]["fdt"],
                         fdt_max=off["fdtable"]["max_fds"], fdt_fd=off["fdtable"]["fd"],
                         file_inode=off["file"]["f_inode"], inode_rdev=off["inode"]["i_rdev"])
    return bool(nv or uvm)


# --- what a mapped ELF exports, as the dynamic loader sees it (hostile input) ---

def _gnu_hash(name: bytes) -> int:
    h = 5381
    for c in name:
        h = (h * 33 + c) & 0xFFFFFFFF
    return h


def _sysv_hash(name: bytes) -> int:
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


class _Elf:
    """Reads of one file through its load segments, each read on the budget."""

    def __init__(self, fd: int, budget: untrusted.Budget):
        self.fd, self.budget = fd, budget
        h = self.read(64, 0, "ELF header")
        if h[:4] != b"\x7fELF" or h[4] != 2 or h[5] != 1:
            raise untrusted.Refused("not a 64-bit little-endian ELF file")
        phoff, = struct.unpack_from("<Q", h, 32)
        phentsize, phnum = struct.unpack_from("<HH", h, 54)
        if phentsize != 56 or phnum > 256:
            raise untrusted.Refused("ELF headers out of bounds")
        ph = self.read(phnum * 56, phoff, "program headers")
        self.loads, self.dynamic = [], None
        for i in range(phnum):
            p_type, _, off, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", ph, i * 56)
            if p_type == 1:
                self.loads.append((vaddr, filesz, off))
            elif p_type == 2:
                self.dynamic = (off, min(filesz, 1 << 16))

    def read(self, n: int, off: int, what: str) -> bytes:
        if n < 0 or off < 0:
            raise untrusted.Refused(f"{what} out of bounds")
        self.budget.take(n, what)
        b = os.pread(self.fd, n, off)
        if len(b) != n:
            raise untrusted.Refused(f"{what} runs past the end of the file")
        return b

    def at(self, vaddr: int, n: int, what: str) -> bytes:
        """n bytes at a virtual address, through the load segment that holds it."""
        off = next((vaddr - v + o for v, sz, o in self.loads if v <= vaddr and vaddr + n <= v + sz), None)
        if off is None:
            raise untrusted.Refused(f"{what} is outside the file's segments")
        return self.read(n, off, what)


def exports(fd: int, names=ENTRY_POINTS, budget: untrusted.Budget | None = None) -> set[str]:
    """Which of `names` the ELF at fd defines in its dynamic symbol table, looked up through
    DT_GNU_HASH (else DT_HASH) as ld.so does for dlsym: section headers, which the loader never
    reads, cannot hide one. Refused if it is not an ELF or the budget runs out."""
    e = _Elf(fd, budget or untrusted.Budget(FILE_BUDGET_S, FILE_BYTES))
    if e.dynamic is None:
        return set()
    dyn = e.read(e.dynamic[1] - e.dynamic[1] % 16, e.dynamic[0], "dynamic section")
    tags = {}
    for tag, val in struct.iter_unpack("<qQ", dyn):
        if tag == 0:
            break
        tags.setdefault(tag, val)
    symtab, strtab, strsz = tags.get(6), tags.get(5), tags.get(10, 0)
    if symtab is None or strtab is None:
        return set()
    found = set()
    gnu, sysv = tags.get(0x6FFFFEF5), tags.get(4)
    for name in names:
        raw = name.encode()
        for i in (_gnu_chain(e, gnu, raw) if gnu is not None else _sysv_chain(e, sysv, raw) if sysv is not None else ()):
            st_name, _info, _other, shndx, value, _ = struct.unpack("<IBBHQQ", e.at(symtab + 24 * i, 24, "a symbol"))
            if shndx != 0 and value and st_name + len(raw) < strsz and \
                    e.at(strtab + st_name, len(raw) + 1, "a name") == raw + b"\0":
                found.add(name)
                break
    return found


def _gnu_chain(e: _Elf, at: int, name: bytes):
    """Symbol indexes whose GNU hash matches name's (ld.so's do_lookup_x)."""
    nbuckets, symoffset, bloom_size, _shift = struct.unpack("<IIII", e.at(at, 16, "GNU hash header"))
    if not nbuckets:
        return
    h = _gnu_hash(name)
    buckets = at + 16 + 8 * bloom_size
    i, = struct.unpack("<I", e.at(buckets + 4 * (h % nbuckets), 4, "a hash bucket"))
    if i < symoffset:
        return
    chain = buckets + 4 * nbuckets
    for _ in range(CHAIN_MAX):
        ch, = struct.unpack("<I", e.at(chain + 4 * (i - symoffset), 4, "a hash chain"))
        if (ch | 1) == (h | 1):
            yield i
        if ch & 1:
            return
        i += 1
    raise untrusted.Refused(f"a hash chain longer than {CHAIN_MAX}")


def _sysv_chain(e: _Elf, at: int, name: bytes):
    nbucket, nchain = struct.unpack("<II", e.at(at, 8, "hash header"))
    if not nbucket:
        return
    i, = struct.unpack("<I", e.at(at + 8 + 4 * (_sysv_hash(name) % nbucket), 4, "a hash bucket"))
    for _ in range(CHAIN_MAX):
        if i == 0 or i >= nchain:
            return
        yield i
        i, = struct.unpack("<I", e.at(at + 8 + 4 * nbucket + 4 * i, 4, "a hash chain"))
    raise untrusted.Refused(f"a hash chain longer than {CHAIN_MAX}")


# --- one process: the files it maps executable, which of them are drivers ---

class Plain:
    """Files known to export no entry point: (dev, ino, size, ctime) -> True, the latest
    PLAIN_CACHE. ctime is in the key: a write to a file (which a tenant may own) makes it new."""

    def __init__(self, cap: int = PLAIN_CACHE):
        self.cap = cap
        self.d: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def key(st: os.stat_result) -> tuple:
        return st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns

    def __contains__(self, k) -> bool:
        return k in self.d

    def add(self, keys) -> None:
        for k in keys:
            self.d[k] = True
            self.d.move_to_end(k)
        while len(self.d) > self.cap:
            self.d.popitem(last=False)


def executable_mappings(pid: int) -> dict[tuple, str]:
    """(maps' dev, inode) -> one address range of each file pid maps executable."""
    fd = os.open(f"/proc/{pid}/maps", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        chunks, n = [], 0
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            n += len(b)
            if n > MAPS_CAP:
                raise untrusted.Refused(f"its memory map is over {MAPS_CAP >> 20} MiB")
            chunks.append(b)
    finally:
        os.close(fd)
    out = {}
    for rng, perms, dev, ino in _MAPS.findall(b"".join(chunks)):
        if perms[2:3] == b"x" and ino != b"0":
            out.setdefault((dev, ino), rng.decode())
    return out


def _fuse_devices(pid: int) -> set[bytes]:
    """The "major:minor" of pid's FUSE mounts, as /proc/PID/maps writes a mapping's device
    (mountinfo: "ID PARENT MAJ:MIN ROOT POINT OPTS ... - FSTYPE ...")."""
    from .gpumap import ENVIRON_CAP, _read_capped
    out = set()
    for line in (_read_capped(f"/proc/{pid}/mountinfo", ENVIRON_CAP) or b"").splitlines():
        left, sep, right = line.partition(b" - ")
        parts = left.split(b" ")
        if sep and right.startswith(b"fuse") and len(parts) > 2:
            major, _, minor = parts[2].partition(b":")
            if major.isdigit() and minor.isdigit():
                out.add(b"%02x:%02x" % (int(major), int(minor)))
    return out


def check(pid: int, known, plain: Plain, skip=frozenset()) -> tuple[list, list]:
    """On the reader thread: ([(inode, range, fd)] of each mapped file that exports a driver
    entry point and is not in `known` (ours: the caller owns fd), [plain keys found]). `known`:
    inodes discovery has (probed, failed or queued); skip: inodes never drivers (the shim)."""
    budget = untrusted.Budget(CHECK_BUDGET_S, MAPS_CAP + 256 * FILE_BYTES)
    drivers, new_plain = [], []
    fuse = _fuse_devices(pid)
    try:
        for (dev, _), rng in executable_mappings(pid).items():
            budget.take(0, "its mapped files")
            if dev in fuse:          # a stat or open there is a request to the mount's server
                raise untrusted.Uncheckable(f"it maps code from a FUSE mount ({dev.decode()})")
            path = f"/proc/{pid}/map_files/{rng}"
            try:
                st = os.stat(path)
            except OSError:          # unmapped meanwhile: a later open checks again
                continue
            inode = (st.st_dev, st.st_ino)
            if inode in known or inode in skip or Plain.key(st) in plain:
                continue
            fd = os.open(path, untrusted.OPEN_FLAGS)
            try:
                untrusted.check_mappable(fd)
                found = exports(fd, budget=untrusted.Budget(min(FILE_BUDGET_S, budget.deadline_left()), FILE_BYTES))
            except untrusted.Uncheckable:
                os.close(fd)
                raise
            except untrusted.Refused:   # not an ELF ld.so could resolve a name in: no entry point
                found = set()
            except BaseException:
                os.close(fd)
                raise
            if found:
                drivers.append((inode, rng, fd))
            else:
                os.close(fd)
                new_plain.append(Plain.key(st))
    except BaseException:
        for _, _, fd in drivers:
            os.close(fd)
        raise
    return drivers, new_plain
