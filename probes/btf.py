"""Where the running kernel keeps a task's tracer: offsets of `ptrace`, `parent` and `tgid` in
its `struct task_struct`, read from the kernel's own BTF (/sys/kernel/btf/vmlinux, a file of the
kernel, not of any container). BPF reads them from the current task on its way to a stop
(bpf/holds.bpf.c, foreign_tracer): a thread traced by a process other than convgpu can have
its SIGSTOP swallowed by that tracer (issue 33, attack 2: a 40-line PTRACE_SEIZE loop dropped
30 stops and took 2,048 MiB under 256 MiB), so where such a stop is the last check before the
call's body, BPF kills instead. Kernel headers cannot give these offsets: the ones bcc compiles
with are generic, not the running kernel's (FACTS.md).

BTF layout (Documentation/bpf/btf.rst): a header, then type records of 12 bytes
(name_off, info, size|type), each followed by kind-specific data; a member of a struct is
(name_off, type, offset), the offset in bits, its low 24 bits where the kind_flag is set."""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)

VMLINUX = "/sys/kernel/btf/vmlinux"
MAGIC = 0xEB9F
STRUCT = 4
# bytes after the 12-byte record, per kind: fixed, or per vlen entry
_FIXED = {1: 4, 3: 12, 14: 4, 17: 4}            # INT, ARRAY, VAR, DECL_TAG
_PER_VLEN = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}   # STRUCT, UNION, ENUM, FUNC_PROTO, DATASEC, ENUM64
WANT = ("ptrace", "parent", "tgid")


@dataclass(frozen=True)
class TaskOffsets:
    ptrace: int = 0
    parent: int = 0
    tgid: int = 0

    @property
    def known(self) -> bool:
        return bool(self.ptrace and self.parent and self.tgid)


def task_offsets(path: str = VMLINUX) -> TaskOffsets:
    """The offsets, or TaskOffsets() (unknown) where the kernel has no BTF or it does not parse:
    then BPF sees no tracer, and a log line says what that leaves open."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return parse(data)
    except (OSError, ValueError, struct.error) as e:
        log.warning("cannot read task_struct from the kernel's BTF (%s): a thread traced by another "
                    "process can swallow its stop unseen (docs/SECURITY.md, attack 2)", e)
        return TaskOffsets()


def parse(data: bytes) -> TaskOffsets:
    return TaskOffsets(**members(data, {"task_struct": WANT})["task_struct"])


def members(data: bytes, want: dict[str, tuple[str, ...]]) -> dict[str, dict[str, int]]:
    """Byte offsets of the wanted members of the wanted structs ({struct: (member, ...)}), read
    in one walk of the types; ValueError if one is missing. (probes/nodes.py: the path from a
    task to the device number of one of its open files.)"""
    magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data, 0)
    if magic != MAGIC:
        raise ValueError(f"BTF magic {magic:#x}")
    types = memoryview(data)[hdr_len + type_off:hdr_len + type_off + type_len]
    strs = data[hdr_len + str_off:hdr_len + str_off + str_len]
    names = {strs.find(b"\0" + s.encode() + b"\0") + 1: s for s in want}
    out: dict[str, dict[str, int]] = {}

    def text(off: int) -> str:
        return strs[off:strs.index(b"\0", off)].decode("ascii", "replace")

    pos = 0
    while pos + 12 <= len(types) and len(out) < len(want):
        name_off, info, _size = struct.unpack_from("<III", types, pos)
        pos += 12
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        s = names.get(name_off) if kind == STRUCT else None
        if s is not None and s not in out:
            got = {}
            for i in range(vlen):
                m_name, _m_type, m_off = struct.unpack_from("<III", types, pos + 12 * i)
                if text(m_name) in want[s]:
                    got[text(m_name)] = ((m_off & 0xFFFFFF) if kflag else m_off) // 8
            if len(got) == len(want[s]):    # (a forward-declared twin has no members)
                out[s] = got
        pos += _FIXED.get(kind, 0) + _PER_VLEN.get(kind, 0) * vlen
    if len(out) < len(want):
        raise ValueError(f"no struct {', '.join(sorted(set(want) - set(out)))} with those members")
    return out
