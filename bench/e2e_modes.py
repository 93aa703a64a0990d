"""The host modes bench.e2e_toggle switches under a running workload, and how it knows that a
switch has happened: each probed entry point of the workload's loaded libcuda/libcudart holds
an int3 (0xCC) while any uprobe is registered on it (the kernel writes the breakpoint into
every process that maps the file), and the original byte again once the last one is gone.
Reading those bytes in /proc/PID/mem is the ground truth of "bare" and "probed" for that very
process: a detach that runs on in a background child (probes/detach.py: 0.1-0.5 s a probe) or
another tracer on the same library cannot pass for bare."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from convgpu.probes.libs import kind_of
from convgpu.probes.loader import import_bcc
from convgpu.probes.prologue import PROLOGUE_BYTES, recheck_site
from convgpu.probes.table import ADMITTED, PROBES

from bench.modes import start_enforcer

INT3 = 0xCC


def _prologue(path: str, pid: int, off: int) -> bytes:
    with open(f"/proc/{pid}/root{path}", "rb") as f:
        f.seek(off)
        return f.read(PROLOGUE_BYTES)


def traced(pid: int) -> bool:
    """Some thread of pid is ptrace-seized (the enforcer's holder: enforcer/failsafe/threadhold.py,
    which polls it every 0.5 ms while it does)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                if any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in f):
                    return True
        except OSError:
            continue
    return False


class Hooks:
    """The entry addresses of the table's symbols in process `pid`'s libcuda and libcudart."""

    def __init__(self, pid: int):
        bcc = import_bcc()
        self.pid = pid
        self.addrs: dict[str, int] = {}
        maps: dict[str, list] = {}
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and "x" in parts[1] and kind_of(parts[5].strip()):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    maps.setdefault(parts[5].strip(), []).append((lo, hi, int(parts[2], 16)))
        for path, spans in maps.items():
            for p in PROBES:
                if p.library != kind_of(path):
                    continue
                try:
                    _, off = bcc.BPF._check_path_symbol(f"/proc/{pid}/root{path}".encode(), p.symbol.encode(), None, -1)
                except Exception:
                    continue   # not exported by this library: never probed
                for lo, hi, moff in spans:
                    if moff <= off < moff + hi - lo:
                        self.addrs[f"{os.path.basename(path)}:{p.symbol}"] = lo + off - moff
                        site = recheck_site(_prologue(path, pid, off)) if p.symbol in ADMITTED else None
                        if site:   # the enforcer's recheck probe (probes/prologue.py: +4 on driver 580)
                            self.addrs[f"{os.path.basename(path)}:{p.symbol}+{site[0]}"] = lo + off - moff + site[0]
        if not any(k.endswith(":cuMemAlloc_v2") for k in self.addrs):
            raise SystemExit(f"process {pid} has no libcuda.so.1 with cuMemAlloc_v2 mapped")

    def hooked(self) -> set[str]:
        """The entry points that hold a breakpoint now."""
        out = set()
        with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as mem:
            for name, addr in self.addrs.items():
                mem.seek(addr)
                if mem.read(1)[0] == INT3:
                    out.add(name)
        return out

    def wait(self, probed: bool, timeout: float) -> float:
        """Until cuMemAlloc_v2 is hooked (probed) or nothing is (bare); the seconds it took."""
        t0 = time.monotonic()
        while True:
            h = self.hooked()
            if (any(k.endswith(":cuMemAlloc_v2") for k in h)) if probed else not h:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                state = f"still hooked: {', '.join(sorted(h))}" if h else "nothing hooked"
                raise SystemExit(f"pid {self.pid} not {'probed' if probed else 'bare'} after {timeout:.0f} s "
                                 f"({state}); another tracer or enforcer on this library?")
            time.sleep(0.02)


class Control:
    """The workload's injected delay (bench/e2e_workloads.py: an mmapped int64 of ns)."""

    def __init__(self):
        fd, self.path = tempfile.mkstemp(prefix="convgpu-e2e-")
        os.write(fd, b"\0" * 8)
        os.close(fd)

    def set(self, ns: int) -> None:
        with open(self.path, "r+b") as f:
            f.write(int(ns).to_bytes(8, "little", signed=True))

    def close(self):
        os.unlink(self.path)


class Mode:
    """bare: nothing runs. delay: the workload busy-waits `delay_ns` per step (the known truth).
    probed: `convgpu trace --json --no-events --pid PID`, ready at its first snapshot, whose
    per-process `allocs` give the driver allocation rate. enforced: `convgpu enforce` as
    bench/modes.py starts it (64 GiB capacity, 60 GiB default limit: the workload stays under
    it and nothing stalls), ready at its "enforcing:" line."""

    def __init__(self, name: str, pid: int, libs: tuple, standin: bool, control: Control, delay_ns: int = 0,
                 place_timeout: float = 3.0):
        self.name, self.pid, self.libs, self.standin = name, pid, libs, standin
        self.control, self.delay_ns = control, delay_ns
        self.proc = None
        self.run_dir = None
        self.snaps: list = []   # (monotonic ns of receipt, the workload's allocs so far)
        self.info: dict = {}
        self.place_timeout = place_timeout

    @property
    def probes(self) -> bool:
        return self.name in ("probed", "enforced")

    def start(self) -> None:
        if self.name == "delay":
            self.control.set(self.delay_ns)
        elif self.name == "probed":
            self.snaps = []
            nowhere = tempfile.mkdtemp(prefix="convgpu-e2e-run-")   # no enforcer answers there
            argv = [sys.executable, "-P", "-m", "convgpu.cli.main", "trace", "--json", "--no-events",
                    "--interval", "0.5", "--pid", str(self.pid), "--run-dir", nowhere]
            argv += (["--no-discover", "--demo", "never"] if self.standin else []) + [f"--lib={x}" for x in self.libs]
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            first = self.proc.stdout.readline()
            if not first:
                raise SystemExit(f"convgpu trace ended before its first snapshot (exit {self.proc.wait()})")
            self._snap(first)
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        elif self.name == "enforced":
            self.proc, self.run_dir = start_enforcer(self.libs, self.standin)
            self.info = {"placed_s": self._placed(self.place_timeout)}
        elif self.name != "bare":
            raise SystemExit(f"unknown mode {self.name!r}: bare, delay, probed, enforced")

    def _snap(self, line: str) -> None:
        now = time.monotonic_ns()
        try:
            s = json.loads(line)
        except ValueError:
            return
        rows = [p for c in s.get("containers", []) for p in c["processes"] if p["pid"] == self.pid]
        self.snaps.append((now, sum(p["allocs"] for p in rows)))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._snap(line)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is not None:
            self.proc = None   # it ended by itself (failed to start)
        if self.name == "delay":
            self.control.set(0)
        elif self.name == "enforced" and self.proc:
            self.info.update(self._status())
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)
        elif self.name == "probed" and self.proc:
            t, end = time.monotonic_ns(), time.monotonic() + 5
            while self.snaps[-1][0] < t and time.monotonic() < end and self.proc.poll() is None:
                time.sleep(0.05)   # one snapshot after the block (SIGINT prints none): the count's end
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=120)
        self.proc = None

    def _placed(self, timeout: float) -> float | None:
        """Seconds until the enforcer lists the workload in a container (its first admitted call
        stops it until then: ENFORCE.md, "Placement"); None if it made no such call meanwhile
        (a caching allocator that allocates nothing new is never placed, and never stopped)."""
        from convgpu.cli import common
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                st = common.control(self.run_dir, {"cmd": "status"})["status"]
            except Exception:
                st = {"containers": []}
            if any(self.pid in c.get("pids", ()) and not any(g["waiting"] for g in c["gpus"].values())
                   for c in st["containers"]):
                return time.monotonic() - t0
            time.sleep(0.05)
        return None

    def _status(self) -> dict:
        """Where the enforcer placed the workload: container, limit, used, stalls."""
        from convgpu.cli import common
        try:
            st = common.control(self.run_dir, {"cmd": "status"})["status"]
        except Exception as e:
            return {"status_error": str(e)}
        return {"containers": [{"name": c["name"], "limit": c["limit"], "stalls": c["stalls"],
                                "used": sum(g["used"] for g in c["gpus"].values())} for c in st["containers"]]}

    def traced(self, w) -> dict:
        """Driver allocations the tracer counted for the workload between its first and last
        snapshot, beside the workload's own count over the same span (the stand-in's: they
        must agree), and the rate."""
        if len(self.snaps) < 2 or self.snaps[-1][0] == self.snaps[0][0]:
            return {}
        (t0, a0), (t1, a1) = self.snaps[0], self.snaps[-1]
        out = {"traced_allocs": a1 - a0, "alloc_rate": (a1 - a0) / ((t1 - t0) / 1e9)}
        own = w.allocs_at(t1) - w.allocs_at(t0)
        if own:
            out["own_allocs"] = own
        return out
