"""`convgpu enforce`: the daemon that gives every container a GPU-memory limit."""
from enum import Enum

import typer

from ..enforcer.daemon import Enforcer
from ..enforcer.engines import EngineLookup
from ..enforcer.limits import DEFAULT_LIMIT, LimitRules, parse_limit_args
from ..enforcer.stall import make_stopper
from ..errors import PrerequisiteError
from ..probes.nvml import Nvml
from ..probes.tracer import Tracer
from ..units import parse_size
from . import common
from .trace import _stop_on_sigterm


class Policy(str, Enum):
    fifo = "fifo"
    bf = "bf"
    ru = "ru"
    rand = "rand"
    bfa = "bfa"


class Stall(str, Enum):
    signal = "signal"
    freezer = "freezer"


class OverLimit(str, Enum):
    stall = "stall"
    kill = "kill"


def capacity_of(gpu_memory: str | None, nvml: Nvml) -> dict[int, int]:
    if gpu_memory is not None:
        size = parse_size(gpu_memory, "--gpu-memory")
        n = len(nvml.gpus()) if nvml.ok else 1
        return {d: size for d in range(max(n, 1))}
    if not nvml.ok:
        raise PrerequisiteError(f"cannot read the GPUs' memory from NVML ({nvml.error})",
                                "give the capacity with --gpu-memory SIZE")
    return {g.index: g.total for g in nvml.gpus()}


@common.handle_errors
def enforce(
    policy: Policy = typer.Option(Policy.fifo, "--policy", help="Who resumes first: fifo, bf (best fit), ru (recent use), rand, bfa (best fit with aging)."),
    limit: list[str] = typer.Option([], "--limit", help="NAME_OR_ID=SIZE for one container (repeatable)."),
    default_limit: str = typer.Option(None, "--default-limit", help="Limit of containers with no --limit and no com.nvidia.memory.limit label (default 1GiB)."),
    gpu_memory: str = typer.Option(None, "--gpu-memory", help="Capacity per GPU to share (default: NVML's total)."),
    stall: Stall = typer.Option(Stall.signal, "--stall", help="signal: SIGSTOP the process; freezer: freeze the container's cgroup."),
    over_limit: OverLimit = typer.Option(OverLimit.stall, "--over-limit", help="A request above the limit: stall until the limit is raised, or kill."),
    ctx_overhead: str = typer.Option("0", "--ctx-overhead", help="Bytes charged per CUDA context at admission."),
    max_wait: float = typer.Option(30.0, "--max-wait", min=0.0, help="bfa: seconds of waiting after which a container goes first."),
    seed: int = typer.Option(None, "--seed", help="Seed of the rand policy."),
    lib: list[str] = typer.Option([], "--lib", help="Also probe this libcuda.so.1 (repeatable)."),
    discover: bool = typer.Option(True, "--discover/--no-discover", help="Find CUDA libraries on the host and in containers."),
    duration: float = typer.Option(0.0, "--duration", min=0.0, help="Stop after this many seconds (0: until Ctrl-C)."),
):
    """Give every container a GPU-memory limit; stall those that want more until memory frees."""
    common.decisions_visible()
    rules = LimitRules(parse_limit_args(limit),
                       parse_size(default_limit, "--default-limit") if default_limit is not None else DEFAULT_LIMIT)
    overhead = parse_size(ctx_overhead, "--ctx-overhead")
    nvml = Nvml()
    capacity = capacity_of(gpu_memory, nvml)
    stopper = make_stopper(stall.value)
    engines = EngineLookup()
    enf = Enforcer(Tracer(libraries=tuple(lib), discover=discover), policy.value, capacity, rules,
                   stopper=stopper, over_limit=over_limit.value, ctx_overhead=overhead,
                   max_wait=max_wait, seed=seed, engines=engines)
    _stop_on_sigterm()
    try:
        enf.start()
        enf.run(duration)
    except KeyboardInterrupt:
        pass
    finally:
        enf.close()
        engines.close()
        nvml.close()
