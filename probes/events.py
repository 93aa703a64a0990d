"""Decode ring-buffer records (struct cg_event in bpf/convgpu.h) into Event objects.

The ctypes mirror below is checked field by field against the type bcc builds from the loaded
program (tests/system/test_layout.py), so the two cannot drift apart silently."""
import ctypes
from dataclasses import asdict, dataclass

from .table import API_NAMES

SCHEMA = 1  # CONVGPU_SCHEMA in convgpu.h

OPS = {1: "alloc", 2: "free", 3: "ctx_create", 4: "ctx_destroy", 5: "map", 6: "unmap",
       7: "reserve", 8: "unreserve", 9: "set_device", 10: "meminfo", 11: "exit", 12: "exec",
       13: "failed"}
EF_ESTIMATE, EF_UNKNOWN, EF_DEFERRED = 0x1, 0x2, 0x4


class CgEvent(ctypes.Structure):
    _fields_ = [
        ("ts_ns", ctypes.c_uint64),
        ("cgroup_id", ctypes.c_uint64),
        ("addr", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("live", ctypes.c_uint64),
        ("tgid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("dev", ctypes.c_int32),
        ("result", ctypes.c_uint32),
        ("api", ctypes.c_uint16),
        ("rt_api", ctypes.c_uint16),
        ("op", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 2),
        ("comm", ctypes.c_char * 16),
    ]


@dataclass(frozen=True)
class Event:
    ts_ns: int
    pid: int
    tid: int
    comm: str
    cgroup_id: int
    op: str
    api: str
    rt_api: str | None
    dev: int
    addr: int
    size: int
    live: int
    result: int
    flags: int

    @property
    def estimate(self) -> bool:
        return bool(self.flags & EF_ESTIMATE)

    @property
    def unknown(self) -> bool:
        return bool(self.flags & EF_UNKNOWN)

    @property
    def deferred(self) -> bool:
        return bool(self.flags & EF_DEFERRED)

    def to_json(self) -> dict:
        d = asdict(self)
        d["type"] = "event"
        d["schema"] = SCHEMA
        return d


def decode(raw: bytes | ctypes.Structure) -> Event:
    """From the bytes of one record (or a CgEvent) to an Event."""
    e = raw if isinstance(raw, CgEvent) else CgEvent.from_buffer_copy(bytes(raw)[: ctypes.sizeof(CgEvent)])
    return Event(
        ts_ns=e.ts_ns, pid=e.tgid, tid=e.tid, comm=e.comm.decode(errors="replace"),
        cgroup_id=e.cgroup_id, op=OPS.get(e.op, f"op{e.op}"),
        api=API_NAMES.get(e.api, f"api{e.api}"),
        rt_api=API_NAMES.get(e.rt_api) if e.rt_api else None,
        dev=e.dev, addr=e.addr, size=e.size, live=e.live, result=e.result, flags=e.flags,
    )


def decode_ptr(data, size: int) -> Event:
    """From bcc's ring-buffer callback arguments."""
    return decode(ctypes.cast(data, ctypes.POINTER(CgEvent)).contents)
