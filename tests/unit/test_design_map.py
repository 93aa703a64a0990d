"""docs/DESIGN.md's map of the enforcer ("The enforcer's parts") against the code: every part it
names is a class in the module it names, an Enforcer is built of exactly those parts in the
table's order, each part is handed what its row's "Handed" cell says, and every BPF map its map
table names is declared in bpf/. A doc that names a
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


def handed_cells() -> dict[str, str]:
    """The parts table's "Handed" cell, by part."""
    return {re.fullmatch(r"`(\w+)`", row[0]).group(1): row[3] for row in tables()[0]}


def named_in(cell: str, names: set[str]) -> set[str]:
    """What a Handed cell names that the code can check: a part (`Books`), a member of one
    (`Books.limit`), the Enforcer's own readers (`_take`) and the tracer. The rest of a cell
    (--over-limit, the state dir, NVML's GPUs) are values, not parts."""
    out = {m.group(0) for m in re.finditer(r"\b([A-Z]\w+)(\.\w+)?", cell) if m.group(1) in names}
    out |= set(re.findall(r"`(_\w+)`", cell))
    return out | ({"tracer"} if re.search(r"\btracer\b", cell) else set())


def test_each_part_is_handed_what_its_row_says(tmp_path, monkeypatch):
    """Every argument of each part's constructor that is a part, a part's method, a part's
    shared collection (`Books.shimmed`), one of the Enforcer's own readers or the tracer is
    named in its row's Handed cell, and the cell names nothing it is not handed; and a part is
    handed only parts above it (the order the Enforcer builds them in)."""
    named = [name for name, _ in parts()]
    handed: dict[str, list] = {}
    for name, module in parts():
        cls = getattr(importlib.import_module("convgpu." + module[:-3].replace("/", ".")), name)
        init = cls.__init__

        def spy(self, *args, _init=init, _name=name, **kw):
            handed[_name] = [*args, *kw.values()]
            _init(self, *args, **kw)
        monkeypatch.setattr(cls, "__init__", spy)
    rules, stopper = LimitRules({}, 1 << 30), SignalStopper()
    enf = Enforcer(Ledger().start(), "fifo", {0: 4 << 30}, rules, stopper=stopper, run_dir=str(tmp_path / "run"),
                   state_dir=str(tmp_path / "state"))
    enf.tracer.close()
    part_of = {id(v): type(v).__name__ for v in vars(enf).values() if type(v).__name__ in named}
    # a collection the first part (in build order) that keeps it made, not one it was handed:
    # Books.shimmed; never the Enforcer's capacity, which Books was handed and ShimBroker reads
    shared: dict[int, str | None] = {}
    for v in vars(enf).values():
        if id(v) in part_of:
            given = {id(x) for x in handed[part_of[id(v)]]}
            for k, a in vars(v).items():
                if isinstance(a, (set, dict, list)) and id(a) not in shared:
                    shared[id(a)] = None if id(a) in given else f"{part_of[id(v)]}.{k}"

    def what(v) -> str | None:
        owner = getattr(v, "__self__", None)
        if owner is enf:
            return v.__name__                               # _take, _gone, _changed, ...
        if owner is not None and id(owner) in part_of:
            return f"{part_of[id(owner)]}.{v.__name__}"     # Books.limit
        if v is enf.tracer:
            return "tracer"
        return part_of.get(id(v)) or shared.get(id(v))

    cells = handed_cells()
    assert set(handed) == set(named), set(named) - set(handed)
    for name in named:
        got = {w for w in map(what, handed[name]) if w is not None}
        assert got == named_in(cells[name], set(named)), (name, "handed", sorted(got), "row says", cells[name])
        above = set(named[:named.index(name)])
        assert {w.split(".")[0] for w in got} - above - {"tracer"} - {w for w in got if w.startswith("_")} == set(), \
            (name, "is handed a part built after it", sorted(got))


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
