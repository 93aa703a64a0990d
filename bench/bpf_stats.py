"""BPF run time per program, from the kernel's own counters (run_time_ns / run_cnt of each
program, kept while run-time statistics are on), through the bpf syscall with ctypes: the H100
image has no bpftool and nothing can be installed there.

Statistics are turned on with BPF_ENABLE_STATS, not the `kernel.bpf_stats_enabled` sysctl: the
kernel keeps them on while any such descriptor is open and off after the last one closes, so a
benchmark never leaves them on, nor turns them off under someone else's measurement. They cost
every BPF program on the host two clock reads per run while on, so take timings without them.

The programs are found through a process's descriptors (/proc/PID/fd/N -> anon_inode:bpf-prog,
its fdinfo names the prog_id): on a host shared with other tracers only the benchmark's own
tracer or enforcer (and its watchdog child) count."""
import contextlib
import ctypes
import os
import struct

SYS_BPF = 321                  # x86_64
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_ENABLE_STATS = 32
BPF_STATS_RUN_TIME = 0
INFO_SIZE = 256                # struct bpf_prog_info of 6.x is 232 bytes; the rest stays zero
NAME_AT, RUN_TIME_AT = 64, 192  # name[16]; run_time_ns, run_cnt (uapi/linux/bpf.h)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: bytes) -> int:
    buf = ctypes.create_string_buffer(attr, 128)
    rc = _libc.syscall(SYS_BPF, cmd, buf, 128)
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"bpf({cmd}): {os.strerror(e)}")
    return rc


@contextlib.contextmanager
def enabled():
    """Run-time statistics on for the with-block (root)."""
    fd = _bpf(BPF_ENABLE_STATS, struct.pack("<I", BPF_STATS_RUN_TIME))
    try:
        yield
    finally:
        os.close(fd)


def prog_info(prog_id: int) -> tuple[str, int, int]:
    """(name, run_time_ns, run_cnt) of a loaded program."""
    fd = _bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("<III", prog_id, 0, 0))
    try:
        info = ctypes.create_string_buffer(INFO_SIZE)
        _bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", fd, INFO_SIZE, ctypes.addressof(info)))
        raw = info.raw
        name = raw[NAME_AT:NAME_AT + 16].split(b"\0", 1)[0].decode()
        run_ns, runs = struct.unpack_from("<QQ", raw, RUN_TIME_AT)
        return name, run_ns, runs
    finally:
        os.close(fd)


def runs_of(prog_fd: int) -> int:
    """How often the program behind one of our descriptors ran while statistics were on."""
    with open(f"/proc/self/fdinfo/{prog_fd}") as f:
        prog_id = int(next(line.split(":", 1)[1] for line in f if line.startswith("prog_id")))
    return prog_info(prog_id)[2]


def children(pid: int) -> list[int]:
    """pid's child processes (also used by tests/system/test_demo.py)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def held(pid: int, kind: str) -> list[dict[str, str]]:
    """The fdinfo of every BPF object of `kind` ("prog", "map") that `pid` or its descendants
    hold a descriptor of (the enforcer and its watchdog), one per descriptor."""
    out = []
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children(p)
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p}/fd/{fd}") != f"anon_inode:bpf-{kind}":
                    continue
                with open(f"/proc/{p}/fdinfo/{fd}") as f:
                    out.append({k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)})
            except OSError:
                continue
    return out


def prog_ids(pid: int) -> set[int]:
    """Programs whose descriptors `pid` or its descendants hold."""
    return {int(i["prog_id"]) for i in held(pid, "prog") if "prog_id" in i}


def snapshot(pid: int) -> dict[str, tuple[int, int]]:
    """{program name: (run_time_ns, run_cnt)}, summed over programs of one name (bcc loads each
    function once; a name twice would be two loads of one program, e.g. after a take-over)."""
    out: dict[str, tuple[int, int]] = {}
    for i in sorted(prog_ids(pid)):
        try:
            name, ns, n = prog_info(i)
        except OSError:
            continue        # unloaded meanwhile
        t, c = out.get(name, (0, 0))
        out[name] = (t + ns, c + n)
    return out


def delta(before: dict, after: dict) -> dict[str, dict]:
    """Per program that ran in between: runs and mean ns per run."""
    out = {}
    for name, (ns, n) in sorted(after.items()):
        ns0, n0 = before.get(name, (0, 0))
        if n > n0:
            out[name] = {"runs": n - n0, "ns_per_run": (ns - ns0) / (n - n0)}
    return out
