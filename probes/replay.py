"""A bcc BPF object rebuilt from a cached compile (probes/bpfcache.py), without clang.

Replayed is a bcc.BPF whose __init__ creates the maps (or opens the pinned ones, as bcc's
BPF_TABLE_PINNED does) instead of compiling, and whose load_func patches the maps'
descriptors into a function's instructions and loads it when it is first attached, as bcc does.
Everything else is bcc's own code working from descriptors: attach_uprobe/uretprobe/tracepoint,
detach, cleanup, the ring buffer and the Table classes (built here with the type, flags and
size bcc would have read from its module). What differs: maps and programs carry no BTF (bcc
adds it for `bpftool`'s pretty printing; the kernel does not need it for these programs), and a
pinned map whose layout differs from the program's is refused here (bcc loads over it and the
verifier or the accounting finds out later)."""
import atexit
import ctypes as ct
import errno
import json
import os
import struct

import bcc
from bcc import table as bcc_table
from bcc.libbcc import lib

from .. import phases
from . import links


BPF_MAP_CREATE, BPF_OBJ_PIN, BPF_OBJ_GET, BPF_OBJ_GET_INFO_BY_FD = 0, 6, 7, 15
SYS_BPF = 321   # x86_64
_libc = ct.CDLL(None, use_errno=True)
lib.bcc_create_map.restype = ct.c_int
lib.bcc_create_map.argtypes = [ct.c_int, ct.c_char_p, ct.c_int, ct.c_int, ct.c_int, ct.c_int]
lib.bcc_prog_load.restype = ct.c_int
lib.bcc_prog_load.argtypes = [ct.c_int, ct.c_char_p, ct.c_void_p, ct.c_int, ct.c_char_p, ct.c_uint,
                              ct.c_int, ct.c_char_p, ct.c_uint]
TABLES = {1: bcc_table.HashTable, 2: bcc_table.Array, 5: bcc_table.PerCpuHash, 6: bcc_table.PerCpuArray,
          9: bcc_table.LruHash, 10: bcc_table.LruPerCpuHash, 27: bcc_table.RingBuf}


class MapInfo(ct.Structure):   # the head of struct bpf_map_info
    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("key_size", ct.c_uint32),
                ("value_size", ct.c_uint32), ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32),
                ("name", ct.c_char * 16)]


def _sys_bpf(cmd: int, attr: bytes) -> int:
    buf = ct.create_string_buffer(attr, max(len(attr), 16))
    r = _libc.syscall(SYS_BPF, cmd, buf, len(buf))
    if r < 0:
        e = ct.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    _sys_bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", fd, ct.sizeof(info), ct.addressof(info)))
    return info


def obj_get(path: str) -> int | None:
    """A descriptor of the object pinned at path, or None where nothing is."""
    p = ct.create_string_buffer(path.encode())
    try:
        return _sys_bpf(BPF_OBJ_GET, struct.pack("<QII", ct.addressof(p), 0, 0))
    except FileNotFoundError:
        return None


def obj_pin(fd: int, path: str) -> None:
    p = ct.create_string_buffer(path.encode())
    _sys_bpf(BPF_OBJ_PIN, struct.pack("<QII", ct.addressof(p), fd, 0))


def pinned_at(path: str, map_id: int) -> bool:
    fd = obj_get(path)
    if fd is None:
        return False
    try:
        return map_info(fd).id == map_id
    finally:
        os.close(fd)


class Replayed(bcc.BPF):
    """bcc.BPF over a cached compile: spec from bpfcache.capture(); pin_dir: where this
    start's pinned maps live (None: nothing is pinned)."""

    def __init__(self, spec: dict, pin_dir: str | None = None):
        # bcc.BPF.__init__'s state, less the module (bcc's Table and close() accept None)
        self.kprobe_fds, self.uprobe_fds, self.tracepoint_fds, self.raw_tracepoint_fds = {}, {}, {}, {}
        self.kfunc_entry_fds, self.kfunc_exit_fds, self.lsm_fds = {}, {}, {}
        self.perf_buffers, self.open_perf_events = {}, {}
        self._ringbuf_manager = None
        self.tracefile = None
        self.debug = 0
        self.funcs, self.tables = {}, {}
        self.module = None
        self.spec = spec
        self.map_fds: dict[str, int] = {}
        atexit.register(self.cleanup)
        try:
            for name, m in spec["maps"].items():
                self.map_fds[name] = self._open_map(name, m, pin_dir)
            self._trace_autoload()
        except BaseException:
            self.cleanup()
            raise

    def _open_map(self, name: str, m: dict, pin_dir: str | None) -> int:
        path = os.path.join(pin_dir, name) if m["pinned"] and pin_dir else None
        fd = obj_get(path) if path else None
        if fd is not None:   # left by an enforcer before us (enforcer/failsafe/takeover.py)
            info = map_info(fd)
            want = (m["type"], m["key_size"], m["leaf_size"], m["max_entries"])
            if (info.type, info.key_size, info.value_size, info.max_entries) != want:
                os.close(fd)
                raise Exception(f"pinned map {path} has another layout than the program's")
            return fd
        fd = lib.bcc_create_map(m["type"], name.encode(), m["key_size"], m["leaf_size"], m["max_entries"],
                                m["flags"])
        if fd < 0:
            raise Exception(f"could not create BPF map {name}: {os.strerror(ct.get_errno())}")
        if path:
            try:
                os.makedirs(pin_dir, mode=0o700, exist_ok=True)
                obj_pin(fd, path)
            except OSError as e:
                os.close(fd)
                raise Exception(f"could not pin BPF map {name} at {path}: {e.strerror}") from None
        return fd

    def _trace_autoload(self):
        for name in self.spec["functions"]:
            if name.startswith("tracepoint__"):
                fn = self.load_func(name.encode(), bcc.BPF.TRACEPOINT)
                with phases.timed("tracepoints"):   # perf_event_open waits for the event_mutex
                    self.attach_tracepoint(tp=fn.name[len(b"tracepoint__"):].replace(b"__", b":"), fn_name=fn.name)

    def load_func(self, func_name, prog_type, device=None, attach_type=-1):
        func_name = func_name if isinstance(func_name, bytes) else func_name.encode()
        if func_name in self.funcs:
            return self.funcs[func_name]
        f = self.spec["functions"].get(func_name.decode())
        if f is None:
            raise Exception(f"Unknown program {func_name}")
        insns = bytearray(f["insns"])
        for index, name in f["maps"]:
            struct.pack_into("<i", insns, index * 8 + 4, self.map_fds[name])
        code = (ct.c_ubyte * len(insns)).from_buffer(insns)
        license = self.spec["license"].encode()
        if attach_type == -1:
            fd = lib.bcc_prog_load(prog_type, func_name, code, len(insns), license, self.spec["kern_version"],
                                   0, None, 0)
        else:   # bcc_prog_load has no expected_attach_type (probes/links.py needs it)
            fd = links.prog_load(prog_type, func_name, code, len(insns) // 8, license, self.spec["kern_version"],
                                 attach_type)
        if fd < 0:
            err = ct.get_errno()
            if err == errno.EPERM:
                raise Exception("Need super-user privileges to run")
            raise Exception(f"Failed to load BPF program {func_name}: {os.strerror(err)}")
        fn = bcc.BPF.Function(self, func_name, fd)
        self.funcs[func_name] = fn
        return fn

    def preload(self, names, prog_type, attach_type=-1) -> None:
        """Load these functions at once, from a thread each (up to the CPUs): the verifier
        takes a program at a time per thread and ~0.25 s for the ~55 programs of an enforcer on
        this machine's CPU, most of a warm start's attach; each load is one bpf() syscall (no
        lock of ours or Python's is held in it). A load that fails here is left for the attach
        that needs it to fail and say so."""
        from concurrent.futures import ThreadPoolExecutor
        todo = [n for n in dict.fromkeys(names) if n.encode() not in self.funcs and n in self.spec["functions"]]

        def one(name):
            try:
                self.load_func(name.encode(), prog_type, attach_type=attach_type)
            except Exception:   # bcc's load failure is a bare Exception
                pass
        if len(todo) > 1:
            with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as ex:
                list(ex.map(one, todo))

    def get_table(self, name, keytype=None, leaftype=None, reducer=None):
        name = name if isinstance(name, bytes) else name.encode()
        m = self.spec["maps"].get(name.decode())
        if m is None:
            raise KeyError(name)
        cls = TABLES.get(m["type"])
        if cls is None:
            raise Exception(f"BPF table {name} of type {m['type']} is not replayed")
        keytype = keytype or bcc.BPF._decode_table_type(json.loads(m["key_desc"]))
        leaftype = leaftype or bcc.BPF._decode_table_type(json.loads(m["leaf_desc"]))
        map_id = list(self.spec["maps"]).index(name.decode())
        kw = {"reducer": reducer} if cls in (bcc_table.PerCpuHash, bcc_table.PerCpuArray) else {}
        args = (name,) if cls is bcc_table.RingBuf else ()
        t = cls(self, map_id, self.map_fds[name.decode()], keytype, leaftype, *args, **kw)
        # what TableBase.__init__ reads from bcc's module, which a replay has not
        t.ttype, t.flags, t.max_entries = m["type"], m["flags"], m["max_entries"]
        return t

    def dump_func(self, func_name):
        func_name = func_name if isinstance(func_name, bytes) else func_name.encode()
        return bytes(self.spec["functions"][func_name.decode()]["insns"])

    def close(self):
        super().close()
        for fd in self.map_fds.values():
            os.close(fd)
        self.map_fds.clear()
