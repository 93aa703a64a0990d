"""Which host GPU each of a process's CUDA ordinals is. An ordinal is process-local (FACTS.md,
2026-11-25: with CUDA_VISIBLE_DEVICES=3, or in a container given only GPU 3, the process's
device 0 is host GPU 3), while convgpu's books, limits, NVML measurements and views speak of
host GPUs (NVML indexes). BPF records the ordinal a process passes; this module tells the host
GPU, and the enforcer writes it into BPF's `gpumap` while the process is stopped at its
placement, before its first charge (bpf/books.bpf.c host_of()).

Evidence, strongest first:
- the kernel's: the /dev/nvidiaN character devices the process holds open (the driver opens one
  per GPU it sees, at cuInit, and keeps it open; N is NVML's minor number of that GPU), read
  from /proc/PID/fd. A process cannot open a GPU its container was not given.
- its environment: CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, parsed as the driver does
  (visible()). A hint only: a process can rewrite its /proc/PID/environ after it started.
- NVML's per-process lists, after the fact: check() says when a process shows on a GPU its
  mapping does not have.

The hint is taken when it names exactly the GPUs the kernel saw opened, or when it names some
of them (then the others are `also`: charged too, see Mapping). One opened GPU maps ordinal 0
whatever the environment says. Anything else is not established: the guess plus every GPU the
process may use, said in `status` and the log, never silently GPU 0."""
import logging
import os
import re
import stat
from dataclasses import dataclass, field

from .nvml import GpuInfo

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195          # the character major NVIDIA's /dev/nvidiaN nodes register (LANANA)
ENVIRON_CAP = 1 << 20       # bytes of /proc/PID/environ read at most (the kernel allows ~2 MiB)
FD_CAP = 65536              # fds of one process looked at, at most
NODE = re.compile(r".*/nvidia\d+")          # /dev/nvidiaN: what the driver opens, as /proc/PID/fd shows it
MAX_DEV = 16                # bpf/convgpu.h CG_MAX_DEV
GPUMAP_ALSO = 0xFFFFFFFF    # bpf/convgpu.h CG_GPUMAP_ALSO


@dataclass(frozen=True)
class Mapping:
    """hosts[ordinal] = host GPU. certain: the kernel's evidence fixes it; else `also` lists
    every host GPU the process may use, which each of its bytes is charged to as well (or not:
    the operator's choice, --unmapped-charge)."""
    hosts: tuple[int, ...]
    certain: bool
    how: str
    also: tuple[int, ...] = ()
    opened: tuple[int, ...] | None = None
    hint: tuple[int, ...] | None = None

    def host(self, ordinal: int) -> int:
        return self.hosts[ordinal] if 0 <= ordinal < len(self.hosts) else ordinal

    def to_json(self) -> dict:
        return {"hosts": list(self.hosts), "certain": self.certain, "how": self.how,
                "also": list(self.also)}


def enumeration(gpus: list[GpuInfo], order: str | None) -> list[int] | None:
    """Host GPUs in the driver's enumeration order, or None where it cannot be told. NVML
    indexes follow the PCI bus; so does CUDA_DEVICE_ORDER=PCI_BUS_ID, and so does the default
    FASTEST_FIRST among cards of one kind (ties go by PCI bus). Cards of several kinds under
    FASTEST_FIRST: which the driver counts fastest is not known here."""
    hosts = [g.index for g in sorted(gpus, key=lambda g: g.index)]
    if order == "PCI_BUS_ID" or len({g.name for g in gpus}) <= 1:
        return hosts
    return None


def visible(cvd: str | None, gpus: list[GpuInfo], order: str | None) -> list[int] | None:
    """CUDA_VISIBLE_DEVICES as the driver reads it at cuInit: host GPUs in ordinal order, or
    None where the list cannot be resolved here (indexes under an unknown enumeration).
    Entries: indexes into the enumeration, GPU-<uuid> (a prefix naming one GPU is enough), or a
    MIG instance (MIG-<uuid>, or the old MIG-GPU-<uuid>/gi/ci), which is its parent GPU: a MIG
    instance's memory is a slice of its parent's, and convgpu's books and limits are per
    physical GPU. The first entry that names no GPU (a bad index, an unknown or ambiguous UUID,
    a repeat) ends the list. Unset: every GPU; set and empty: none (FACTS: count 0)."""
    enum = enumeration(gpus, order)
    if cvd is None:
        return enum
    out: list[int] = []
    for e in cvd.split(","):
        if e.startswith("MIG-GPU-"):          # the old form: MIG-GPU-<parent uuid>/<gi>/<ci>
            hit = [g.index for g in gpus if g.uuid == e[4:].split("/")[0]]
            h = hit[0] if len(hit) == 1 else None
        elif e.startswith("MIG-") and not any(g.migs for g in gpus):
            return None     # NVML listed no instances (MIG off, or not readable): not known here
        elif e.startswith("MIG-") and len(e) > 4:   # an instance (a prefix naming one): its parent GPU
            hit = [g.index for g in gpus for m in g.migs if m.startswith(e)]
            h = hit[0] if len(hit) == 1 else None
        elif e.startswith("GPU-") and len(e) > 4:
            hit = [g.index for g in gpus if g.uuid.startswith(e)]
            h = hit[0] if len(hit) == 1 else None
        elif e.isdigit() and e.isascii():
            if enum is None:
                return None
            h = enum[int(e)] if int(e) < len(enum) else None
        else:
            h = None
        if h is None or h in out:
            break
        out.append(h)
    return out


def resolve(hint: list[int] | None, opened: set[int] | None, gpus: list[GpuInfo]) -> Mapping:
    """The mapping from the hint (visible()) and the host GPUs whose nodes it opened."""
    every = tuple(sorted(g.index for g in gpus))
    h = tuple(hint) if hint is not None else None
    o = tuple(sorted(opened)) if opened is not None else None
    if o:
        if h is not None and set(h) == set(o):
            return Mapping(h, True, "CUDA_VISIBLE_DEVICES names the GPUs it opened", (), o, h)
        if len(o) == 1:
            why = "" if h == o else " (its CUDA_VISIBLE_DEVICES says otherwise: not believed)"
            return Mapping(o, True, f"the one GPU device node it opened{why}", (), o, h)
        if h and set(h) < set(o):
            return Mapping(h, False, "CUDA_VISIBLE_DEVICES names only some of the GPUs it opened",
                           o, o, h)
        return Mapping(o, False, "it opened several GPUs and CUDA_VISIBLE_DEVICES does not tell "
                       "their order", o, o, h)
    if h is not None and len(h) == 0:
        return Mapping((), True, "CUDA_VISIBLE_DEVICES is empty: it sees no GPU", (), o, h)
    return Mapping(h if h else every, False, "no GPU device node open" if o is not None else
                   "its device nodes could not be read", every, o, h)


def check(m: Mapping, measured: set[int]) -> str | None:
    """NVML's lists against the mapping: a GPU the process shows on that it was not charged to."""
    bad = sorted(measured - set(m.hosts) - set(m.also))
    return (f"NVML lists it on GPU{', GPU'.join(map(str, bad))}, which its mapping "
            f"{list(m.hosts)} does not have") if bad else None


# --- reading a process (hostile input: docs/SECURITY.md) ---

def nvidia_major(proc_devices: str = "/proc/devices") -> int:
    """The character major of NVIDIA's device nodes on this host, as the kernel lists it
    (CONVGPU_GPU_MAJORS: the tests' stand-in nodes, as probes/nodes.py reads it)."""
    env = os.environ.get("CONVGPU_GPU_MAJORS")
    if env and env.split(",")[0].isdigit():
        return int(env.split(",")[0])
    try:
        with open(proc_devices) as f:
            text = f.read(1 << 16)
    except OSError:
        return NVIDIA_MAJOR
    chars = text.split("Block devices:")[0]
    for line in chars.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] in ("nvidia-frontend", "nvidia"):
            return int(parts[0])
    return NVIDIA_MAJOR


def read_env(pid: int, names: tuple[str, ...]) -> dict[str, str] | None:
    """Those variables from /proc/PID/environ (no symlink followed, at most ENVIRON_CAP bytes),
    or None if unreadable. A variable past the cap reads as unset."""
    data = _read_capped(f"/proc/{pid}/environ", ENVIRON_CAP)
    if data is None:
        return None
    out = {}
    for item in data.split(b"\0"):
        k, eq, v = item.partition(b"=")
        name = k.decode("ascii", "replace")
        if eq and name in names:
            out[name] = v.decode("ascii", "replace")[:4096]
    return out


def _read_capped(path: str, cap: int) -> bytes | None:
    """A /proc file the kernel writes (no symlink followed, at most cap bytes), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks, n = [], 0
        while n < cap:
            b = os.read(fd, min(65536, cap - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def fuse_mounts(mountinfo: bytes) -> set[int]:
    """Mount ids of FUSE mounts in a /proc/PID/mountinfo ("ID PARENT ... - FSTYPE ..."): a stat
    there is answered by a user-space server, which may never answer, and may say any device
    number."""
    out = set()
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(b" - ")
        if sep and right.startswith(b"fuse") and left.split(b" ", 1)[0].isdigit():
            out.add(int(left.split(b" ", 1)[0]))
    return out


def opened_minors(pid: int, major: int) -> set[int] | None:
    """Minors of the NVIDIA character devices the process holds open, from the kernel: each fd's
    link names the file (readlink, which touches nothing), and only a name the driver uses, on a
    mount that is not FUSE (its fdinfo's mnt_id), is stat'ed (through the magic link: the open
    file itself, no path resolved in the process's mount namespace) for its device number.
    None if /proc/PID/fd is unreadable."""
    d = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(d)
    except OSError:
        return None
    out, fuse = set(), None
    for fd in fds[:FD_CAP]:
        try:
            if not NODE.fullmatch(os.readlink(f"{d}/{fd}")):
                continue
            if fuse is None:
                fuse = fuse_mounts(_read_capped(f"/proc/{pid}/mountinfo", ENVIRON_CAP) or b"")
            info = _read_capped(f"/proc/{pid}/fdinfo/{fd}", 4096) or b""
            mnt = next((int(x.split()[1]) for x in info.splitlines() if x.startswith(b"mnt_id:")), -1)
            if mnt < 0 or mnt in fuse:
                continue
            st = os.stat(f"{d}/{fd}")
        except (OSError, ValueError, IndexError):
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == major:
            out.add(os.minor(st.st_rdev))
    return out


@dataclass
class Mapper:
    """Mappings per process, read once per (pid, start time). gpus: the host's GPUs (NVML);
    major: NVIDIA's character major (tests: another device's)."""
    gpus: list[GpuInfo] = field(default_factory=list)
    major: int = field(default_factory=nvidia_major)
    cache: dict = field(default_factory=dict)      # pid -> (start time, Mapping)

    def of(self, pid: int) -> Mapping:
        start = _start_time(pid)
        got = self.cache.get(pid)
        if got is not None and (got[0] == start or start is None):   # gone: what it was
            return got[1]
        env = read_env(pid, ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"))
        opened = opened_minors(pid, self.major)
        by_minor = {g.minor: g.index for g in self.gpus if g.minor >= 0}
        hosts = None if opened is None else {by_minor[m] for m in opened if m in by_minor}
        hint = None if env is None or not self.gpus else visible(env.get("CUDA_VISIBLE_DEVICES"), self.gpus,
                                                env.get("CUDA_DEVICE_ORDER"))
        m = resolve(hint, hosts, self.gpus)
        self.cache[pid] = (start, m)
        if len(self.cache) > 4 * 16384:     # bounded: the oldest go first
            for k in list(self.cache)[:16384]:
                del self.cache[k]
        (log.info if m.certain else log.warning)(
            "pid %d: CUDA devices %s are host GPUs %s: %s%s", pid, list(range(len(m.hosts))),
            list(m.hosts), m.how, f"; not established: also charged to GPU {list(m.also)}"
            if m.also else "")
        return m

    def host(self, pid: int, ordinal: int) -> int:
        """For each event: the cached mapping (forget() at its exit), read once per process."""
        got = self.cache.get(pid)
        return (got[1] if got is not None else self.of(pid)).host(ordinal)

    def forget(self, pid: int) -> None:
        self.cache.pop(pid, None)

    def uuid(self, host: int) -> str:
        return next((g.uuid for g in self.gpus if g.index == host), "")


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        return int(data.rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def bpf_entries(pid: int, m: Mapping, charge_also: bool) -> list[tuple[int, int, int]]:
    """(key, host, also) rows for BPF's gpumap (bpf/convgpu.h): one per ordinal, and the
    `also` row, always written: BPF drops a process's rows at its exit when that row is there."""
    also = sum(1 << h for h in m.also if 0 <= h < MAX_DEV) if charge_also else 0
    rows = [(pid << 32 | o, h, 0) for o, h in enumerate(m.hosts[:MAX_DEV])]
    return rows + [(pid << 32 | GPUMAP_ALSO, -1, also)]
