"""The cache of compiled BPF programs (probes/bpfcache.py, probes/replay.py) on the real kernel:
a replayed bpf/convgpu.bpf.c has the maps, types, code and behaviour of a compiled one; its
pinned maps are the enforcer's; a cache of another source, flags or header is not used, and a
bad one is replaced by a compile. Root, bcc, the stand-in driver; no GPU."""
import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from conftest import MiB, usage_of

pytestmark = pytest.mark.system

TINY = r"""
#include <uapi/linux/ptrace.h>
#include "tiny.h"
BPF_HASH(counts, u32, struct tiny_val, 64);
BPF_RINGBUF_OUTPUT(out, 1);
#ifdef PIN_DIR
BPF_TABLE_PINNED("hash", u32, u64, kept, 16, PIN_DIR "/kept");
#endif
int enter_init(struct pt_regs *ctx)
{
    u32 k = bpf_get_current_pid_tgid() >> 32;
    struct tiny_val z = {};
    struct tiny_val *v = counts.lookup_or_try_init(&k, &z);
    if (v)
        v->n += STEP;
    return 0;
}
#include "tiny_exec.bpf.c"
"""
# A part the program includes (bpf/__init__.py source_text): its map call and its program load
TINY_PART = """
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 k = bpf_get_current_pid_tgid() >> 32;
    counts.delete(&k);
    return 0;
}
"""
TINY_H = "struct tiny_val { unsigned long long n; unsigned int pad[2]; };\n"


@pytest.fixture
def tiny(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.bpf.c").write_text(TINY)
    (src / "tiny_exec.bpf.c").write_text(TINY_PART)
    (src / "tiny.h").write_text(TINY_H)
    cache = tmp_path / "cache"
    return src, str(cache)


def load(src, cache, step=1, extra=()):
    import bcc
    from convgpu.probes.loader import load_program
    return load_program(bcc, str(src / "tiny.bpf.c"), [f"-I{src}", f"-DSTEP={step}", *extra], cache)


def calls_counted(b, lib, n: int) -> int:
    """n calls of the stand-in's cuInit from a child; what enter_init counted for it."""
    b.attach_uprobe(name=str(lib).encode(), sym=b"cuInit", fn_name=b"enter_init")
    child = subprocess.run([sys.executable, "-c", f"import ctypes,os; l=ctypes.CDLL({str(lib)!r});"
                            f"[l.cuInit(0) for _ in range({n})]; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    t = b[b"counts"]
    return t[t.Key(int(child.stdout))].n


def test_tiny_program_replays_with_the_same_behaviour(root, build, tiny):
    src, cache = tiny
    lib = build / "standin" / "libcuda.so.1"
    first = load(src, cache, step=3)
    assert first.origin[0] == "compiled" and len(os.listdir(cache)) == 1
    again = load(src, cache, step=3)
    assert again.origin[0] == "replayed"
    try:
        assert calls_counted(first, lib, 7) == 21
        assert calls_counted(again, lib, 5) == 15   # its own map: the child's pid is new
        # bcc's tables, built without its module: same class, type, size and key/leaf types
        for name in (b"counts", b"out"):
            a, b = first[name], again[name]
            assert (type(a), a.ttype, a.flags, a.max_entries) == (type(b), b.ttype, b.flags, b.max_entries)
        assert ctypes.sizeof(again[b"counts"].Leaf) == 16
        assert [f[0] for f in again[b"counts"].Leaf._fields_] == ["n", "pad"]
        assert again.tracepoint_fds and list(again.tracepoint_fds) == list(first.tracepoint_fds)
    finally:
        first.cleanup()
        again.cleanup()


@pytest.mark.parametrize("change", ["source", "part", "header", "flags"])
def test_a_cache_of_another_source_or_flags_is_not_used(root, tiny, change):
    src, cache = tiny
    load(src, cache).cleanup()
    if change == "source":
        (src / "tiny.bpf.c").write_text(TINY.replace("v->n += STEP;", "v->n += STEP + 1;"))
    elif change == "part":
        (src / "tiny_exec.bpf.c").write_text(TINY_PART.replace("return 0;", "return 1;"))
    elif change == "header":
        (src / "tiny.h").write_text(TINY_H.replace("pad[2]", "pad[4]"))
    b = load(src, cache, step=2 if change == "flags" else 1)
    try:
        assert b.origin[0] == "compiled" and len(os.listdir(cache)) == 2
        if change == "header":
            assert ctypes.sizeof(b[b"counts"].Leaf) == 24
    finally:
        b.cleanup()


def _only_file(cache):
    (name,) = os.listdir(cache)
    return os.path.join(cache, name)


@pytest.mark.parametrize("damage", ["truncated", "instruction", "material", "writable"])
def test_a_bad_cache_falls_back_to_a_compile_with_a_warning(root, tiny, caplog, damage):
    src, cache = tiny
    load(src, cache).cleanup()
    path = _only_file(cache)
    text = open(path).read()
    if damage == "truncated":
        open(path, "w").write(text[:len(text) // 2])
    elif damage == "instruction":   # a valid file whose code is not what was written
        doc = json.loads(text)
        fn = doc["program"]["functions"]["enter_init"]
        fn["insns"] = ("B" if fn["insns"][0] != "B" else "C") + fn["insns"][1:]
        open(path, "w").write(json.dumps(doc))
    elif damage == "material":     # written for another kernel, under this key
        doc = json.loads(text)
        doc["material"]["kernel"] = "0.0.0 other"
        open(path, "w").write(json.dumps(doc))
    else:
        os.chmod(path, 0o666)
    with caplog.at_level(logging.WARNING, logger="convgpu.probes.bpfcache"):
        b = load(src, cache)
    b.cleanup()
    assert b.origin[0] == "compiled"
    assert any(path in r.getMessage() for r in caplog.records), caplog.text
    if damage != "writable":   # the compile wrote a good one again
        again = load(src, cache)
        again.cleanup()
        assert again.origin[0] == "replayed"


def test_cache_off_compiles_and_writes_nothing(root, tiny):
    src, cache = tiny
    for _ in range(2):
        b = load(src, None)
        b.cleanup()
        assert b.origin[0] == "compiled"
    assert not os.path.exists(cache)


# --- the real program ---

@pytest.fixture(scope="module")
def pair(root):
    """A compiled and a replayed bpf/convgpu.bpf.c, side by side."""
    from convgpu.probes import loader
    compiled = loader.compile_program(cache="off", owner=11)
    replayed = loader.compile_program(owner=12)          # the session's cache (conftest)
    if replayed.origin[0] != "replayed":                  # it was cold: this compile filled it
        replayed.cleanup()
        replayed = loader.compile_program(owner=12)
    yield compiled, replayed
    compiled.cleanup()
    replayed.cleanup()


def _layout(t):
    if not hasattr(t, "_fields_"):
        return (t.__name__, ctypes.sizeof(t))
    return [(name, getattr(t, name).offset, _layout(typ)) for name, typ, *_ in t._fields_]


def test_replayed_program_has_the_compiled_maps_types_and_code(pair):
    from bcc.libbcc import lib
    from convgpu.probes import bpfcache
    from convgpu.probes.replay import Replayed, map_info
    compiled, replayed = pair
    assert replayed.origin[0] == "replayed" and isinstance(replayed, Replayed)
    bpfcache._bind(lib)
    names = [lib.bpf_table_name(compiled.module, i) for i in range(lib.bpf_num_tables(compiled.module))]
    assert [n.decode() for n in names] == list(replayed.spec["maps"])
    # quotas, swept, shim_calls (issue 24), gpumap (25), gone (23), exec_gen, checked, nodecfg and
    # mapping (issue 33: a driver recognised by the GPU nodes it opens and the code it maps), resident
    # (issue 39: what a stack byte costs per GPU), curctx (issue 47: each thread's current contexts)
    # included
    assert len(names) == 30 and b"resident" in names and b"curctx" in names and b"swapped" in names
    for n in names:
        a, b = compiled[n], replayed[n]
        ka, kb = map_info(a.map_fd), map_info(b.map_fd)
        assert (ka.type, ka.key_size, ka.value_size, ka.max_entries, ka.map_flags) == \
               (kb.type, kb.key_size, kb.value_size, kb.max_entries, kb.map_flags), n
        assert (type(a), a.ttype, a.flags, a.max_entries) == (type(b), b.ttype, b.flags, b.max_entries), n
        assert _layout(a.Key) == _layout(b.Key) and _layout(a.Leaf) == _layout(b.Leaf), n
        assert ka.id != kb.id   # two programs, two sets of maps
    fd_name = {compiled[n].map_fd: n.decode() for n in names}
    for i in range(lib.bpf_num_functions(compiled.module)):
        fn = lib.bpf_function_name(compiled.module, i)
        code = compiled.dump_func(fn)
        spec = replayed.spec["functions"][fn.decode()]
        # the same instructions once each map load names its map instead of its descriptor
        assert bpfcache._relocations(fn, code, fd_name) == spec["maps"]
        assert _without_fds(code, spec["maps"]) == _without_fds(spec["insns"], spec["maps"])
    assert len(replayed.spec["functions"]) == lib.bpf_num_functions(compiled.module)
    # the per-start values are in each program's own config map
    assert (compiled[b"config"][0].self_tgid, compiled[b"config"][0].owner) == (os.getpid(), 11)
    assert (replayed[b"config"][0].self_tgid, replayed[b"config"][0].owner) == (os.getpid(), 12)


def _without_fds(code: bytes, relocs) -> bytes:
    out = bytearray(code)
    for index, _ in relocs:
        out[index * 8 + 4:index * 8 + 8] = b"\0\0\0\0"
    return bytes(out)


def test_replayed_tracer_counts_exactly_like_a_compiled_one(root, build, run_caller):
    from convgpu.probes import loader
    from convgpu.probes.tracer import Tracer
    lib = str(build / "standin" / "libcuda.so.1")
    loader.compile_program().cleanup()   # the session's cache holds it, also where no test before filled it
    tracers = {how: Tracer(libraries=(lib,), discover=False, bpf_cache=cache).start()
               for how, cache in (("compiled", "off"), ("replayed", None))}
    try:
        assert {how: t.b.origin[0] for how, t in tracers.items()} == {"compiled": "compiled", "replayed": "replayed"}
        for t in tracers.values():
            driver = t.attached[0]
            assert all(a.ok and a.fired for a in driver.probes), [a.probe.symbol for a in driver.probes if not a.fired]
        c = run_caller("alloc", "-n", 23, "-s", 3 * MiB)
        rows = {how: usage_of(t, c.pid) for how, t in tracers.items()}
        for u in rows.values():
            assert list(u) == [0]
            assert (u[0].live, u[0].n_alloc, u[0].n_free, u[0].contexts, u[0].peak) == \
                   (23 * 4 * MiB, 23, 0, 1, 23 * 4 * MiB)
        assert c.release() == 0
        for t in tracers.values():
            t.poll()
            assert usage_of(t, c.pid) == {}
    finally:
        for t in tracers.values():
            t.close(background=True)


@pytest.fixture
def pin_dir(root):
    from convgpu.enforcer.failsafe import takeover
    assert takeover.ensure_bpffs()
    d = f"{takeover.BPFFS}/convgpu-test-cache-{os.getpid()}"
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d, mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


STATE = {"threads", "curctx", "procs", "usage", "objs", "members", "assign", "cgstate", "control", "quotas", "swept",
         "gpumap", "gone"}


def test_replay_pins_the_state_maps_and_a_second_start_continues_on_them(pin_dir):
    from convgpu.probes import loader
    from convgpu.probes.replay import map_info
    flags = (f'-DPIN_DIR="{pin_dir}"',)
    first = loader.compile_program(extra=flags, owner=1)
    if first.origin[0] != "replayed":
        first.cleanup()
        shutil.rmtree(pin_dir)
        os.makedirs(pin_dir, mode=0o700)
        first = loader.compile_program(extra=flags, owner=1)
    second = loader.compile_program(extra=flags, owner=2, self_tgid=1)
    try:
        assert first.origin[0] == second.origin[0] == "replayed"
        assert set(os.listdir(pin_dir)) == STATE
        assert {n for n, m in first.spec["maps"].items() if m["pinned"]} == STATE
        for n in STATE:   # the same kernel maps: the accounting continues
            assert map_info(first[n.encode()].map_fd).id == map_info(second[n.encode()].map_fd).id
        for n in ("config", "held", "events"):   # per program
            assert map_info(first[n.encode()].map_fd).id != map_info(second[n.encode()].map_fd).id
        t = first[b"members"]
        t[t.Key(4242)] = t.Leaf(7)
        assert second[b"members"][second[b"members"].Key(4242)].value == 7
        assert (second[b"config"][0].owner, second[b"config"][0].self_tgid) == (2, 1)
        assert first[b"config"][0].owner == 1
    finally:
        first.cleanup()
        second.cleanup()


def test_pinned_map_of_another_layout_is_refused(pin_dir):
    from bcc.libbcc import lib
    from convgpu.probes import loader
    from convgpu.probes.replay import obj_pin
    flags = (f'-DPIN_DIR="{pin_dir}"',)
    loader.compile_program(extra=flags).cleanup()   # warm (replayed or compiled and cached)
    shutil.rmtree(pin_dir)
    os.makedirs(pin_dir, mode=0o700)
    fd = lib.bcc_create_map(2, b"control", 4, 16, 1, 0)   # an older, smaller cg_control
    assert fd >= 0
    obj_pin(fd, f"{pin_dir}/control")
    os.close(fd)
    with pytest.raises(Exception, match="another layout"):
        loader.compile_program(extra=flags)


def _doctor_line(out: str, check: str) -> str:
    """The check's line, its mark padded as a column: "ok   NAME  detail" (cli/doctor.py report)."""
    line = next(line for line in out.splitlines() if line[5:].startswith(check + " "))
    return f" {line[:4].strip()} {line[5:]}"


def test_doctor_says_whether_the_cache_is_warm_and_fills_it(root, tmp_path):
    env = dict(os.environ, CONVGPU_BPF_CACHE=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-m", "convgpu.cli.main", "doctor"], capture_output=True, text=True,
                           timeout=300, env=env) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stdout + r.stderr
    for what in ("enforce", "trace"):
        assert " warn " in _doctor_line(runs[0].stdout, f"BPF cache ({what})")
        assert "cold" in _doctor_line(runs[0].stdout, f"BPF cache ({what})")
        assert " ok " in _doctor_line(runs[1].stdout, f"BPF cache ({what})")
    assert "compiled" in _doctor_line(runs[0].stdout, "BPF compile+load")
    assert "replayed" in _doctor_line(runs[1].stdout, "BPF compile+load")
    assert len(os.listdir(tmp_path / "cache")) == 2   # the enforcer's (pinned) and the tracer's
    assert not [d for d in os.listdir("/sys/fs/bpf") if d.startswith("convgpu-doctor-")]


@pytest.mark.parametrize("cmd,modes", [("enforce", "warm,cold"), ("trace", "warm")])
def test_startup_benchmark_shape(root, build, tmp_path, cmd, modes):
    """bench.startup in a small configuration: warm starts replayed, cold ones compiled, and
    each start's phases were read (numbers: docs only). The warm starts use the session's cache:
    its unmeasured first start then replays what an earlier test compiled (a compile less)."""
    from bench import startup
    out = tmp_path / "startup.json"
    extra = ["--no-discover", "--lib", str(build / "standin" / "libcuda.so.1")]
    extra += ["--gpu-memory", "4GiB"] if cmd == "enforce" else ["--duration", "60"]
    assert startup.main(["--command", cmd, "--n", "2", "--modes", modes, "--json", str(out),
                         "--warm-cache", os.environ["CONVGPU_BPF_CACHE"], "--", *extra]) == 0
    d = json.loads(out.read_text())
    for m in modes.split(","):
        s = d[m]
        assert s["n"] == len(s["samples_s"]) == 2 and s["min_s"] <= s["p50_s"] <= s["max_s"]
        assert s["bpf"] == ["replayed" if m == "warm" else "compiled"]
        assert {"imports", "bpf", "probes", "attach"} <= set(s["phases_p50_s"])
        # warm: every program verified at once, before the attach (loader.preload); the
        # enforcer self-tests its drivers after admission is on (Tracer.selftest_later)
        assert ("load" in s["phases_p50_s"]) == (m == "warm")
        assert ("self-test" in s["phases_p50_s"]) == (cmd == "trace")
    assert d["line"].startswith(f"convgpu {cmd}, exec to ") and d["machine"]["kernel"]
