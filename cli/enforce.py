"""`convgpu enforce`: the daemon that gives every container a GPU-memory limit.

Every option can also be set in the config file's [enforce] table (same name, underscores);
an option given on the command line wins. Built-in defaults are in DEFAULTS."""
import errno
import logging
import os
import signal
import ssl
from enum import Enum

import typer

from .. import phases
from ..enforcer import ctxest, hostlock, policies
from ..enforcer.tenants import config as cfg
from ..enforcer.daemon import Enforcer
from ..enforcer.tenants.engines import EngineLookup
from ..enforcer.tenants.limits import DEFAULT_LIMIT, LimitRules, parse_limit_args
from ..enforcer.quotas import MapQuota
from ..enforcer.swap.swapper import Settings as SwapSettings
from ..enforcer.failsafe.stall import make_stopper
from ..errors import ConfigError, PrerequisiteError
from ..probes.ledger import Ledger
from ..probes.nvml import Nvml
from ..probes.tracer import Tracer
from ..units import parse_size
from . import common

log = logging.getLogger("convgpu.cli.enforce")
DEFAULT_CONFIG = "/etc/convgpu/config.toml"
DEFAULTS = {"policy": "fifo", "default_limit": DEFAULT_LIMIT, "gpu_memory": None,
            "reserve": 512 << 20, "stall": "signal", "over_limit": "stall", "ctx_overhead": None,
            "max_wait": policies.MAX_WAIT, "seed": None, "metrics_port": 0, "metrics_address": "127.0.0.1",
            "metrics_tls": None,
            "run_dir": "/run/convgpu", "state_dir": ctxest.DEFAULT_STATE_DIR, "libs": [], "discover": True,
            "probes": True, "unprobed": "stall", "unmapped_charge": "all", "max_objects": MapQuota.objects,
            "max_threads": MapQuota.threads, "max_processes": MapQuota.processes, "handover": 0.0,
            "swap_idle": 0.0, "swap_in": "call", "swap_budget": None, "never_swap": []}
# what the BPF maps hold (bpf/maps.bpf.c MAX_OBJS, MAX_THREADS): quotas above these let
# fewer containers than 16 sit at them at once before a neighbour's entries find no room
MAP_SIZES = MapQuota(262144 // 16, 65536 // 16, 65536 // 64)


def metrics_tls_of(value: str | None):
    """--metrics-tls as the metrics server's Tls, or None."""
    from ..enforcer.metrics import Tls
    if not value:
        return None
    parts = value.split(",")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(f"invalid --metrics-tls {value!r}", "give CERT,KEY or CERT,KEY,CLIENT_CA (PEM files)")
    return Tls(*parts)


def check_tls(s: dict):
    """--metrics-tls's files read before the port is bound, so that each failure names its own
    cause (issue 52: a port in use blamed the TLS files)."""
    tls = metrics_tls_of(s["metrics_tls"])
    if tls is None:
        return
    try:
        tls.context()
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--metrics-tls {s['metrics_tls']}: {getattr(e, 'strerror', None) or e}",
                          "give readable PEM files: CERT,KEY[,CLIENT_CA]") from None


def metrics_error(e: OSError, s: dict) -> ConfigError:
    """Why the metrics server did not start (its TLS files were read already: check_tls)."""
    where = f"{s['metrics_address']}:{s['metrics_port']}"
    if e.errno == errno.EADDRINUSE:
        return ConfigError(f"cannot serve metrics on {where}: the port is in use (`ss -ltnp 'sport = :{s['metrics_port']}'` "
                           "says by what)", "choose a free --metrics-port")
    return ConfigError(f"cannot serve metrics on {where}: {e.strerror or e}",
                       "give an address of this host (--metrics-address) and a free --metrics-port")


class Policy(str, Enum):
    fifo = "fifo"
    bf = "bf"
    ru = "ru"
    rand = "rand"
    bfa = "bfa"


class Stall(str, Enum):
    signal = "signal"
    freezer = "freezer"
    freezer_v1 = "freezer-v1"
    freezer_v2 = "freezer-v2"


class OverLimit(str, Enum):
    stall = "stall"
    kill = "kill"


class UnmappedCharge(str, Enum):
    all = "all"
    guess = "guess"


class SwapIn(str, Enum):
    call = "call"
    eager = "eager"


class Unprobed(str, Enum):
    stall = "stall"
    kill = "kill"
    allow = "allow"


def capacity_of(gpu_memory: int | None, reserve: int, nvml: Nvml) -> dict[int, int]:
    """--gpu-memory per GPU (virtual), else NVML's total minus --reserve."""
    if gpu_memory is not None:
        n = len(nvml.gpus()) if nvml.ok else 1
        return {d: gpu_memory for d in range(max(n, 1))}
    if not nvml.ok:
        raise PrerequisiteError(f"cannot read the GPUs' memory from NVML ({nvml.error})",
                                "give the capacity with --gpu-memory SIZE")
    return physical_of(reserve, nvml)


def physical_of(reserve: int, nvml: Nvml) -> dict[int, int] | None:
    """The card's memory per GPU that convgpu may count on: NVML's total minus --reserve."""
    return {g.index: max(0, g.total - reserve) for g in nvml.gpus()} if nvml.ok else None


def settings_from(config: cfg.Config | None, cli: dict) -> dict:
    """Command line > [enforce] table > DEFAULTS."""
    out = dict(DEFAULTS)
    if config is not None:
        out.update(config.settings)
    out.update({k: v for k, v in cli.items() if v is not None})
    return out


def map_quota(s: dict) -> MapQuota:
    """The per-container quotas on the BPF maps; above MAP_SIZES' share it warns."""
    q = MapQuota(s["max_objects"], s["max_threads"], s["max_processes"])
    for name, value, share in zip(("max_objects", "max_threads", "max_processes"), vars(q).values(),
                                  vars(MAP_SIZES).values()):
        if value < 1:
            raise ConfigError(f"{name} {value} leaves a container nothing", f"give {name} of 1 or more")
        if value > share:
            log.warning("%s %d: fewer containers than the maps are sized for can sit at it at once (%d "
                        "each) before a neighbour's entries find no room", name, value, share)
    return q


def check_sizes(s: dict, limits: dict[str, int], conf: cfg.Config | None):
    """Sizes that leave a container, or the GPU, nothing are refused before anything starts
    (issue 52: `--default-limit 0` and `--limit a=0` were taken, every such container waiting
    at its first CUDA call). A limit no context fits in is said once the estimates are known
    (Runtime.warn_small_limits)."""
    if s["gpu_memory"] == 0:
        raise ConfigError("--gpu-memory 0 leaves nothing to share", "give the capacity per GPU, e.g. 5GiB")
    zero = [("--default-limit", s["default_limit"])] + [(f"--limit {k}", v) for k, v in limits.items()]
    zero += [(f"config rule #{i} ({r.match} {r.pattern!r})", r.limit) for i, r in enumerate(conf.rules if conf else (), 1)]
    for what, size in zero:
        if size == 0:
            raise ConfigError(f"{what} is 0: a container given it can allocate nothing, and its first CUDA call "
                              "waits until the limit is raised", "give a size, e.g. 1GiB")


def rules_from(config: cfg.Config | None, limits: dict[str, int], default_limit: int) -> LimitRules:
    return LimitRules(dict(limits), default_limit, list(config.rules) if config else [])


@common.handle_errors
def enforce(
    config: str = typer.Option(None, "--config", help=f"TOML config file ([enforce] options and [[rule]] limits; default {DEFAULT_CONFIG} when present)."),
    policy: Policy = typer.Option(None, "--policy", help="Who resumes first: fifo, bf (best fit), ru (recent use), rand, bfa (best fit with aging). Default fifo."),
    limit: list[str] = typer.Option([], "--limit", help="NAME_OR_ID=SIZE for one container (repeatable)."),
    default_limit: str = typer.Option(None, "--default-limit", help="Limit of containers no other source sets (default 1GiB, the paper's)."),
    gpu_memory: str = typer.Option(None, "--gpu-memory", help="Capacity per GPU to share, a virtual size (default: NVML's total minus --reserve)."),
    reserve: str = typer.Option(None, "--reserve", help="Kept free per GPU (default 512MiB): out of the capacity taken from NVML, and out of the room an exiting process's memory may still hold while a smaller --gpu-memory is handed on."),
    stall: Stall = typer.Option(None, "--stall", help="signal: SIGSTOP the process (default); freezer: freeze the container's cgroup (v2 cgroup.freeze where it exists, else the v1 freezer; freezer-v1 / freezer-v2 choose one)."),
    over_limit: OverLimit = typer.Option(None, "--over-limit", help="A request above the limit: stall until the limit is raised (default), or kill."),
    unprobed: Unprobed = typer.Option(None, "--unprobed", help="A process that opens a driver file which cannot be probed (its calls would go unchecked): stall it until it is killed (default; `convgpu status` says why), kill it, or allow it to run unchecked."),
    unmapped_charge: UnmappedCharge = typer.Option(None, "--unmapped-charge", help="A process whose CUDA devices cannot be told apart as host GPUs (it opened several GPUs' device nodes and its CUDA_VISIBLE_DEVICES does not name them all): charge its memory to every GPU it may use (default; `convgpu status` lists it), or only to the GPU its environment suggests."),
    ctx_overhead: str = typer.Option(None, "--ctx-overhead", help="Bytes charged per CUDA context before NVML measures it, where no median was learned on this GPU: the operator's figure, used as given. Default: none; the enforcer measures a context once per GPU model and driver (kept in --state-dir), else charges its table's figure or a conservative 1 GiB."),
    max_wait: float = typer.Option(None, "--max-wait", min=0.0, help="bfa: seconds of waiting after which a container goes first (default 180)."),
    seed: int = typer.Option(None, "--seed", help="Seed of the rand policy."),
    lib: list[str] = typer.Option([], "--lib", help="Also probe this libcuda.so.1 (repeatable)."),
    discover: bool = typer.Option(None, "--discover/--no-discover", help="Find CUDA libraries on the host and in containers (default on)."),
    probes: bool = typer.Option(None, "--probes/--no-probes", help="eBPF probes see every process (default on); --no-probes, where eBPF is unavailable: only processes under the preload shim are limited, from what the shim reports."),
    duration: float = typer.Option(0.0, "--duration", min=0.0, help="Stop after this many seconds (0: until Ctrl-C or SIGTERM)."),
    metrics_port: int = typer.Option(None, "--metrics-port", min=0, max=65535, help="Serve Prometheus metrics on this port (default 0: off)."),
    metrics_address: str = typer.Option(None, "--metrics-address", help="Address of the metrics server (default 127.0.0.1)."),
    metrics_tls: str = typer.Option(None, "--metrics-tls", help="CERT,KEY[,CLIENT_CA]: serve metrics over HTTPS; with CLIENT_CA only clients with a certificate it signed (mutual TLS; docs/SECURITY.md row 11)."),
    run_dir: str = typer.Option(None, "--run-dir", help="Sockets and state (default /run/convgpu: control.sock, shim/shim.sock)."),
    state_dir: str = typer.Option(None, "--state-dir", help=f"Kept across restarts: the context overheads NVML measured per GPU, the context measured per GPU model, run-time limits and names (decisions.json), each job's recent runs (history.jsonl, `convgpu recommend`) (default {ctxest.DEFAULT_STATE_DIR})."),
    max_objects: int = typer.Option(None, "--max-objects", min=1, help=f"Device objects (allocations, VMM handles and mappings, arrays, contexts) one container may hold in the BPF maps; at it, its next call is stalled or killed as --over-limit says (default {MapQuota.objects})."),
    max_threads: int = typer.Option(None, "--max-threads", min=1, help=f"Threads calling CUDA one container may have tracked at once (default {MapQuota.threads})."),
    max_processes: int = typer.Option(None, "--max-processes", min=1, help=f"Processes using CUDA one container may have tracked at once (default {MapQuota.processes})."),
    handover: float = typer.Option(None, "--handover", min=0.0, help="Seconds a successor may take, at a SIGTERM (systemctl restart, a DaemonSet rollout), to take over the calls this enforcer holds: they stay held and admission stays on meanwhile, so a restart lets no stalled process past its limit (default 0: a SIGTERM resumes them, as Ctrl-C always does). The systemd unit and the DaemonSet set 60."),
    swap_idle: float = typer.Option(None, "--swap-idle", min=0.0, help="Seconds a holder must be quiet (no driver call, no CPU, no GPU use) before its GPU memory may be moved to host memory (the driver's checkpoint) so that a waiter the full GPU holds back can run; a deadlock is then also broken by a swap (default 0: never by policy; `convgpu swap out` by hand)."),
    swap_in: SwapIn = typer.Option(None, "--swap-in", help="A swapped process comes back at its next CUDA call (call, default), or as soon as room frees (eager)."),
    swap_budget: str = typer.Option(None, "--swap-budget", help="Host memory all swapped processes together may take (default: no cap; each is also kept within its own memory cgroup's limit)."),
    never_swap: list[str] = typer.Option([], "--never-swap", help="A container name (glob) never swapped (repeatable); also the label or pod annotation convgpu.io/swap=never."),
    no_bpf_cache: bool = typer.Option(False, "--no-bpf-cache", help=common.NO_BPF_CACHE_HELP),
):
    """Give every container a GPU-memory limit; stall those that want more until memory frees."""
    phases.mark("imports")
    common.decisions_visible()
    path = config if config is not None else (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    conf = cfg.load(path) if path else None
    limits = parse_limit_args(limit)
    cli = {"policy": policy.value if policy else None,
           "default_limit": parse_size(default_limit, "--default-limit") if default_limit is not None else None,
           "gpu_memory": parse_size(gpu_memory, "--gpu-memory") if gpu_memory is not None else None,
           "reserve": parse_size(reserve, "--reserve") if reserve is not None else None,
           "stall": stall.value if stall else None, "over_limit": over_limit.value if over_limit else None,
           "ctx_overhead": parse_size(ctx_overhead, "--ctx-overhead") if ctx_overhead is not None else None,
           "max_wait": max_wait, "seed": seed, "metrics_port": metrics_port,
           "metrics_address": metrics_address, "metrics_tls": metrics_tls, "run_dir": run_dir, "state_dir": state_dir, "libs": list(lib) or None,
           "discover": discover, "probes": probes, "unprobed": unprobed.value if unprobed else None,
           "max_objects": max_objects, "max_threads": max_threads, "max_processes": max_processes,
           "unmapped_charge": unmapped_charge.value if unmapped_charge else None, "handover": handover,
           "swap_idle": swap_idle, "swap_in": swap_in.value if swap_in else None,
           "swap_budget": parse_size(swap_budget, "--swap-budget") if swap_budget is not None else None,
           "never_swap": list(never_swap) or None}
    s = settings_from(conf, cli)
    quota = map_quota(s)
    check_sizes(s, limits, conf)

    def reload():
        new = cfg.load(path) if path else cfg.Config()
        merged = settings_from(new, cli)
        for key in cfg.RESTART_KEYS:
            if merged[key] != s[key]:
                log.warning("reload: %s changed in %s; it takes effect at the next restart", key, path)
        return rules_from(new, limits, merged["default_limit"]), merged

    lock = hostlock.take(s["run_dir"])   # before anything is probed: one enforcer per host (issue 52)
    try:
        _serve(s, conf, limits, path, reload, quota, no_bpf_cache, duration)
    finally:
        os.close(lock)


def _serve(s: dict, conf, limits, path, reload, quota, no_bpf_cache: bool, duration: float):
    nvml = Nvml()
    capacity = capacity_of(s["gpu_memory"], s["reserve"], nvml)
    stopper = make_stopper(s["stall"])
    engines = EngineLookup()
    source = Tracer(libraries=tuple(s["libs"]), discover=s["discover"], runtime=False,
                    bpf_cache=common.bpf_cache(no_bpf_cache)) if s["probes"] else Ledger()
    enf = Enforcer(source, s["policy"], capacity,
                   rules_from(conf, limits, s["default_limit"]), stopper=stopper,
                   over_limit=s["over_limit"], ctx_overhead=s["ctx_overhead"], max_wait=s["max_wait"],
                   seed=s["seed"], engines=engines, run_dir=s["run_dir"], nvml=nvml,
                   reload=reload if path else None, physical=physical_of(s["reserve"], nvml),
                   unprobed=s["unprobed"], state_dir=s["state_dir"], quota=quota,
                   unmapped_charge=s["unmapped_charge"], handover=s["handover"],
                   swap=SwapSettings(s["swap_idle"] or 0.0, s["swap_in"] == "eager", s["swap_budget"],
                                     tuple(s["never_swap"] or ())))
    common.stop_on_signals(interrupt=False)   # SIGHUP: reload, once started
    try:
        if s["metrics_port"]:
            from ..enforcer.metrics import JobCollector, MetricsServer   # imported only when served (start-up)
            check_tls(s)
            try:
                enf.metrics = MetricsServer(s["metrics_port"], s["metrics_address"], nvml=nvml,
                                            tls=metrics_tls_of(s["metrics_tls"]), extra=[JobCollector(enf.history)])
            except (OSError, ssl.SSLError) as e:
                raise metrics_error(e, s) from None
        phases.mark("setup")
        try:
            enf.start()
            phases.mark("enforcing")
            log.info("%s", phases.line())
        except PrerequisiteError as e:   # no eBPF here: say what still works
            raise PrerequisiteError(e.problem, f"{e.fix}; or limit through the preload shim only: "
                                               "--no-probes") from None
        enf.run(duration, on_step=common.check_stop)
    except KeyboardInterrupt:
        pass
    finally:
        enf.close(hand_over=common.stopped_by(signal.SIGTERM))   # Ctrl-C always releases at once
        engines.close()
        nvml.close()
