"""Which limit a container gets, first that applies: `convgpu limit set` at run time, --limit
NAME_OR_ID=SIZE, the pod's own units or annotation (Kubernetes agent, kube/pods.py), the first
matching [[rule]] of the config file, the label
com.nvidia.memory.limit (as in the ConVGPU paper), --default-limit. An operator's rule beats a
label because whoever starts a container chooses its labels. A bad label never stops the
daemon: the container gets the default and a warning."""
import logging
from dataclasses import dataclass, field

from ...errors import SizeError
from ...units import format_size, parse_size
from .config import Rule
from .containers import Container

log = logging.getLogger(__name__)
LABEL = "com.nvidia.memory.limit"
DEFAULT_LIMIT = 1 << 30   # the paper's default


def parse_limit_args(items: list[str]) -> dict[str, int]:
    """["trainer=4GiB", ...] -> {"trainer": 4294967296}; errors name the value and the fix."""
    out = {}
    for item in items:
        name, sep, size = item.partition("=")
        if not sep or not name.strip():
            raise SizeError(f"invalid --limit {item!r}", "write NAME_OR_ID=SIZE, e.g. --limit trainer=4GiB")
        out[name.strip()] = parse_size(size, f"--limit {name.strip()}")
    return out


@dataclass
class LimitRules:
    explicit: dict[str, int] = field(default_factory=dict)
    default: int = DEFAULT_LIMIT
    rules: list[Rule] = field(default_factory=list)
    runtime: dict[str, int] = field(default_factory=dict)   # container id -> `limit set`
    # container id or pod uid -> (bytes, source), from the Kubernetes agent (`pod-limits`)
    pods: dict[str, tuple[int, str]] = field(default_factory=dict)

    def limit_for(self, c: Container, name: str | None, labels: dict | None) -> tuple[int, str]:
        """(bytes, where it came from) for a container."""
        if c.id in self.runtime:
            return self.runtime[c.id], "convgpu limit set"
        for key in (name, c.id, c.short, c.cgroup):
            if key and key in self.explicit:
                return self.explicit[key], f"--limit {key}"
        for key, size in self.explicit.items():
            if len(key) >= 6 and c.id.startswith(key):
                return size, f"--limit {key}"
        for key in (c.id, c.pod):   # the pod's own resources (kube/pods.py): beat rules and labels
            if key and key in self.pods:
                return self.pods[key]
        for rule in self.rules:
            if rule.matches(c, name, labels):
                return rule.limit, rule.source
        raw = (labels or {}).get(LABEL)
        if raw is not None:
            try:
                return parse_size(raw, f"label {LABEL}"), f"label {LABEL}"
            except SizeError as e:
                log.warning("container %s: %s; using the default limit %s", name or c.short, e,
                            format_size(self.default))
        return self.default, "default"
