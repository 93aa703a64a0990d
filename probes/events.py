"""Decode ring-buffer records (struct cg_event in bpf/convgpu.h) into Event objects.

FIELDS below is checked field by field against the type bcc builds from the loaded program
(tests/system/test_tracer.py), so the two layouts cannot drift apart silently."""
import struct
from typing import NamedTuple

from .table import API_NAMES

SCHEMA = 1  # CONVGPU_SCHEMA in convgpu.h

OPS = {1: "alloc", 2: "free", 3: "ctx_create", 4: "ctx_destroy", 5: "map", 6: "unmap",
       7: "reserve", 8: "unreserve", 9: "set_device", 10: "meminfo", 11: "exit", 12: "exec",
       13: "failed", 14: "stall", 15: "over_limit", 16: "unknown", 17: "lib_open",
       18: "quota", 19: "full", 20: "graph", 21: "unsized", 22: "touch"}
EF_ESTIMATE, EF_UNKNOWN, EF_DEFERRED, EF_RESTALL, EF_UNRECORDED, EF_ORDINAL, EF_RESERVED = 0x1, 0x2, 0x4, 0x8, 0x10, 0x20, 0x40
EF_TRACED = 0x80   # killed, not stopped: traced by another process (result: its pid), bpf kill_unchecked


# struct cg_event, field by field: (name, struct code). The one Python copy of the C layout.
FIELDS = (("ts_ns", "Q"), ("cgroup_id", "Q"), ("addr", "Q"), ("size", "Q"), ("live", "Q"),
          ("tgid", "I"), ("tid", "I"), ("dev", "i"), ("result", "I"), ("api", "H"),
          ("rt_api", "H"), ("op", "B"), ("flags", "B"), ("pad", "2s"), ("comm", "16s"))


def layout() -> list[tuple[str, int, int]]:
    """(field, offset, size) as the C compiler lays out struct cg_event (packed by design)."""
    out, off = [], 0
    for name, code in FIELDS:
        size = struct.calcsize("<" + code)
        out.append((name, off, size))
        off += size
    return out


FORMAT = struct.Struct("<" + "".join(code for _, code in FIELDS))


class Event(NamedTuple):
    """A decoded event (a NamedTuple: the consumer builds ~10^5 of them a second)."""
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

    @property
    def restall(self) -> bool:
        """Enforce: the process ran again without a grant (a SIGCONT) and was stopped again."""
        return bool(self.flags & EF_RESTALL)

    def to_json(self, gpu_uuid: str = "") -> dict:
        """dev is the host GPU (probes/gpumap.py), gpu_uuid its NVML UUID where known."""
        d = self._asdict()
        d["type"] = "event"
        d["schema"] = SCHEMA
        d["gpu_uuid"] = gpu_uuid
        return d


def decode(raw: bytes) -> Event:
    """From the bytes of one record to an Event."""
    return _event(FORMAT.unpack_from(raw))


def decode_many(buf: bytes) -> list[Event]:
    """From concatenated records (what the tracer copies out of the ring buffer)."""
    return [_event(t) for t in FORMAT.iter_unpack(buf)]


def _event(t) -> Event:
    ts, cg, addr, size, live, tgid, tid, dev, result, api, rt, op, flags, _pad, comm = t
    return Event(ts, tgid, tid, comm.split(b"\0", 1)[0].decode(errors="replace"), cg,
                 OPS.get(op) or f"op{op}", API_NAMES.get(api) or f"api{api}",
                 API_NAMES.get(rt) if rt else None, dev, addr, size, live, result, flags)
