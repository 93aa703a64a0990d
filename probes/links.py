"""Uprobes as BPF links (BPF_TRACE_UPROBE_MULTI, Linux >= 6.6) instead of perf events.

Why: a perf-event uprobe is detached under the kernel's event_mutex, with its RCU grace
periods waited for there, one probe at a time (probes/detach.py): 0.1-0.5 s each, 18-22 s for
the ~80 of an enforcer on the H100, during which the probes still fire in every process. A link
is released without that mutex, and releases made from several threads share their grace
periods: 40 links closed from 40 threads took 0.08 s on the CPU machine, against 4.3 s as perf
events and 2.2 s as links closed one by one. No trace event is created at attach either.

A program attached this way must be loaded with expected_attach_type UPROBE_MULTI, which a
perf event refuses, so the first attach decides for one BPF object: links if the kernel takes
them, else bcc's perf events for every probe of that object (kernels before 6.6). Where a link
is refused because another tool's perf-event uprobe is on that entry point, that one probe is
a perf event (_perf_copy). CONVGPU_UPROBE_LINKS=off forces perf events (the tests run both
ways)."""
import ctypes as ct
import errno
import logging
import os
import struct
import tempfile

log = logging.getLogger(__name__)
BPF_PROG_LOAD, BPF_LINK_CREATE = 5, 28
BPF_PROG_TYPE_KPROBE = 2
BPF_TRACE_UPROBE_MULTI = 48           # enum bpf_attach_type
BPF_TRACE_UPROBE_SESSION = 57         # Linux >= 6.13: one program at entry and return
BPF_F_UPROBE_MULTI_RETURN = 1
SYS_BPF, SYS_PERF_EVENT_OPEN = 321, 298    # x86_64
PERF_FLAG_FD_CLOEXEC = 8
PERF_EVENT_IOC_ENABLE, PERF_EVENT_IOC_SET_BPF = 0x2400, 0x40042408
_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long
# errors that say "this kernel has no uprobe_multi links", not "this probe failed"
_UNSUPPORTED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.E2BIG}


class _LinkCreate(ct.Structure):   # union bpf_attr, the link_create.uprobe_multi member
    _fields_ = [("prog_fd", ct.c_uint32), ("target_fd", ct.c_uint32), ("attach_type", ct.c_uint32),
                ("flags", ct.c_uint32), ("path", ct.c_uint64), ("offsets", ct.c_uint64),
                ("ref_ctr_offsets", ct.c_uint64), ("cookies", ct.c_uint64), ("cnt", ct.c_uint32),
                ("multi_flags", ct.c_uint32), ("pid", ct.c_uint32), ("pad", ct.c_uint32)]


def wanted() -> bool:
    return os.environ.get("CONVGPU_UPROBE_LINKS", "on").lower() not in ("off", "0", "no")


def _link_create(prog_fd: int, path: bytes, offset: int, ret: bool,
                 attach_type: int = BPF_TRACE_UPROBE_MULTI) -> int:
    offsets = (ct.c_uint64 * 1)(offset)
    p = ct.create_string_buffer(path)
    attr = _LinkCreate(prog_fd=prog_fd, attach_type=attach_type, path=ct.addressof(p),
                       offsets=ct.addressof(offsets), cnt=1,
                       multi_flags=BPF_F_UPROBE_MULTI_RETURN if ret else 0)
    fd = _libc.syscall(SYS_BPF, BPF_LINK_CREATE, ct.byref(attr), ct.sizeof(attr))
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, os.strerror(e))
    return fd


def prog_load(prog_type: int, name: bytes, code, insn_cnt: int, license: bytes, kern_version: int,
              attach_type: int) -> int:
    """BPF_PROG_LOAD with an expected_attach_type, which bcc_prog_load cannot pass (the cached
    programs' load, probes/replay.py); -1 and errno set on failure, as bcc's."""
    lic = ct.create_string_buffer(license)
    # union bpf_attr: prog_type, insn_cnt, insns, license, log_level/size/buf, kern_version,
    # prog_flags, prog_name[16], prog_ifindex, expected_attach_type
    attr = struct.pack("<IIQQIIQII16sII", prog_type, insn_cnt, ct.addressof(code), ct.addressof(lic),
                       0, 0, 0, kern_version, 0, name[:15], 0, attach_type)
    buf = ct.create_string_buffer(attr, len(attr))
    return _libc.syscall(SYS_BPF, BPF_PROG_LOAD, buf, len(buf))


def supported(attach_type: int = BPF_TRACE_UPROBE_MULTI) -> tuple[bool, str]:
    """For `convgpu doctor`: does this kernel take uprobe links (or, BPF_TRACE_UPROBE_SESSION,
    sessions)? A two-instruction program is linked to a file nobody maps (so it never runs),
    and the link closed."""
    what = "uprobe session" if attach_type == BPF_TRACE_UPROBE_SESSION else "uprobe_multi"
    code = (ct.c_ubyte * 16).from_buffer_copy(bytes.fromhex("b700000000000000" "9500000000000000"))
    fd = prog_load(BPF_PROG_TYPE_KPROBE, b"convgpu_feature", code, 2, b"GPL", 0, attach_type)
    if fd < 0:
        return False, f"program load refused: {os.strerror(ct.get_errno())}"
    try:
        with tempfile.NamedTemporaryFile() as f:
            f.write(bytes(16))
            f.flush()
            os.close(_link_create(fd, f.name.encode(), 0, False, attach_type))
        return True, f"{what} links"
    except OSError as e:
        return False, f"{what} link refused: {e.strerror}"
    finally:
        os.close(fd)


def _state(b) -> list | bool | None:
    """b's links (a list) once the kernel took one, False once it refused, None before."""
    return getattr(b, "convgpu_links", None)


def kind(b) -> str:
    return "links" if isinstance(_state(b), list) else "perf events"


def kind_known(b) -> str | None:
    """kind(b) once the first attach decided it, else None."""
    return None if _state(b) is None else kind(b)


def attach(b, fn_name: bytes, path: bytes, offset: int, sym: bytes, sym_off: int = 0,
           ret: bool = False) -> int | None:
    """Run b's function fn_name at file offset `offset` of path (sym+sym_off), on entry or
    (ret) on return, in every process. The link's descriptor, or None for a perf event. path
    is our own /proc/self/fd/N of a checked file (probes/untrusted.py), and nothing here looks
    a symbol up by name in a file (bcc's lookup once opened a container's FIFO by path and
    blocked: issue 24 row 3)."""
    if _state(b) is not False and wanted():
        import bcc
        try:
            fn = b.load_func(fn_name, bcc.BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
            fd = _link_create(fn.fd, path, offset, ret)
        except Exception as e:   # bcc's load failure is a bare Exception
            if isinstance(e, OSError) and e.errno == errno.EINVAL and (_state(b) or supported()[0]):
                if _state(b) is None:
                    b.convgpu_links = []
                _perf_copy(b, fn_name, path, sym, sym_off, ret)
                return None
            if _state(b) is not None or (isinstance(e, OSError) and e.errno not in _UNSUPPORTED):
                raise
            log.info("uprobe links refused (%s): perf-event uprobes, slow to detach", e)
            b.convgpu_links = False
            fn = b.funcs.pop(fn_name, None)   # loaded for links, which a perf event refuses
            if fn is not None:
                os.close(fn.fd)
        else:
            if _state(b) is None:
                b.convgpu_links = []
            b.convgpu_links.append(fd)
            return fd
    _perf(b, fn_name, path, offset, ret)
    return None


class _PerfAttr(ct.Structure):   # struct perf_event_attr, as far as a uprobe needs it
    _fields_ = [("type", ct.c_uint32), ("size", ct.c_uint32), ("config", ct.c_uint64),
                ("sample_period", ct.c_uint64), ("sample_type", ct.c_uint64), ("read_format", ct.c_uint64),
                ("flags", ct.c_uint64), ("wakeup_events", ct.c_uint32), ("bp_type", ct.c_uint32),
                ("config1", ct.c_uint64), ("config2", ct.c_uint64), ("rest", ct.c_ubyte * 56)]


def _perf(b, fn_name: bytes, path: bytes, offset: int, ret: bool) -> None:
    """A perf-event uprobe through the kernel's `uprobe` PMU, made here: bcc's attach_uprobe
    falls back to a tracefs event named after the path (/proc/self/fd/N here) that its
    background detach (probes/detach.py) leaves behind, armed. Kept in b.uprobe_fds, where
    bcc's cleanup and the hand-off find it (bcc removes a tracefs event only if it exists)."""
    import bcc
    fn = b.load_func(fn_name, bcc.BPF.KPROBE)
    with open("/sys/bus/event_source/devices/uprobe/type") as f:
        pmu = int(f.read())
    p = ct.create_string_buffer(path)
    attr = _PerfAttr(type=pmu, size=ct.sizeof(_PerfAttr), config=1 if ret else 0,   # format/retprobe: config:0
                     sample_period=1, wakeup_events=1, config1=ct.addressof(p), config2=offset)
    fd = _libc.syscall(SYS_PERF_EVENT_OPEN, ct.byref(attr), -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, f"perf_event_open uprobe: {os.strerror(e)}")
    if _libc.ioctl(fd, PERF_EVENT_IOC_SET_BPF, fn.fd) < 0 or _libc.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0) < 0:
        e = ct.get_errno()
        os.close(fd)
        raise OSError(e, f"perf event uprobe: {os.strerror(e)}")
    b._add_uprobe_fd(b"%s_convgpu_%s_0x%x_%s" % (b"r" if ret else b"p", path, offset, fn_name), fd)


def _perf_copy(b, fn_name: bytes, path: bytes, sym: bytes, sym_off: int, ret: bool) -> None:
    """The kernel refused a link where it took earlier ones: a perf-event uprobe is already on
    this entry point, and a uprobe there cannot take a second consumer with another
    ref_ctr_offset (bcc 0.26's Python passes an uninitialised one: dmesg says "ref_ctr_offset
    mismatch"). Another bcc tool, or convgpu before links still detaching after a restart. This
    one probe is then a perf event too, of a second copy of the program (one loaded for links
    cannot be one)."""
    log.warning("%s+%d in %s: a perf-event uprobe of another tool is there; this probe is a perf "
                "event too (slow to detach)", sym.decode(), sym_off, path.decode())
    mine = b.funcs.pop(fn_name)
    try:   # through bcc, as the other tool did: its probe then has the same ref_ctr_offset; the
           # lookup reads our own descriptor of a regular file (not a path anyone can swap)
        if ret:
            b.attach_uretprobe(name=path, sym=sym, fn_name=fn_name)
        else:
            b.attach_uprobe(name=path, sym=sym, sym_off=sym_off, fn_name=fn_name)
    finally:
        copy = b.funcs.pop(fn_name, None)
        b.funcs[fn_name] = mine
        if copy is not None:
            os.close(copy.fd)   # the perf event holds the program


def sessions_wanted() -> bool:
    return os.environ.get("CONVGPU_UPROBE_SESSIONS", "on").lower() not in ("off", "0", "no")


def attach_session(b, fn_name: bytes, path: bytes, offset: int) -> int | None:
    """fn_name as a uprobe session at offset of path: the same program runs at the entry and,
    unless its entry returned 1, at the return (issue 32: a free settled at its entry spares the
    return trap). The link's descriptor, or None where this kernel (before 6.13), a perf-event
    object or CONVGPU_UPROBE_SESSIONS=off says no: the caller then attaches enter and exit."""
    if not (sessions_wanted() and wanted()) or _state(b) is False or getattr(b, "convgpu_sessions", None) is False:
        return None
    import bcc
    try:
        fn = b.load_func(fn_name, bcc.BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_SESSION)
        fd = _link_create(fn.fd, path, offset, False, BPF_TRACE_UPROBE_SESSION)
    except Exception as e:   # bcc's load failure is a bare Exception
        if getattr(b, "convgpu_sessions", None) or (isinstance(e, OSError) and e.errno not in _UNSUPPORTED):
            raise
        log.info("uprobe sessions refused (%s): frees get a return probe each", e)
        b.convgpu_sessions = False
        fn = b.funcs.pop(fn_name, None)
        if fn is not None:
            os.close(fn.fd)
        return None
    b.convgpu_sessions = True
    if _state(b) is None:
        b.convgpu_links = []
    b.convgpu_links.append(fd)
    return fd


def fds(b) -> list[int]:
    """b's link descriptors (the enforcer's watchdog keeps duplicates: enforcer/failsafe/takeover.py)."""
    return list(_state(b)) if isinstance(_state(b), list) else []


def release(b, mine: list[int]) -> None:
    """Detach some of b's links at once (a library no process maps any more)."""
    from ..enforcer.failsafe.watchdog import close_all
    if not mine:
        return
    gone = set(mine)
    b.convgpu_links[:] = [fd for fd in fds(b) if fd not in gone]
    close_all(list(gone))


def close(b) -> int:
    """Detach every link of b at once; the number closed."""
    from ..enforcer.failsafe.watchdog import close_all   # there, as the watchdog runs on the stdlib alone
    mine = fds(b)
    close_all(mine)
    if mine:
        b.convgpu_links.clear()
    return len(mine)
