"""Compile bpf/convgpu.bpf.c and its parts with bcc; attach the probe table to libraries.

A library is verified by reading it, never by running it (probes/untrusted.py: a container's
libcuda.so.1 is hostile, issue 24 row 1): its ELF symbol tables give each probed symbol's file
offset, and the first instruction there is classified (FACTS.md: a uprobe on a `lock`-prefixed
first instruction is never installed), all from our own descriptor of the file; the probes go
on that very inode through /proc/self/fd/N. Only the host's own driver (root-owned, on a host
path, writable by root alone: untrusted.trusted) is also self-tested: a child calls every driver
symbol once, before cuInit, where the driver answers CUDA_ERROR_NOT_INITIALIZED without touching
the GPU, and the per-API hit counters must move. That test can only veto a library the reading
accepted; it never admits one alone."""
import contextlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .. import phases
from ..bpf import DIR as BPF_DIR, SOURCE, source_text
from ..errors import PrerequisiteError, ProbeError
from . import bpfcache, links, prologue, untrusted
from .libs import Library
from .table import ADMITTED, CUDA, PROBES, TOUCH, Probe

log = logging.getLogger(__name__)


def import_bcc():
    try:
        import bcc  # noqa: F401  (distro package python3-bpfcc)
        return bcc
    except ImportError as e:
        raise PrerequisiteError(f"cannot import bcc ({e})",
                                "install python3-bpfcc and use a venv made with --system-site-packages "
                                "(scripts/setup.sh does both); PyPI's 'bcc' is another package") from e


def _tracefs_file(rel: str) -> str | None:
    for base in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.exists(f"{base}/{rel}"):
            return f"{base}/{rel}"
    return None


# discovery's syscall tracepoints (bpf/discovery.bpf.c): opens of a driver file or a GPU node, and
# executable mappings (probes/nodes.py)
OPEN_TRACEPOINTS = ("sys_enter_openat", "sys_exit_openat", "sys_exit_open", "sys_exit_openat2",
                    "sys_enter_mmap", "sys_exit_mmap", "sys_enter_mprotect", "sys_exit_mprotect",
                    "sys_enter_pkey_mprotect", "sys_exit_pkey_mprotect", "sys_enter_shmat", "sys_exit_shmat")


def has_open_tracepoints() -> bool:
    """Discovery stops a process at its open of a driver file or a GPU node (CONFIG_FTRACE_SYSCALLS)."""
    return all(_tracefs_file(f"events/syscalls/{e}/format") for e in OPEN_TRACEPOINTS)


def cflags(ringbuf_pages: int = 4096, extra: tuple = ()) -> list[str]:
    """What the compiled code depends on; per-start values go into the config map (configure)."""
    flags = [f"-I{BPF_DIR}", f"-DRINGBUF_PAGES={ringbuf_pages}"]
    fmt = _tracefs_file("events/sched/sched_process_exit/format")
    if fmt and "group_dead" in open(fmt).read():
        flags.append("-DHAVE_GROUP_DEAD")   # 6.x: exact "last thread of the process" signal
    if not has_open_tracepoints():
        flags.append("-DNO_OPEN_TRACEPOINTS")
    return flags + list(extra)


def compile_program(self_tgid: int | None = None, ringbuf_pages: int = 4096, extra=(), owner: int = 0,
                    cache: str | None = None):
    """The BPF program, loaded and configured: replayed from the cache of compiled programs when
    it holds this one (probes/bpfcache.py), else compiled by bcc (and cached). self_tgid: the
    process never accounted (default: this one); owner: the enforcer instance whose program
    this is (control.owner); cache: its directory, "off" for none (default: CONVGPU_BPF_CACHE
    or /var/cache/convgpu/bpf). b.origin says which it was: ("replayed" | "compiled", seconds)."""
    if os.geteuid() != 0:
        raise PrerequisiteError("convgpu needs root to load BPF programs", "run it with sudo")
    bcc = import_bcc()
    flags = cflags(ringbuf_pages, extra)
    b = load_program(bcc, str(SOURCE), flags, bpfcache.cache_dir(cache))
    configure(b, os.getpid() if self_tgid is None else self_tgid, owner)
    if "-DNO_OPEN_TRACEPOINTS" not in flags:
        from .nodes import configure as know_nodes
        know_nodes(b)        # discovery by identity: GPU majors, the kernel's file layout
    return b


def load_program(bcc, src: str, flags: list[str], directory: str | None):
    """Replay src's cached compile under flags, else compile it (and cache the compile)."""
    t0 = time.monotonic()
    _, pin_dir = bpfcache.split_flags(flags)
    mat = bpfcache.material(src, flags) if directory else None
    spec = bpfcache.load(directory, mat) if directory else None
    if spec is not None:
        from .replay import Replayed
        try:
            b = Replayed(spec, pin_dir)
            b.origin = ("replayed", time.monotonic() - t0)
            log.info("BPF program replayed from %s in %.3f s", bpfcache.path_of(directory, mat), b.origin[1])
            return b
        except Exception as e:
            if "pinned map" in str(e):
                raise   # an older layout under the pins: the compile would load over it blindly
            log.warning("cannot replay the cached BPF program (%s): compiling", e)
    try:
        b = bcc.BPF(text=source_text(src).encode(), cflags=flags)   # src with its parts pasted in
    except Exception as e:  # bcc raises bare Exception for compile/load failures
        msg = str(e)
        if "kernel headers" in msg.lower() or "modules" in msg:
            raise PrerequisiteError(f"bcc cannot compile the BPF program: {msg}",
                                    "install kernel headers (scripts/setup.sh links generic ones); run `convgpu doctor`") from e
        raise PrerequisiteError(f"cannot load the BPF program: {msg}", "run `convgpu doctor`") from e
    b.origin = ("compiled", time.monotonic() - t0)
    log.info("BPF program compiled in %.2f s", b.origin[1])
    if directory:
        try:
            from bcc.libbcc import lib
            path = bpfcache.save(directory, mat, bpfcache.capture(b, lib, pin_dir))
            if path:
                log.info("compiled BPF program cached in %s", path)
        except bpfcache.Uncacheable as e:
            log.warning("the compiled BPF program cannot be cached (%s): every start compiles", e)
    return b


def cache_state(pinned: bool, cache: str | None = None) -> tuple[str, str]:
    """("warm" | "cold" | "off", detail) of the cached compile an enforcer (pinned: its maps
    under bpffs) or a tracer would replay now."""
    flags = cflags(extra=(f'{bpfcache.PIN_FLAG}"-"',) if pinned else ())
    return bpfcache.state(bpfcache.cache_dir(cache), bpfcache.material(str(SOURCE), flags))


def configure(b, self_tgid: int, owner: int) -> None:
    """The per-start values (struct cg_config), before any probe is attached: also where the
    running kernel keeps a task's tracer (probes/btf.py), for BPF's foreign_tracer()."""
    from .btf import task_offsets
    task = task_offsets()
    t = b[b"config"]
    t[t.Key(0)] = t.Leaf(self_tgid=self_tgid, owner=owner, task_ptrace=task.ptrace,
                         task_parent=task.parent, task_tgid=task.tgid)


@dataclass
class Attached:
    probe: Probe
    library: Library
    ok: bool
    reason: str = ""
    insn: str = ""          # emulated / stepped / unprobeable
    fired: bool | None = None  # self-test result; None = not tested
    recheck: bool | None = None  # enforce: recheck probe attached (None: not wanted)
    recheck_at: str = ""    # where: "+4 emulated", or "+1 stepped" where no push follows the entry
    session: bool = False   # one session program at entry and return (table.Probe.session)


@dataclass
class LibraryProbes:
    library: Library
    probes: list[Attached] = field(default_factory=list)
    link_fds: list[int] = field(default_factory=list)   # its uprobe links: closed when it goes

    @property
    def missing_required(self) -> list[Attached]:
        return [a for a in self.probes if not a.ok and a.probe.required]


def preload(b, recheck: bool = False) -> None:
    """A replayed program (a warm start): every function the table attaches is verified at
    once, in parallel (Replayed.preload), before the attach loop asks for them one by one.
    Loaded for uprobe links where the kernel takes them (probes/links.py), else for perf events."""
    if not hasattr(b, "preload"):
        return
    bcc = import_bcc()
    names = [n for p in PROBES for n in (p.enter, p.exit) if n] + (["recheck"] if recheck else [])
    with phases.timed("load"):
        as_links = links.wanted() and links.kind_known(b) in (None, "links") and links.supported()[0]
        b.preload(names, bcc.BPF.KPROBE, links.BPF_TRACE_UPROBE_MULTI if as_links else -1)
        if as_links and links.sessions_wanted() and getattr(b, "convgpu_sessions", None) is not False:
            b.preload([p.session for p in PROBES if p.session], bcc.BPF.KPROBE, links.BPF_TRACE_UPROBE_SESSION)


def symbols_of(lib: Library) -> dict[str, untrusted.Symbol]:
    """What the probes of lib.kind need from lib's file, read within untrusted.Budget (the
    enforcer runs this on its reader thread, probes/reading.py, never on its loop)."""
    return untrusted.read_symbols(lib.fd, [p.symbol for p in PROBES if p.library == lib.kind],
                                  prologue.PROLOGUE_BYTES)


def attach_library(b, lib: Library, recheck: bool = False, syms=None) -> LibraryProbes:
    """Attach every table entry for lib.kind. Optional symbols may be absent (older drivers).
    recheck: also probe admitted calls (enforce, table.ADMITTED) inside their prologue, on the
    first emulated instruction after the entry (probes/prologue.py), else the second one.
    syms: symbols_of(lib) read already (or the exception reading it raised); None: read now."""
    out = LibraryProbes(lib)
    if lib.fd < 0:
        raise ProbeError(f"cannot attach probes in {lib}: it was not opened", "run `convgpu doctor`")
    try:
        if isinstance(syms, BaseException):
            raise syms
        syms = symbols_of(lib) if syms is None else syms
    except (untrusted.Refused, OSError) as e:
        raise ProbeError(f"not a driver file: {e}", "a driver file is a 64-bit ELF shared object") from e
    path = f"/proc/self/fd/{lib.fd}".encode()   # the inode we read, whatever its name is now
    for probe in PROBES:
        if probe.library != lib.kind:
            continue
        a = Attached(probe, lib, ok=False)
        s = syms.get(probe.symbol)
        if s is None:
            a.reason = "symbol not exported by this library"
            out.probes.append(a)
            continue
        a.insn = prologue.classify(s.prologue)[0]
        if a.insn == "unprobeable":
            a.reason = "first instruction cannot be probed (lock prefix)"
            out.probes.append(a)
            continue
        try:
            sym = probe.symbol.encode()
            fd = links.attach_session(b, probe.session.encode(), path, s.offset) if probe.session else None
            a.session = fd is not None
            if fd is not None:
                out.link_fds.append(fd)
            else:
                out.link_fds.append(links.attach(b, probe.enter.encode(), path, s.offset, sym))
                if probe.exit:
                    out.link_fds.append(links.attach(b, probe.exit.encode(), path, s.offset, sym, ret=True))
            a.ok = True
            if recheck and probe.symbol in ADMITTED:
                site = prologue.recheck_site(s.prologue)
                a.recheck = site is not None
                if site is not None:
                    a.recheck_at = f"+{site[0]} {site[1]}"
                    out.link_fds.append(links.attach(b, b"recheck", path, s.offset + site[0], sym,
                                                     sym_off=site[0]))
        except Exception as e:
            a.reason = f"attach failed: {e}"
        out.probes.append(a)
    out.link_fds = [fd for fd in out.link_fds if fd is not None]
    stepped = [a.probe.symbol for a in out.probes if a.recheck_at.endswith("stepped")]
    if stepped:
        log.warning("%s: the recheck of %s is single-stepped (no push after the entry): several us "
                    "per call on a VM", lib, ", ".join(stepped))
    if out.missing_required:
        names = ", ".join(x.probe.symbol for x in out.missing_required)
        raise ProbeError(f"cannot attach required probes {names} in {lib}: "
                         f"{out.missing_required[0].reason}", "run `convgpu doctor`")
    return out


def attach_touch(b, lib: Library) -> list[int]:
    """bpf/swap.bpf.c `touch` on each of table.TOUCH that lib exports (its symbols read within
    untrusted.Budget, as any driver's): while a process is swapped its next call is heard. The
    links' descriptors (perf-event ones are b's own: detached with it)."""
    syms = untrusted.read_symbols(lib.fd, list(TOUCH), prologue.PROLOGUE_BYTES)
    path = f"/proc/self/fd/{lib.fd}".encode()
    out = []
    for name, s in sorted(syms.items()):
        if prologue.classify(s.prologue)[0] == "unprobeable":
            continue
        fd = links.attach(b, b"touch", path, s.offset, name.encode())
        if fd is not None:
            out.append(fd)
    return out


def recheck_sites(path: str) -> dict[str, tuple[int, str] | None]:
    """For `convgpu doctor`: where the enforcer would put each admitted symbol's recheck."""
    fd = untrusted.open_in_root("/", path)
    try:
        untrusted.check(fd)
        syms = untrusted.read_symbols(fd, sorted(ADMITTED), prologue.PROLOGUE_BYTES)
    finally:
        untrusted.close(fd)
    return {sym: prologue.recheck_site(s.prologue) for sym, s in sorted(syms.items())}


def read_hits(b) -> dict[int, int]:
    return {k.value: sum(v) for k, v in b[b"hits"].items()}


_SELFTEST = r"""
import ctypes, sys
sys.stdin.readline()   # the go: the enforcer exempts this pid from admission first
lib = ctypes.CDLL(sys.argv[1])
scratch = (ctypes.c_ubyte * 4096)()
p = ctypes.cast(scratch, ctypes.c_void_p)
bad = []
for name in sys.argv[2:]:
    f = getattr(lib, name)
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 5
    rc = f(p, p, p, p, p)
    # CUDA_ERROR_NOT_INITIALIZED: no cuInit was made, so nothing happened; INVALID_VALUE: the
    # arguments were refused first, nothing happened either (driver 580's cuMemAllocManaged,
    # cuGraphAddNode_v2 and cuGraphInstantiateWithFlags check their flags before the init)
    if rc not in (1, 3):
        bad.append(f"{name}={rc}")
print(" ".join(bad))
"""


def self_test(b, lp: LibraryProbes, exempt=lambda pid: contextlib.nullcontext(),
              timeout: float = 20.0) -> int | None:
    """Call each attached driver symbol once in a child (before cuInit: no GPU work) and mark
    which probes fired. Only for the driver: a runtime call would initialise the GPU.
    exempt(pid): a context manager under which the child calls (the enforcer's: admission
    skips that pid, and only it). Returns the child's pid, whose (failed, unaccounted) calls
    the caller should not show."""
    if lp.library.kind != CUDA or not lp.library.trusted:
        return None
    todo = [a for a in lp.probes if a.ok]
    if not todo:
        return None
    before = read_hits(b)
    child = subprocess.Popen([sys.executable, "-c", _SELFTEST, lp.library.path] + [a.probe.symbol for a in todo],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with exempt(child.pid):
            out, err = child.communicate("go\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        log.warning("self-test of %s timed out", lp.library)
        return child.pid
    if child.returncode != 0:
        log.warning("self-test of %s failed: %s", lp.library, (err.strip().splitlines() or [child.returncode])[-1])
        return child.pid
    if out.strip():
        log.info("self-test of %s: unexpected results %s", lp.library, out.strip())
    after = read_hits(b)
    for a in todo:
        a.fired = after.get(a.probe.api, 0) > before.get(a.probe.api, 0)
        if not a.fired:
            a.reason = "attached but never fired in the self-test"
    return child.pid
