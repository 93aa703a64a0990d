"""Discovery by identity (issue 33, principle 1; probes/nodes.py says why): a process BPF stopped
at its open of a GPU device node has the files it maps executable looked at on the reader
thread; each that exports a driver entry point and is new is queued like an opened copy (read,
attached, counted toward its container's copies), and the process goes on once every driver it
maps is probed, or is held by --unprobed. Then BPF's `checked` gets the count of executable
mappings seen before the look, so its next open of a node passes unless it mapped code since."""
import ctypes as ct
import logging
import os
from dataclasses import dataclass

from . import nodes
from .libs import Library
from .table import CUDA

log = logging.getLogger(__name__)


@dataclass
class Check:
    key: int            # pid_tgid of the thread stopped at its open
    gen: int            # exec_gen when the look began
    container: str
    future: object


class _Known:
    """What discovery has already (probed, failed or queued), as the reader thread asks it."""

    def __init__(self, d):
        self.d = d

    def __contains__(self, inode) -> bool:
        return inode in self.d.tracer.finder.known or inode in self.d.pending


class Identity:
    def __init__(self, discovery):
        self.d = discovery
        self.checks: list[Check] = []
        self.gens: dict[int, int] = {}       # key -> exec_gen its check saw (written once it goes on)
        self.plain = nodes.Plain()
        self.stops = 0
        self._skip = None

    def skip(self) -> frozenset:
        """Inodes never taken for a driver: convgpu's own shim libraries (the package's and the
        copy pods mount: Tracer.shims, set by the enforcer), whose wrappers export the driver's
        names and call the (probed) driver."""
        from ..paths import shim_library
        paths = tuple(self.d.tracer.shims) or (shim_library(),)
        if self._skip is None or self._skip[0] != paths:
            inodes = set()
            for path in paths:
                try:
                    st = os.stat(path) if path else None
                except OSError:
                    st = None
                if st:
                    inodes.add((st.st_dev, st.st_ino))
            self._skip = (paths, frozenset(inodes))
        return self._skip[1]

    def opened(self, pid: int, tid: int, fd: int, container: str) -> None:
        """BPF stopped thread tid of pid at its open of a GPU node (fd): look at what it maps."""
        self.stops += 1
        self.d.recent.append(pid)
        if not self.d.held.still(pid << 32 | tid, fd):   # let go meanwhile: its next open is looked at
            return
        try:
            gen = self.d._map("exec_gen")[ct.c_uint32(pid)].value   # before the look: see nodes.py
        except KeyError:
            gen = 0          # the map was full: never marked checked, so every open is looked at
        key = pid << 32 | tid
        if self.d.spent.over(container):
            self.d.hold(key, f"pid {pid}", "its container's checks took their reading budget", container)
            return
        self.checks.append(Check(key, gen, container,
                                 self.d.reader.submit(nodes.check, pid, _Known(self.d), self.plain, self.skip())))

    def work(self) -> int:
        """From the loop: finished looks become queued copies, holds or resumes."""
        done = [c for c in self.checks if c.future.done()]
        for c in done:
            self.checks.remove(c)
            self.d.spent.add(c.container, getattr(c.future, "took", 0.0))
            pid = c.key >> 32
            err = c.future.exception()
            if err is not None:
                self.d.hold(c.key, f"pid {pid}", f"its mapped code cannot be checked: {err}", c.container)
                continue
            drivers, plain = c.future.result()
            self.plain.add(plain)
            self.gens[c.key] = c.gen
            waits = []
            for inode, rng, fd in drivers:
                waits.append(inode)
                self.d.openers.setdefault(inode, set()).add(pid)
                if inode in self.d.pending or inode in self.d.tracer.finder.known:
                    os.close(fd)
                    if inode in self.d.pending:
                        self.d.pending[inode].keys.append(c.key)
                    continue
                path = f"/proc/{pid}/map_files/{rng}"
                try:
                    seen_as = os.readlink(path)
                except OSError:
                    seen_as = path
                self.d.tracer.say(logging.WARNING, (c.container, "identity"),
                                  "pid %d opened the GPU and maps %s, which exports the driver's entry points "
                                  "under another name: probed before it goes on", pid, seen_as)
                self.d.enqueue(Library(CUDA, path, inode, seen_as, fd), c.key)
            failed = next((i for i in waits if i not in self.d.pending and self.d.tracer.failure(i)), None)
            if failed is not None:
                self.d._settle(failed, [c.key])     # --unprobed decides, with the copy's reason
            elif not any(c.key in p.keys for p in self.d.pending.values()):
                self.going_on(c.key)
                self.d.held.resume(c.key)
        return len(done)

    def going_on(self, key: int) -> None:
        """key is resumed with every driver it maps probed: its next node open passes, until it
        maps more code (BPF counts that in exec_gen)."""
        gen = self.gens.pop(key, 0)
        if gen:
            try:
                self.d._map("checked")[ct.c_uint32(key >> 32)] = ct.c_uint64(gen)
            except (KeyError, OSError):   # full: its opens are looked at every time
                pass

    def forget(self, key: int) -> None:
        self.gens.pop(key, None)

    def clear(self) -> None:
        self.checks.clear()
        self.gens.clear()
