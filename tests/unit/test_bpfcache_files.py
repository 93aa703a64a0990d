"""The cache of compiled BPF programs without a kernel (probes/bpfcache.py): what keys it, the
relocations it records, its files; the start phases and bench.startup's summary."""
import json
import logging
import os
import struct
from types import SimpleNamespace

import pytest

from convgpu.probes import bpfcache


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "bpf"
    d.mkdir()
    (d / "p.bpf.c").write_text('#include "p.h"\n#include "q.bpf.c"\nint f(void *ctx) { return 0; }\n')
    (d / "q.bpf.c").write_text("int g(void *ctx) { return 0; }\n")   # a part p.bpf.c includes
    (d / "p.h").write_text("struct s { int a; };\n")
    (d / "__init__.py").write_text("")
    return d


FLAGS = ["-I/x", "-DRINGBUF_PAGES=4096", "-DHAVE_GROUP_DEAD"]


def test_key_follows_source_headers_flags_kernel_and_bcc(src, monkeypatch):
    base = bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), FLAGS))
    assert base == bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), list(FLAGS)))
    keys = set()
    (src / "__init__.py").write_text("# not part of the program")
    assert bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), FLAGS)) == base
    (src / "p.h").write_text("struct s { long a; };\n")
    keys.add(bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), FLAGS)))
    (src / "q.bpf.c").write_text("int g(void *ctx) { return 1; }\n")
    keys.add(bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), FLAGS)))
    (src / "p.bpf.c").write_text('#include "p.h"\n#include "q.bpf.c"\nint f(void *ctx) { return 1; }\n')
    keys.add(bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), FLAGS)))
    keys.add(bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), FLAGS + ["-DNO_OPEN_TRACEPOINTS"])))
    keys.add(bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), ["-I/x", "-DRINGBUF_PAGES=8", "-DHAVE_GROUP_DEAD"])))
    monkeypatch.setattr(bpfcache, "_bcc_version", lambda: "0.31.0")
    keys.add(bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), FLAGS)))
    real = os.uname()
    monkeypatch.setattr(os, "uname", lambda: SimpleNamespace(release=real.release, version="#2 another build",
                                                             machine=real.machine))
    keys.add(bpfcache.key_of(bpfcache.material(str(src / "p.bpf.c"), FLAGS)))
    assert len(keys | {base}) == 8


def test_a_part_is_pasted_in_where_it_is_included_and_a_header_is_not(src):
    """bcc rewrites map calls and finds programs only in the main source (bpf/__init__.py)."""
    from convgpu.bpf import source_text
    assert source_text(src / "p.bpf.c") == ('#include "p.h"\n#line 1 "q.bpf.c"\nint g(void *ctx) { return 0; }\n'
                                           '#line 3 "p.bpf.c"\nint f(void *ctx) { return 0; }\n')


def test_the_pin_directory_is_per_start_not_in_the_key(src):
    a = bpfcache.material(str(src / "p.bpf.c"), FLAGS + ['-DPIN_DIR="/sys/fs/bpf/convgpu"'])
    b = bpfcache.material(str(src / "p.bpf.c"), FLAGS + ['-DPIN_DIR="/sys/fs/bpf/convgpu-1234"'])
    unpinned = bpfcache.material(str(src / "p.bpf.c"), FLAGS)
    assert bpfcache.key_of(a) == bpfcache.key_of(b) != bpfcache.key_of(unpinned)
    assert bpfcache.split_flags(FLAGS + ['-DPIN_DIR="/sys/fs/bpf/x"'])[1] == "/sys/fs/bpf/x"
    assert bpfcache.split_flags(FLAGS) == (FLAGS, None)


def insn(op, dst=0, src=0, off=0, imm=0) -> bytes:
    return struct.pack("<BBhi", op, src << 4 | dst, off, imm)


def test_relocations_name_each_map_load_and_refuse_what_replay_cannot_patch():
    code = (insn(0xb7, 1, 0, 0, 5) + insn(0x18, 1, 1, 0, 7) + insn(0, 0, 0, 0, 0)   # r1 = map fd 7
            + insn(0x18, 2, 0, 0, 9) + insn(0, 0, 0, 0, 0)                           # r2 = 9 (a constant)
            + insn(0x18, 1, 1, 0, 8) + insn(0) + insn(0x85, 0, 0, 0, 1) + insn(0x95))
    assert bpfcache._relocations(b"f", code, {7: "threads", 8: "held"}) == [[1, "threads"], [5, "held"]]
    with pytest.raises(bpfcache.Uncacheable, match="kind 2"):      # BPF_PSEUDO_MAP_VALUE
        bpfcache._relocations(b"f", insn(0x18, 1, 2, 0, 7) + insn(0), {7: "threads"})
    with pytest.raises(bpfcache.Uncacheable, match="kind 1"):      # a descriptor of no map
        bpfcache._relocations(b"f", insn(0x18, 1, 1, 0, 99) + insn(0), {7: "threads"})
    with pytest.raises(bpfcache.Uncacheable, match="BPF-to-BPF"):
        bpfcache._relocations(b"f", insn(0x85, 0, 1, 0, 3) + insn(0x95), {})


SPEC = {"license": "GPL", "kern_version": 1, "maps": {"m": {"type": 1, "flags": 0}},
        "functions": {"f": {"insns": insn(0xb7) + insn(0x95), "maps": []}}}


def test_save_then_load_round_trips_and_a_bad_file_is_reported(tmp_path, src, caplog):
    mat = bpfcache.material(str(src / "p.bpf.c"), FLAGS)
    d = str(tmp_path / "cache")
    assert bpfcache.load(d, mat) is None and not caplog.records   # cold: silent
    path = bpfcache.save(d, mat, SPEC)
    assert path == bpfcache.path_of(d, mat) and os.stat(d).st_mode & 0o777 == 0o700
    assert bpfcache.load(d, mat) == SPEC
    assert bpfcache.state(d, mat) == ("warm", path)
    assert [n for n in os.listdir(d)] == [os.path.basename(path)]   # no temporary file left
    doc = json.load(open(path))
    doc["program"]["kern_version"] = 2
    json.dump(doc, open(path, "w"))
    with caplog.at_level(logging.WARNING):
        assert bpfcache.load(d, mat) is None
    assert "checksum" in caplog.text and path in caplog.text
    assert bpfcache.state(d, mat)[0] == "cold"
    open(path, "w").write("{")
    assert bpfcache.load(d, mat) is None
    bpfcache.save(d, mat, SPEC)
    os.chmod(path, 0o664)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert bpfcache.load(d, mat) is None
    assert "not ours alone" in caplog.text


def test_cache_dir_default_env_and_off(monkeypatch):
    monkeypatch.delenv(bpfcache.ENV, raising=False)
    assert bpfcache.cache_dir() == "/var/cache/convgpu/bpf"
    monkeypatch.setenv(bpfcache.ENV, "/tmp/c")
    assert bpfcache.cache_dir() == "/tmp/c"
    assert bpfcache.cache_dir("off") is None and bpfcache.cache_dir("/d") == "/d"
    monkeypatch.setenv(bpfcache.ENV, "off")
    assert bpfcache.cache_dir() is None
    assert bpfcache.state(None, {})[0] == "off"


def test_phases_line_and_its_reading_by_the_benchmark(monkeypatch):
    from bench import startup
    from convgpu import phases
    clock = iter([0.25, 0.30, 0.35, 0.55, 0.62])
    monkeypatch.setattr(phases, "since_exec", lambda: next(clock))
    monkeypatch.setattr(phases, "_marks", [])
    monkeypatch.setattr(phases, "_parts", {"attach": 0.15, "self-test": 0.03})
    monkeypatch.setattr(phases, "_notes", {})
    for name, note in (("imports", ""), ("setup", ""), ("bpf", "replayed"), ("probes", ""), ("enforcing", "")):
        phases.mark(name, note)
    line = phases.line()
    assert line == ("start: 0.62 s from exec: imports 0.25, setup 0.05, bpf 0.05 (replayed), probes 0.20, "
                    "enforcing 0.07; of which attach 0.15, self-test 0.03")
    got = startup._phase_seconds(line.split("start: ", 1)[1])
    assert got == {"imports": 0.25, "setup": 0.05, "bpf": 0.05, "probes": 0.2, "enforcing": 0.07,
                   "attach": 0.15, "self-test": 0.03}
    s = startup.summarize([{"s": 0.7, "phases": line.split("start: ", 1)[1]}, {"s": 0.5, "phases": None},
                           {"s": 0.9, "phases": line.split("start: ", 1)[1]}])
    assert (s["n"], s["p50_s"], s["min_s"], s["max_s"]) == (3, 0.7, 0.5, 0.9)
    assert s["phases_p50_s"]["imports"] == 0.25
