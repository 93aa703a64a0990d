"""The control socket's commands (root only; `convgpu status`, `limit set`, `reload`, `run`, the
Kubernetes agents' `pod-limits` and `claim-*`).
Each request is {"cmd": NAME, ...}; each reply {"ok": true, ...} or {"ok": false, "error": LINE}."""
from ...errors import ConvgpuError
from ...faults import FAULT
from ...units import format_size, parse_size
from .server import Handler, Peer, request


class ControlHandler(Handler):
    """Handed the enforcer's Reporter (what it shows), Runtime (what may change while it runs)
    and the Swapper (`convgpu swap out/in`)."""

    def __init__(self, reporter, runtime, swapper=None):
        self.reporter, self.runtime, self.swapper = reporter, runtime, swapper

    def handle(self, peer: Peer, msg: dict):
        cmd = msg.get("cmd")
        fn = getattr(self, "cmd_" + str(cmd).replace("-", "_"), None)
        if fn is None:
            return {"ok": False, "error": f"unknown command {cmd!r}"}
        try:
            reply = {"ok": True, **fn(msg)}
            if FAULT and cmd in ("limit-set", "register", "pod-limits", "claim-prepare"):
                FAULT.hit("ack")   # durable and applied, not yet acknowledged
            return reply
        except ConvgpuError as e:
            return {"ok": False, "error": str(e)}

    def cmd_ping(self, msg):
        return {"pid": self.reporter.status()["pid"]}

    def cmd_status(self, msg):
        return {"status": self.reporter.status()}

    def cmd_snapshot(self, msg):
        pids = msg.get("pids") or None
        if pids is not None and not (isinstance(pids, list) and all(isinstance(p, int) for p in pids)):
            raise ConvgpuError(f"invalid pids {pids!r}", "give a list of process ids")
        container = msg.get("container")
        return self.reporter.snapshot(set(pids) if pids else None, str(container) if container else None)

    def cmd_limit_set(self, msg):
        name = msg.get("container")
        size = parse_size(msg.get("size"), "limit")
        if size == 0:
            raise ConvgpuError("a limit of 0 B lets the container allocate nothing, and its first CUDA call waits",
                               "give a size, e.g. 4GiB")
        try:
            name, limit = self.runtime.set_limit(str(name), size, force=msg.get("force") is True)
        except KeyError:
            raise ConvgpuError(f"no container {name!r} is known to the enforcer",
                               "see `convgpu status` for names and ids") from None
        warning = self.runtime.context_warning(f"the limit of {name}", limit)
        return {"container": name, "limit": limit, "message": f"limit of {name} set to {format_size(limit)}",
                **({"warning": warning} if warning else {})}

    def cmd_reload(self, msg):
        if not self.runtime.reload():
            raise ConvgpuError(f"reload failed, the last good config stays: {self.runtime.reload_error}",
                               "fix it and run `convgpu reload` again")
        return {}

    def cmd_register(self, msg):
        cgroup = msg.get("cgroup")
        if not isinstance(cgroup, str) or not cgroup.startswith("/"):
            raise ConvgpuError(f"invalid cgroup {cgroup!r}", "give a cgroup path starting with /")
        limit = parse_size(msg.get("limit"), "--limit")
        name = msg.get("name")
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= 64):
            raise ConvgpuError(f"invalid name {str(name)[:80]!r}", "give a name of 1 to 64 characters")
        if len(cgroup) > 4096:
            raise ConvgpuError("invalid cgroup (longer than a path)", "give a cgroup path")
        capped = self.runtime.books.capped(name or cgroup, limit)
        self.runtime.register_run(cgroup, capped, name or None)
        warning = self.runtime.context_warning(f"--limit of {name or cgroup}", capped)
        return {"warning": warning} if warning else {}

    def cmd_pod_limits(self, msg):
        """The Kubernetes agent's limits (kube/pods.py): {container id or pod uid: [bytes, source]}."""
        from .podlimits import apply
        return apply(self.runtime, msg.get("limits"))

    def cmd_claim_prepare(self, msg):
        """The DRA plugin's prepared claims (kube/dra.py, serving/claimlimits.py): those of one
        Prepare, or one claim."""
        from .claimlimits import prepare, prepare_all
        if "claims" in msg:
            return prepare_all(self.runtime, msg.get("claims"), msg.get("deadline"))
        return prepare(self.runtime, msg.get("uid"), msg.get("claim"))

    def cmd_claim_unprepare(self, msg):
        from .claimlimits import unprepare
        return unprepare(self.runtime, msg.get("uids", msg.get("uid")))

    def cmd_claim_containers(self, msg):
        from .claimlimits import containers
        return containers(self.runtime, msg.get("containers"))

    def cmd_claim_list(self, msg):
        """The prepared claims (the DRA plugin reads them back after its restart)."""
        return {"claims": {u: c.wire() for u, c in sorted(self.runtime.durable.value.claims.items())}}


    def _swap_targets(self, msg) -> list[tuple[int, object]]:
        """(pid, its container) for `swap out/in TARGET [--gpu N]`: a container's name or id (every
        CUDA process of it), or one pid."""
        target, gpu = str(msg.get("target", ""))[:4096], msg.get("gpu")
        if gpu is not None and not isinstance(gpu, int):
            raise ConvgpuError(f"invalid gpu {gpu!r}", "give a GPU index")
        books = self.runtime.books
        if target.isdigit() and int(target) in books.pid_box:
            pairs = [(int(target), books.pid_box[int(target)])]
        else:
            try:
                box = books.find(target)
            except KeyError:
                raise ConvgpuError(f"no container or CUDA process {target!r} is known to the enforcer",
                                   "see `convgpu status` for names, ids and pids") from None
            pairs = [(p, box) for p in sorted(box.pids)]
        return [(p, b) for p, b in pairs if gpu is None or gpu in b.assigned]

    def cmd_swap_out(self, msg):
        """Every CUDA process of the target (on --gpu N) out to host memory (enforcer/swap/)."""
        if self.swapper is None:
            raise ConvgpuError("swap is not part of this enforcer", "run `convgpu doctor`")
        started, why = [], []
        for pid, box in self._swap_targets(msg):
            w = self.swapper.out(pid, "by hand")
            (why.append(f"pid {pid}: {w}") if w else started.append(pid))
        if not started:
            raise ConvgpuError(f"nothing swapped out ({'; '.join(why) or 'no CUDA process'})",
                               "see `convgpu status` (gpus.N.swap says whether swap is on)")
        return {"pids": started, "message": f"swapping out pids {', '.join(map(str, started))}"
                + (f" ({'; '.join(why)})" if why else "")}

    def cmd_swap_in(self, msg):
        """Every swapped process of the target waits for its footprint: the policy grants it."""
        if self.swapper is None:
            raise ConvgpuError("swap is not part of this enforcer", "run `convgpu doctor`")
        out = [p for p, _ in self._swap_targets(msg) if p in self.swapper.procs]
        if not out:
            raise ConvgpuError(f"nothing of {msg.get('target')!r} is swapped out", "see `convgpu status`")
        for pid in out:
            self.swapper.want(pid, "by hand")
        return {"pids": out, "message": f"pids {', '.join(map(str, out))} wait for their memory back"}


def answers(path: str) -> bool:
    """An enforcer answers a ping on this control socket."""
    try:
        request(path, {"cmd": "ping"}, timeout=2)
        return True
    except (OSError, ValueError):
        return False
