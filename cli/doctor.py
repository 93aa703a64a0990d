"""`convgpu doctor`: can tracing work on this host? Every failed check prints its fix."""
import os
import shutil
from dataclasses import dataclass

import typer
from rich.console import Console
from rich.text import Text

from ..enforcer import ctxest
from ..enforcer.tenants.cgroupfs import cgroup_layout
from ..probes import loader
from ..probes.libs import LibraryFinder
from ..probes.nvml import Nvml
from ..units import format_size
from . import common


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    fatal: bool = True     # tracing cannot work without it


def _kernel_config(option: str) -> bool | None:
    for path in (f"/boot/config-{os.uname().release}", "/proc/config.gz"):
        try:
            if path.endswith(".gz"):
                import gzip
                text = gzip.open(path, "rt").read()
            else:
                text = open(path).read()
            return f"{option}=y" in text
        except OSError:
            continue
    return None


def backstop_check(nv) -> Check:
    """The backstop (enforcer/backstop.py) needs NVML's per-process memory: off where NVML is
    missing, a GPU is in MIG mode, or the driver answers NotSupported (some vGPUs)."""
    fix = ("memory obtained outside admitted calls (a module's static data, a call of a newer driver) goes "
           "unseen there: give the host NVML with per-process figures (no MIG, a full GPU)")
    if not nv.ok:
        return Check("backstop", False, f"off: no NVML ({nv.error})", fix, fatal=False)
    off = [f"GPU{g.index} (MIG mode)" for g in nv.gpus() if g.migs]
    try:
        nv.process_memory()
    except Exception as e:   # NotSupported on every GPU (vGPU), GPU lost
        return Check("backstop", False, f"off: NVML gives no per-process memory ({e})", fix, fatal=False)
    return Check("backstop", not off, "on: NVML's per-process memory, every 0.25 s" if not off else
                 f"off on {', '.join(off)}: NVML counts no process's memory there", fix, fatal=False)


def headers_check(kr: str) -> Check:
    """The running kernel's headers, or others linked in (scripts/setup.sh links the distro's
    generic headers where none match: bcc compiles uprobe programs with them, as those use only
    stable uapi types; issue 52: doctor called those `ok`, as if they were the kernel's own)."""
    build = f"/lib/modules/{kr}/build"
    if not os.path.exists(f"{build}/include"):
        return Check("kernel headers", False, f"{build}: none",
                     f"install linux-headers-{kr} (or run scripts/setup.sh: it links the generic ones)")
    real = os.path.realpath(build)
    if kr in real or not os.path.islink(build):
        return Check("kernel headers", True, f"{build} ({real})")
    return Check("kernel headers", False, f"{build} -> {real}: another kernel's headers, linked in",
                 "enough for convgpu's uprobe programs (stable uapi types only); install "
                 f"linux-headers-{kr} where the distro has it", fatal=False)


def run_checks(state_dir: str = ctxest.DEFAULT_STATE_DIR, run_dir: str = common.RUN_DIR) -> list[Check]:
    root = os.geteuid() == 0
    checks = [Check("root", root, f"euid {os.geteuid()}", "run as root (sudo convgpu ...)")]
    as_root = "run `sudo convgpu doctor`: only root may look at this (it says nothing of the kernel)"
    checks.append(Check("BTF", os.path.exists("/sys/kernel/btf/vmlinux"), "/sys/kernel/btf/vmlinux",
                        "a kernel with CONFIG_DEBUG_INFO_BTF helps; not required by bcc", fatal=False))
    up = os.path.exists("/sys/bus/event_source/devices/uprobe")
    checks.append(Check("uprobes", up, "perf uprobe PMU" if up else "no /sys/bus/event_source/devices/uprobe",
                        "a kernel with CONFIG_UPROBES and CONFIG_BPF_EVENTS"))
    if up and os.geteuid() == 0:
        from ..probes import links
        ok, detail = links.supported()
        checks.append(Check("uprobe links", ok, detail,
                            "Linux >= 6.6: without, each probe is a perf event and detaching them takes "
                            "0.1-0.5 s apiece (`trace`/`enforce` hand that to a child)", fatal=False))
        ok, detail = links.supported(links.BPF_TRACE_UPROBE_SESSION)
        checks.append(Check("uprobe sessions", ok, detail,
                            "Linux >= 6.13: without, every free is also trapped at its return (about "
                            "half a microsecond each: docs/ENFORCE.md, \"Waits\")", fatal=False))
    elif up:   # issue 52: as non-root these read as the kernel's lack
        checks.append(Check("uprobe links", False, NEEDS_ROOT, as_root, fatal=False))
    from ..probes.loader import has_open_tracepoints
    if root:
        tp = has_open_tracepoints()
        checks.append(Check("open tracepoints", tp, "syscalls/sys_{enter,exit}_openat" if tp else "none under tracefs",
                            "a kernel with CONFIG_FTRACE_SYSCALLS: else a new driver copy is found only by "
                            "the periodic scan, up to a second late", fatal=False))
    else:
        checks.append(Check("open tracepoints", False, f"{NEEDS_ROOT} (tracefs is root's)", as_root, fatal=False))
    kr = os.uname().release
    hdr_check = headers_check(kr)
    hdr = hdr_check.ok or not hdr_check.fatal
    checks.append(hdr_check)
    try:
        loader.import_bcc()
        checks.append(Check("bcc", True, "imports"))
        if root and hdr:
            checks += _bpf_checks()
        elif not root:
            checks.append(Check("BPF compile+load", False, NEEDS_ROOT, as_root, fatal=False))
    except Exception as e:
        checks.append(Check("bcc", False, str(e)[:200], "apt-get install python3-bpfcc; venv with --system-site-packages"))
    libs = LibraryFinder().scan() if os.path.isdir("/proc") else []
    cuda = [lib for lib in libs if lib.kind == "cuda"]
    checks.append(Check("libcuda", bool(cuda), "; ".join(f"{lib} inode {lib.inode[1]}" for lib in cuda) or "none found",
                        "install the NVIDIA driver (convgpu trace runs its demo without one)", fatal=False))
    for lib in cuda:
        checks.append(_recheck_check(lib))
    for lib in libs:
        if lib.kind == "cudart":
            checks.append(Check("libcudart", True, f"{lib} inode {lib.inode[1]}", fatal=False))
    nv = Nvml()
    checks.append(Check("NVML", nv.ok, f"driver {nv.driver}, {len(nv.gpus())} GPU(s)" if nv.ok else nv.error,
                        "without NVML no context is measured: each is charged the table's figure or a "
                        "conservative 1 GiB (or --ctx-overhead)", fatal=False))
    checks += context_checks(nv, cuda, state_dir, run_dir)
    checks.append(backstop_check(nv))
    nv.close()
    lay = cgroup_layout()
    checks.append(Check("cgroups", lay.mode in ("v2", "hybrid", "v1"), f"{lay.mode}; v2 at {lay.v2_root}", "mount cgroup2"))
    checks.append(Check("freezer", bool(lay.freezer_v1_root or lay.v2_root),
                        f"v1 {lay.freezer_v1_root or '-'}; v2 {'cgroup.freeze' if lay.v2_root else '-'}",
                        "enforce --stall freezer needs a cgroup freezer", fatal=False))
    for eng in ("podman", "docker"):
        w = shutil.which(eng)
        checks.append(Check(eng, bool(w), w or "not installed", "optional: names and labels of containers", fatal=False))
    if state_dir:
        checks.append(_decisions_check(state_dir))
        from ..enforcer.history.store import check as history_check
        state, detail = history_check(state_dir)
        checks.append(Check("job history", state != "unreadable", detail, "new runs wait in memory until it is "
                            "repaired or moved aside (docs/RECOMMEND.md)", fatal=False))
    from ..kube import doctor as kube_doctor   # Kubernetes: advisory (docs/KUBERNETES.md)
    checks += [Check(name, ok, detail, fix, fatal=False) for name, ok, detail, fix in kube_doctor.checks()]
    return checks


def context_checks(nv, cuda, state_dir: str, run_dir: str) -> list[Check]:
    """Per GPU, what a CUDA context is charged before NVML measures it, and where that comes from:
    the running enforcer's figure if one answers, else what a start would charge with the state
    dir as it is (measured-at-start, to be measured at start, table-hint, conservative;
    enforcer/ctxest.py). Conservative is a warning: 1 GiB held per context until NVML measures it."""
    from ..enforcer.serving.server import request
    try:
        st = request(f"{run_dir.rstrip('/')}/control.sock", {"cmd": "status"}, timeout=2)["status"]
        running = {d: (g["ctx_estimate"], g.get("ctx_measuring", False)) for d, g in st["gpus"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        running = None
    store = ctxest.MeasuredStore(state_dir)
    out = []
    gpus = nv.gpus() if nv.ok else []
    for g in gpus or [None]:
        dev = ctxest.Device(g.index, g.name, g.uuid, nv.driver) if g else ctxest.Device(0)
        if running is not None and str(dev.index) in running:
            est, measuring = running[str(dev.index)]
            est = ctxest.Estimate(est["bytes"], est["source"], est["detail"])
            where = "the running enforcer" + (", being measured now" if measuring else "")
            later = measuring
        else:
            why = ("no NVML" if not nv.ok else "MIG mode" if g.migs else "no host driver" if not cuda else "")
            measured = store.measured_at_start(dev.model_key)
            est = ctxest.choose(dev, None, measured, why)
            where = f"a start with {state_dir}"
            later = not why and measured is None
            if later:
                where += ": measured at start first (newcomers wait), till then"
        out.append(Check(f"context GPU{dev.index}", est.source != "conservative" or later,
                         f"{format_size(est.bytes)} per context ({est.source}; {where}): {est.detail}",
                         "a context is held at 1 GiB until NVML measures its process: give the enforcer NVML "
                         "and the host's driver to measure one, or --ctx-overhead", fatal=False))
    return out


def _decisions_check(state_dir: str) -> Check:
    """The enforcer's run-time decisions (enforcer/tenants/durable.py): readable, and the state
    dir writable (else `limit set`, `convgpu run` and the agent's pod limits are refused)."""
    from ..enforcer.tenants import durable
    state, detail = durable.check(state_dir)
    if os.geteuid() != 0 and (state == "unreadable" and "Permission denied" in detail or
                              state == "unwritable" and "not writable" in detail):   # root's, not broken
        return Check("decisions", False, f"{NEEDS_ROOT} ({detail})",
                     "run `sudo convgpu doctor`: only root may read the enforcer's state dir", fatal=False)
    fixes = {"unreadable": "the enforcer holds every container until it is repaired or moved aside "
                           "(then `convgpu reload`): see docs/OPERATOR.md, \"What survives a restart\"",
             "unwritable": "make the state dir writable (and not full), or give --state-dir"}
    # unreadable: the enforcer holds every container: it cannot work as meant (issue 52: only `warn`)
    return Check("decisions", state in ("ok", "none"), detail, fixes.get(state, ""), fatal=state == "unreadable")


def _recheck_check(lib) -> Check:
    """Where `enforce` puts each admitted call's recheck probe: on an emulated push it costs about
    a probe hit; single-stepped, several microseconds more per allocation (probes/prologue.py)."""
    try:
        sites = loader.recheck_sites(lib.path)
    except Exception as e:
        return Check("recheck site", False, f"{lib}: {str(e)[:150]}", "see the error", fatal=False)
    where: dict[str, list[str]] = {}
    for sym, site in sites.items():
        where.setdefault(f"+{site[0]} {site[1]}" if site else "none (not enforced after a resume)", []).append(sym)
    detail = "; ".join(f"{k}: {len(v)} symbol(s)" + ("" if k.endswith("emulated") else f" ({', '.join(v)})")
                       for k, v in sorted(where.items()))
    ok = bool(sites) and all(site and site[1] == "emulated" for site in sites.values())
    return Check("recheck site", ok, f"{lib}: {detail}",
                 "a driver whose prologue has no push after the entry: enforce single-steps the recheck "
                 "(several us per allocation) or, with none, cannot catch a sibling's SIGCONT", fatal=False)


def _bpf_checks() -> list[Check]:
    """Whether the program loads, and whether a start finds its compile cached (then it takes
    ~0.05 s instead of seconds): the state before this check, which then fills the cache for
    `trace` and for `enforce` (its maps pinned in a directory of its own: never a running
    enforcer's, whose accounting another program's exit handling would upset)."""
    out = []
    states = {what: loader.cache_state(pinned=what == "enforce") for what in ("enforce", "trace")}
    for what, (state, detail) in states.items():
        out.append(Check(f"BPF cache ({what})", state == "warm", f"{state}: {detail}",
                         "nothing to do: this check filled it (a cold start compiles, seconds)"
                         if state == "cold" else "unset CONVGPU_BPF_CACHE=off to cache", fatal=False))
    pin = f"/sys/fs/bpf/convgpu-doctor-{os.getpid()}"
    try:
        b = loader.compile_program()
        how, secs = b.origin
        b.cleanup()
        if os.path.ismount("/sys/fs/bpf"):
            os.makedirs(pin, mode=0o700, exist_ok=True)
            loader.compile_program(extra=(f'-DPIN_DIR="{pin}"',)).cleanup()
        out.append(Check("BPF compile+load", True, f"convgpu.bpf.c {how} and loaded in {secs:.2f} s"))
    except Exception as e:
        out.append(Check("BPF compile+load", False, str(e)[:200], "see the error; run scripts/setup.sh"))
    finally:
        shutil.rmtree(pin, ignore_errors=True)
    return out


NEEDS_ROOT = "not checked: needs root"


def verdict(checks: list[Check]) -> tuple[bool, str]:
    """(ready, the one line that sums the checks up): not ready where tracing cannot work, or
    where an enforcer would hold every container (its decisions unreadable)."""
    bad = [c.name for c in checks if c.fatal and not c.ok]
    warn = sum(1 for c in checks if not c.ok and not c.fatal)
    if bad:
        return False, (f"NOT READY: {', '.join(bad)} failed; `convgpu trace` and `convgpu enforce` cannot work "
                       "here until each is fixed (the fixes are above)")
    demo = not any(c.name == "libcuda" and c.ok for c in checks)
    return True, ("ready: `convgpu trace` and `convgpu enforce` work here"
                  + (" (no NVIDIA driver: `convgpu trace` runs its demo)" if demo else "")
                  + (f"; {warn} warning(s) above limit what is measured or shown, not what is enforced" if warn else ""))


def report(checks: list[Check]) -> list[Text]:
    """One line per check, its fix on the next where it failed; never a table: a path or a fix is
    never cut or split mid-word (issue 52: a 100-column table split paths), the terminal wraps
    long lines whole."""
    width = max(len(c.name) for c in checks) + 2
    out = []
    for c in checks:
        mark = ("ok", "green") if c.ok else ("FAIL", "red") if c.fatal else ("warn", "yellow")
        line = Text.assemble((f"{mark[0]:<5}", mark[1]), f"{c.name:<{width}}", c.detail)   # details: text
        out.append(line)
        if not c.ok and c.fix:
            out.append(Text(" " * (5 + width) + "fix: " + c.fix, style="dim"))
    return out


@common.handle_errors
def doctor(state_dir: str = typer.Option(ctxest.DEFAULT_STATE_DIR, "--state-dir", help="The enforcer's state dir: "
                                         "what a start would charge per CUDA context (learned or measured there)."),
           run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Check that this host can trace and limit CUDA allocations; print the fix for every problem
    and, last, a one-line verdict (exit 1 when not ready)."""
    checks = run_checks(state_dir, run_dir)
    console = Console(highlight=False)
    for line in report(checks):
        console.print(line, soft_wrap=True)
    ready, line = verdict(checks)
    if not ready:
        raise common.fail(f"verdict: {line}")
    console.print(Text.assemble(("verdict: ", "bold"), (line, "green")), soft_wrap=True)
