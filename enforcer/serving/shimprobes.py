"""BPF sees the shim's own entry points (issue 24, row 2): a uprobe and a uretprobe on each
wrapper of the enforcer's own shim library that stands before an admitted driver call
(probes/table.py ADMITTED: the allocating and context-making calls) mark the calling thread
"inside the shim" (bpf/admit.bpf.c shim_enter / shim_exit). Only a call made from inside a
wrapper, by a process that said `hello`, is spared a stop for its assignment; BPF still stops it
above its limit. A process that said hello and then calls libcuda itself (or maps the shim and
jumps past it) is admitted like anyone else.

Why the wrappers and not "the shim's inode is mapped": a process can map the library and still
call the driver directly, so mapping proves nothing about a call; running the wrapper's entry
means the wrapper asked (or took credit) before it calls the driver. The probes are per inode:
a container that mounts the host's library (docs/SHIM.md) is covered; one that brings its own
copy of the shim gets no exemption (it is stopped and resumed like any process, never let
through). Each wrapper starts with a push (`objdump -d`), which the kernel emulates: ~0.5 us a
hit here, not a single step (FACTS.md)."""
import logging

from ...paths import offered_shim, shim_library
from ...probes import links
from ...probes.table import ADMITTED

log = logging.getLogger(__name__)


def libraries(run_dir: str) -> tuple[str, ...]:
    """The shim libraries whose wrappers are marked: the package's, and the copy that pods mount
    (made here if missing; the Kubernetes agent keeps the same file: paths.offered_shim)."""
    try:
        offered = offered_shim(run_dir)
    except OSError as e:   # pods' copy is then a stranger: probed as a driver, its calls admitted once
        log.warning("the shim copy for pods in %s/lib cannot be made: %s", run_dir, e)
        offered = None
    return tuple(p for p in (shim_library(), offered) if p)


def attach(b, path: str | None) -> int:
    """Marks on every admitted wrapper of the shim library at `path` (the package's, or the copy
    pods mount: paths.offered_shim); returns how many wrappers. Without the library (not built)
    nothing is marked, and shim processes are admitted like any other (safe, not graceful)."""
    import bcc
    if path is None:
        log.warning("the shim library is not built: processes under a shim are stopped like any other")
        return 0
    n = 0
    for sym in sorted(ADMITTED):
        try:
            where, off = bcc.BPF._check_path_symbol(path.encode(), sym.encode(), None, -1)
        except Exception:   # bcc's bare Exception: the shim does not wrap it (arrays), so that
            continue        # call is admitted as anyone's, never spared
        links.attach(b, b"shim_enter", where, off, sym.encode())
        links.attach(b, b"shim_exit", where, off, sym.encode(), ret=True)
        n += 1
    log.info("shim wrappers marked in %s (%d)", path, n)
    return n
