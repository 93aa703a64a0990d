"""A cache of bcc's compile of bpf/convgpu.bpf.c, replayed at the next start.

bcc 0.26 compiles the C at every start (clang in-process) and cannot load an object file: the
compile took 3.5-4.8 s of an enforcer's 4.4-6.7 s start on the 2-vCPU CPU machine and ~4 s of
4.7 s on the H100 (docs/BENCHMARKS.md). What the compile produces is small and plain, though:
per function its BPF instructions, whose 64-bit loads of a map (ld_imm64, src_reg
BPF_PSEUDO_MAP_FD) carry that map's file descriptor, and per map its kernel parameters and the
type descriptions bcc turns into ctypes. This module records them after a compile (capture)
and stores them under a key of everything the compile depends on; probes/replay.py creates the
maps again, patches their new descriptors into the loads and gives the tracer the same bcc
object it gets from a compile.

Per-start values (the enforcer's pid, its owner number) are in the `config` map, not in the
code (struct cg_config), and the pin directory of the enforcer's maps is applied at replay:
one cached compile serves every start on a host. What stays compiled in is in the key: the
bytes of every .c and .h beside the source (the top file, the parts it includes, the
header: an edit to any of them is a new key), the remaining cflags (ring buffer size, the
kernel's tracepoint features), the kernel (release and build), its headers and bcc's version.

The cache is only ever read from a root-owned directory that nobody else can write (what it
holds is loaded into the kernel as root), and each file carries a checksum of its content:
a file that does not verify is not used (a compile replaces it)."""
import base64
import hashlib
import json
import logging
import os
import struct
import tempfile

log = logging.getLogger(__name__)
FORMAT = 1                               # of the files; part of the key
DEFAULT_DIR = "/var/cache/convgpu/bpf"
ENV = "CONVGPU_BPF_CACHE"                # a directory, or "off": always compile
OFF = ("off", "0", "no", "false")
PIN_FLAG = "-DPIN_DIR="
LD_IMM64, PSEUDO_MAP_FD, CALL = 0x18, 1, 0x85
# bcc attaches functions with these prefixes itself at load (BPF._trace_autoload); replay does
# the same for tracepoints, the only kind bpf/convgpu.bpf.c has
AUTOLOAD = (b"kprobe__", b"kretprobe__", b"raw_tracepoint__", b"kfunc__", b"kretfunc__", b"lsm__")


class Uncacheable(Exception):
    """A compiled program replay cannot reproduce (it is then simply not cached)."""


def cache_dir(explicit: str | None = None) -> str | None:
    """Where compiled programs are kept, or None: off (--no-bpf-cache, CONVGPU_BPF_CACHE=off)."""
    d = explicit if explicit is not None else os.environ.get(ENV, DEFAULT_DIR)
    return None if not d or d.lower() in OFF else d


def split_flags(cflags: list[str]) -> tuple[list[str], str | None]:
    """(the flags that shape the compiled code, the pin directory): where maps are pinned is
    not in the code (bcc opens or pins them at load), so replay applies the one of this start."""
    pin_dir = None
    stable = []
    for f in cflags:
        if f.startswith(PIN_FLAG):
            pin_dir = f[len(PIN_FLAG):].strip('"')
            stable.append(PIN_FLAG + "<per start>")
        else:
            stable.append(f)
    return stable, pin_dir


def _bcc_version() -> str:
    try:
        from bcc.version import __version__
        return __version__
    except ImportError:
        return "none"


def material(src_file: str, cflags: list[str]) -> dict:
    """Everything the compiled program depends on: every C file and header in src_file's
    directory, whether it includes them or not (bpf/__init__.py source_text)."""
    stable, _ = split_flags(cflags)
    src_dir = os.path.dirname(os.path.abspath(src_file))
    files = {}
    for name in sorted(os.listdir(src_dir)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(src_dir, name), "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
    un = os.uname()
    headers = os.path.realpath(f"/lib/modules/{un.release}/build")
    return {"format": FORMAT, "source": os.path.basename(src_file), "files": files, "cflags": stable,
            "kernel": f"{un.release} {un.version} {un.machine}", "headers": headers, "bcc": _bcc_version()}


def key_of(mat: dict) -> str:
    return hashlib.sha256(json.dumps(mat, sort_keys=True).encode()).hexdigest()[:32]


def path_of(directory: str, mat: dict) -> str:
    return os.path.join(directory, f"{key_of(mat)}.json")


def _safe(path: str) -> bool:
    """Owned by us (root) and writable by nobody else, the file and its directory."""
    for p in (os.path.dirname(path), path):
        st = os.stat(p)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            log.warning("BPF cache %s is not ours alone (uid %d, mode %o): not used", p, st.st_uid,
                        st.st_mode & 0o777)
            return False
    return True


def _checksum(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def load(directory: str, mat: dict) -> dict | None:
    """The program cached for `mat`, or None (cold; a bad file is reported and ignored)."""
    path = path_of(directory, mat)
    try:
        if not _safe(path):
            return None
        with open(path) as f:
            doc = json.load(f)
        spec = doc["program"]
        if doc["material"] != mat or doc["checksum"] != _checksum(spec):
            raise ValueError("its key or checksum does not match its content")
        for fn in spec["functions"].values():
            fn["insns"] = base64.b64decode(fn["insns"])
        return spec
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("BPF cache %s is unusable (%s): compiling", path, e)
        return None


def save(directory: str, mat: dict, spec: dict) -> str | None:
    """Write atomically (a reader sees the old file or the whole new one); returns the path."""
    stored = dict(spec, functions={n: dict(f, insns=base64.b64encode(f["insns"]).decode())
                                   for n, f in spec["functions"].items()})
    doc = {"material": mat, "checksum": _checksum(stored), "program": stored}
    path = path_of(directory, mat)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        return path
    except OSError as e:
        log.warning("cannot write the BPF cache in %s (%s): the next start compiles again", directory, e)
        return None


def state(directory: str | None, mat: dict) -> tuple[str, str]:
    """For `convgpu doctor`: ("off" | "warm" | "cold", detail)."""
    if directory is None:
        return "off", f"{ENV}=off: every start compiles"
    path = path_of(directory, mat)
    if os.path.exists(path):
        return ("warm", path) if load(directory, mat) is not None else ("cold", f"{path} is unusable")
    return "cold", f"{path} absent: the next start compiles and writes it"


def capture(b, lib, pin_dir: str | None) -> dict:
    """What replay needs from bcc BPF object b, just compiled (lib: bcc's libbcc handle)."""
    import ctypes as ct
    _bind(lib)
    m = b.module
    maps, by_fd = {}, {}
    for i in range(lib.bpf_num_tables(m)):
        name = lib.bpf_table_name(m, i)
        fd = lib.bpf_table_fd_id(m, i)
        key_desc, leaf_desc = lib.bpf_table_key_desc(m, name), lib.bpf_table_leaf_desc(m, name)
        spec = {"type": lib.bpf_table_type_id(m, i), "flags": lib.bpf_table_flags_id(m, i),
                "max_entries": lib.bpf_table_max_entries_id(m, i),
                "key_size": lib.bpf_table_key_size_id(m, i), "leaf_size": lib.bpf_table_leaf_size_id(m, i),
                "key_desc": key_desc.decode() if key_desc else "", "leaf_desc": leaf_desc.decode() if leaf_desc else "",
                "pinned": False}
        from .replay import map_info, pinned_at
        info = map_info(fd)
        if (info.type, info.key_size, info.value_size, info.max_entries) != \
                (spec["type"], spec["key_size"], spec["leaf_size"], spec["max_entries"]):
            raise Uncacheable(f"map {name.decode()}: the kernel's parameters differ from bcc's")
        if pin_dir and pinned_at(os.path.join(pin_dir, name.decode()), info.id):
            spec["pinned"] = True
        maps[name.decode()] = spec
        by_fd[fd] = name.decode()
    functions = {}
    for i in range(lib.bpf_num_functions(m)):
        name = lib.bpf_function_name(m, i)
        if name.startswith(AUTOLOAD):
            raise Uncacheable(f"{name.decode()}: bcc attaches it at load, and replay only does so for tracepoints")
        size = lib.bpf_function_size(m, name)
        insns = ct.string_at(lib.bpf_function_start(m, name), size)
        functions[name.decode()] = {"insns": insns, "maps": _relocations(name, insns, by_fd)}
    return {"license": lib.bpf_module_license(m).decode(), "kern_version": lib.bpf_module_kern_version(m),
            "maps": maps, "functions": functions}


def _relocations(name: bytes, insns: bytes, by_fd: dict[int, str]) -> list[list]:
    """[[instruction index, map name]] for every load of a map's descriptor."""
    out = []
    for i in range(0, len(insns), 8):
        op, regs, _off, imm = struct.unpack_from("<BBhi", insns, i)
        src = regs >> 4
        if op == LD_IMM64 and src:
            if src != PSEUDO_MAP_FD or imm not in by_fd:
                raise Uncacheable(f"{name.decode()}: a 64-bit load of kind {src} replay cannot patch")
            out.append([i // 8, by_fd[imm]])
        elif op == CALL and src:
            raise Uncacheable(f"{name.decode()}: a BPF-to-BPF call (its callee is not in the function)")
    return out


def _bind(lib) -> None:
    """libbcc functions bcc's Python part does not declare."""
    import ctypes as ct
    lib.bpf_num_tables.restype, lib.bpf_num_tables.argtypes = ct.c_ulonglong, [ct.c_void_p]
    lib.bpf_table_name.restype, lib.bpf_table_name.argtypes = ct.c_char_p, [ct.c_void_p, ct.c_ulonglong]
    lib.bpf_table_fd_id.restype, lib.bpf_table_fd_id.argtypes = ct.c_int, [ct.c_void_p, ct.c_ulonglong]
    for f in (lib.bpf_table_key_size_id, lib.bpf_table_leaf_size_id):
        f.restype, f.argtypes = ct.c_size_t, [ct.c_void_p, ct.c_ulonglong]
