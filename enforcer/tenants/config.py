"""The enforcer's TOML configuration (contrib/config.example.toml documents every key):

    [enforce]                      # the same settings as `convgpu enforce --OPTION`
    policy = "bf"
    default_limit = "1GiB"
    [[rule]]                       # first match wins, in file order
    match = "name"                 # name | id | cgroup | label
    pattern = "trainer-*"          # a glob; for label: "key=value-glob" or "key"
    limit = "4GiB"

Options on the command line override [enforce]. Every error names the file, the key and the
value, so a bad file is refused whole (at start: the enforcer does not start; at reload: the
last good config stays)."""
import fnmatch
import tomllib
from dataclasses import dataclass, field

from ...errors import ConfigError, SizeError
from ...units import parse_size
from .containers import Container

# key -> (kind, allowed values); sizes are checked with parse_size
SETTINGS = {
    "policy": ("choice", ("fifo", "bf", "ru", "rand", "bfa")),
    "default_limit": ("size", None),
    "gpu_memory": ("size", None),
    "reserve": ("size", None),
    "stall": ("choice", ("signal", "freezer", "freezer-v1", "freezer-v2")),
    "over_limit": ("choice", ("stall", "kill")),
    "ctx_overhead": ("size", None),
    "max_wait": ("seconds", None),
    "seed": ("int", None),
    "metrics_port": ("port", None),
    "metrics_address": ("str", None),
    "metrics_tls": ("str", None),
    "run_dir": ("str", None),
    "state_dir": ("str", None),
    "libs": ("strs", None),
    "discover": ("bool", None),
    "probes": ("bool", None),
    "unprobed": ("choice", ("stall", "kill", "allow")),
    "max_objects": ("int", None),
    "max_threads": ("int", None),
    "max_processes": ("int", None),
    "unmapped_charge": ("choice", ("all", "guess")),
    "handover": ("seconds", None),
    "swap_idle": ("seconds", None),
    "swap_in": ("choice", ("call", "eager")),
    "swap_budget": ("size", None),
    "never_swap": ("strs", None),
}
# changing these needs a restart: a reload only warns
RESTART_KEYS = ("stall", "run_dir", "state_dir", "metrics_port", "metrics_address", "metrics_tls", "gpu_memory", "reserve",
                "libs", "discover", "probes", "unprobed", "max_objects", "max_threads", "max_processes",
                "unmapped_charge", "handover", "swap_idle", "swap_in", "swap_budget", "never_swap")
MATCHES = ("name", "id", "cgroup", "label")


@dataclass(frozen=True)
class Rule:
    match: str
    pattern: str
    limit: int

    def matches(self, c: Container, name: str | None, labels: dict | None) -> bool:
        unit = c.unit is not None and fnmatch.fnmatchcase(c.unit, self.pattern)   # victim.service
        if self.match == "name":
            return (name is not None and fnmatch.fnmatchcase(name, self.pattern)) or unit
        if self.match == "id":
            return fnmatch.fnmatchcase(c.id, self.pattern) or fnmatch.fnmatchcase(c.short, self.pattern) or unit
        if self.match == "cgroup":
            return fnmatch.fnmatchcase(c.cgroup, self.pattern)
        key, eq, value = self.pattern.partition("=")
        labels = labels or {}
        return key in labels and (not eq or fnmatch.fnmatchcase(str(labels[key]), value))

    @property
    def source(self) -> str:
        return f"rule {self.match} {self.pattern!r}"


@dataclass
class Config:
    path: str | None = None
    settings: dict = field(default_factory=dict)   # only the keys the file sets
    rules: list[Rule] = field(default_factory=list)


def load(path: str) -> Config:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found", "give an existing file with --config") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}", "fix the TOML syntax") from None
    unknown = set(doc) - {"enforce", "rule"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown table {sorted(unknown)[0]!r}",
                          "use [enforce] and [[rule]] only")
    section = doc.get("enforce", {})
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: 'enforce' must be a table", "write [enforce]")
    settings = {k: _setting(path, k, v) for k, v in section.items()}
    rules = doc.get("rule", [])
    if not isinstance(rules, list):
        raise ConfigError(f"config file {path}: 'rule' must be an array of tables", "write [[rule]]")
    return Config(path, settings, [_rule(path, i, r) for i, r in enumerate(rules, 1)])


def _setting(path: str, key: str, value):
    where = f"config file {path}: [enforce] {key} = {value!r}"
    if key not in SETTINGS:
        raise ConfigError(f"config file {path}: unknown key [enforce] {key}",
                          f"use one of {', '.join(SETTINGS)}")
    kind, allowed = SETTINGS[key]
    ok = True
    if kind == "size":
        try:
            return parse_size(value, f"config file {path}: [enforce] {key}")
        except SizeError as e:
            raise ConfigError(str(e.problem), e.fix) from None
    if kind == "choice":
        ok = value in allowed
    elif kind == "seconds":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "port":
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535
    elif kind == "str":
        ok = isinstance(value, str) and value != ""
    elif kind == "strs":
        ok = isinstance(value, list) and all(isinstance(v, str) and v for v in value)
    elif kind == "bool":
        ok = isinstance(value, bool)
    if not ok:
        want = f"one of {', '.join(allowed)}" if allowed else {"seconds": "a number of seconds >= 0",
            "int": "an integer", "port": "a port 0-65535", "str": "a non-empty string",
            "strs": "a list of paths", "bool": "true or false"}[kind]
        raise ConfigError(f"invalid {where}", f"use {want}")
    return value


def _rule(path: str, i: int, r) -> Rule:
    where = f"config file {path}: rule #{i}"
    if not isinstance(r, dict) or set(r) != {"match", "pattern", "limit"}:
        raise ConfigError(f"{where} must have exactly match, pattern and limit",
                          'write match = "name", pattern = "trainer-*", limit = "4GiB"')
    if r["match"] not in MATCHES:
        raise ConfigError(f"{where}: invalid match {r['match']!r}", f"use one of {', '.join(MATCHES)}")
    if not isinstance(r["pattern"], str) or not r["pattern"]:
        raise ConfigError(f"{where}: invalid pattern {r['pattern']!r}", "use a non-empty glob")
    try:
        limit = parse_size(r["limit"], f"config file {path}: rule #{i} limit")
    except SizeError as e:
        raise ConfigError(e.problem, e.fix) from None
    return Rule(r["match"], r["pattern"], limit)
