"""Decoding recorded ring-buffer bytes. The bytes are packed here by hand from the C layout
in bpf/convgpu.h, independently of the ctypes mirror they test."""
import struct

from convgpu.probes.events import FORMAT, decode, decode_many
from convgpu.probes.table import API_IDS

FMT = "<QQQQQIIiIHHBB2x16s"   # struct cg_event, 80 bytes


def record(**kw):
    f = dict(ts=1, cg=2, addr=0x7F0000001000, size=128 << 20, live=256 << 20, tgid=4242, tid=4243,
             dev=0, result=0, api=API_IDS["cuMemAlloc_v2"], rt=API_IDS["cudaMalloc"], op=1, flags=0,
             comm=b"python3")
    f.update(kw)
    return struct.pack(FMT, f["ts"], f["cg"], f["addr"], f["size"], f["live"], f["tgid"], f["tid"],
                       f["dev"], f["result"], f["api"], f["rt"], f["op"], f["flags"], f["comm"])


def test_size_matches_c_layout():
    assert struct.calcsize(FMT) == 80 == FORMAT.size


def test_decode_alloc():
    e = decode(record())
    assert (e.pid, e.tid, e.comm, e.op, e.api, e.rt_api) == (4242, 4243, "python3", "alloc", "cuMemAlloc_v2", "cudaMalloc")
    assert (e.addr, e.size, e.live, e.dev, e.cgroup_id) == (0x7F0000001000, 128 << 20, 256 << 20, 0, 2)
    assert not (e.estimate or e.unknown or e.deferred)


def test_decode_flags_failed_and_no_runtime():
    e = decode(record(op=13, result=2, rt=0, flags=0x1 | 0x2, api=API_IDS["cuMemCreate"], dev=-1))
    assert (e.op, e.result, e.rt_api, e.api, e.dev) == ("failed", 2, None, "cuMemCreate", -1)
    assert e.estimate and e.unknown and not e.deferred


def test_decode_exit_and_json():
    e = decode(record(op=11, api=API_IDS["sched_process_exit"], addr=99, size=3 << 20))
    j = e.to_json()
    assert (j["type"], j["schema"], j["op"], j["api"], j["size"], j["addr"]) == ("event", 1, "exit", "sched_process_exit", 3 << 20, 99)


def test_decode_many_in_order():
    evs = decode_many(record(tgid=1) + record(tgid=2, op=2) + record(tgid=3, comm=b"a" * 16))
    assert [(e.pid, e.op) for e in evs] == [(1, "alloc"), (2, "free"), (3, "alloc")]
    assert evs[2].comm == "a" * 16
