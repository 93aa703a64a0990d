"""docs/DESIGN.md's map of the enforcer ("The enforcer's parts") against the code: every part it
names is a class in the module it names, an Enforcer is built of exactly those parts in the
table's order, and every BPF map its map table names is declared in bpf/. A doc that names a
part or a map that does not exist, or misses one the Enforcer has, fails here."""
import importlib
import re
from pathlib import Path

from convgpu.enforcer.daemon import Enforcer
from convgpu.enforcer.failsafe.stall import SignalStopper
from convgpu.enforcer.tenants.limits import LimitRules
from convgpu.probes.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## The enforcer's parts"


def tables() -> list[list[list[str]]]:
    """The section's markdown tables, each a list of rows of cells (the header left out)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.find("\n## ", len(SECTION))] if "\n## " in section[len(SECTION):] else section
    out, rows = [], None
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if rows is None:
                rows = []               # the header
            elif not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif rows is not None:
            out.append(rows)
            rows = None
    return out


def parts() -> list[tuple[str, str]]:
    """(class name, module path) per row of the parts table."""
    return [(re.fullmatch(r"`(\w+)`", name).group(1), module) for name, module, *_ in tables()[0]]


def test_every_part_named_is_a_class_of_the_module_named():
    named = parts()
    assert len(named) >= 15
    for name, module in named:
        assert module.startswith("enforcer/") and module.endswith(".py") and (ROOT / module).is_file(), module
        mod = importlib.import_module("convgpu." + module[:-3].replace("/", "."))
        assert isinstance(getattr(mod, name, None), type), f"{module} has no class {name}"


def test_an_enforcer_is_built_of_exactly_those_parts_in_that_order(tmp_path):
    rules, stopper = LimitRules({}, 1 << 30), SignalStopper()
    enf = Enforcer(Ledger().start(), "fifo", {0: 4 << 30}, rules, stopper=stopper, run_dir=str(tmp_path / "run"),
                   state_dir=str(tmp_path / "state"))
    given = {id(rules), id(stopper)}   # what the Enforcer is handed is not a part of it
    built = [type(v).__name__ for v in vars(enf).values()
             if type(v).__module__.startswith("convgpu.enforcer") and id(v) not in given]
    enf.tracer.close()
    assert built == [name for name, _ in parts()]


def declared_maps() -> set[str]:
    """Every map bpf/*.bpf.c declares: STATE(type, key, leaf, NAME, n) and BPF_TABLE(...) name it
    fourth, BPF_HASH(NAME, ...) and the other BPF_* macros first."""
    out = set()
    for p in (ROOT / "bpf").glob("*.bpf.c"):
        for macro, args in re.findall(r"\b(STATE|BPF_[A-Z_]+)\(([^;()]*)\)\s*;", p.read_text()):
            names = [a.strip() for a in args.split(",")]
            out.add(names[3] if macro == "STATE" or macro.startswith("BPF_TABLE") else names[0])
    return out


def test_every_map_named_is_declared_in_bpf():
    declared = declared_maps()
    assert {"threads", "held", "config", "shim_calls", "resident"} <= declared   # the parser's own check
    maps = [re.fullmatch(r"`(\w+)`", row[0]).group(1) for row in tables()[1]]
    assert len(maps) >= 10
    assert [m for m in maps if m not in declared] == []
