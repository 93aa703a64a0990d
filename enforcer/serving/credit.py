"""Credit pages: what a shim process may allocate without asking (layout and protocol:
shim/credit.h). A request/reply with this Python process costs ~70 us per allocation on the
H100 (docs/BENCHMARKS.md); taking from credit costs one compare-and-swap in the shim.

Each shim process gets one page, a sealed memfd passed with the hello reply (it can neither
shrink nor grow it, so touching it never faults here). The broker gives credit after a grant
and takes every unspent byte back before any other request of the same container is decided,
so credit never stands between a container's processes, and never leaves the container's own
assignment. What a process writes into its own page can only hurt itself: a take-back is
clamped to what was given (enforcer/serving/broker.py)."""
import ctypes as ct
import fcntl
import glob
import mmap
import os
import secrets
from collections import defaultdict

from ... import __file__ as _package
from ...errors import PrerequisiteError

HEADER = 3          # id, dev_page, small (credit.h)
DEVICES = 64        # CREDIT_DEVICES
_lib = None


def _atomics():
    global _lib
    if _lib is None:
        found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(_package)), "libcredit*.so")))
        if not found:
            raise PrerequisiteError("libcredit.so is not built in the package",
                                    "reinstall the package (scripts/setup.sh builds it)")
        _lib = ct.CDLL(found[0])
        _lib.convgpu_credit_give.argtypes = [ct.c_void_p, ct.c_uint64]
        _lib.convgpu_credit_take_all.argtypes = [ct.c_void_p]
        _lib.convgpu_credit_take_all.restype = ct.c_uint64
    return _lib


class CreditPage:
    def __init__(self, dev_page: int, small: int):
        self.lib = _atomics()
        self.fd = os.memfd_create("convgpu-credit", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, mmap.PAGESIZE)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self.mm = mmap.mmap(self.fd, mmap.PAGESIZE)
        self.words = (ct.c_uint64 * (HEADER + DEVICES)).from_buffer(self.mm)
        self.base = ct.addressof(self.words)
        self.id = secrets.randbits(63) | 1
        self.words[1], self.words[2], self.words[0] = dev_page, small, self.id

    def _word(self, dev: int) -> int:
        if not 0 <= dev < DEVICES:
            raise ValueError(f"GPU{dev}: credit pages cover GPUs 0-{DEVICES - 1}")
        return self.base + 8 * (HEADER + dev)

    def give(self, dev: int, n: int):
        self.lib.convgpu_credit_give(self._word(dev), n)

    def take_all(self, dev: int) -> int:
        return self.lib.convgpu_credit_take_all(self._word(dev))

    def unspent(self, dev: int) -> int:
        return self.words[HEADER + dev]

    def close(self):
        del self.words      # the mmap cannot close while a ctypes view of it lives
        self.mm.close()
        os.close(self.fd)


class ShimCredit:
    """What shim processes were granted and have not reported allocating yet (*pending*: BPF
    has not charged it), and their credit pages. Handed the books (each process's container,
    what a container needs: Books.demand). Credit never stands between a container's processes:
    every unspent byte of a container comes back (`revoke`) before any other request of it is
    decided (serving/broker.py), and before its limit changes (enforcer/runtime.py)."""

    def __init__(self, books):
        self.books = books
        self.pending: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # pid -> dev -> bytes
        self.pages: dict[int, CreditPage] = {}    # pid -> its credit page

    def page(self, pid: int, dev_page: int, small: int) -> CreditPage:
        page = self.pages.get(pid)
        if page is None:
            page = self.pages[pid] = CreditPage(dev_page, small)
        return page

    def hold(self, box, pid: int, dev: int, size: int):
        box.shim_pending[dev] = box.shim_pending.get(dev, 0) + size
        self.pending[pid][dev] += size

    def give(self, box, pid: int, dev: int):
        """After a grant: half of what the container has left on dev, for the next allocations."""
        page = self.pages.get(pid)
        extra = (box.assigned[dev] - self.books.demand(box, dev)) // 2
        if page is not None and dev not in box.waiting and extra > 0:
            self.hold(box, pid, dev, extra)
            page.give(dev, extra)

    def revoke(self, box, dev: int):
        """Takes back every unspent byte of credit of box's processes on dev."""
        for pid in box.pids & self.pages.keys():
            left = self.pages[pid].take_all(dev)
            if left:
                self.settle(pid, dev, left)   # clamped: the page is the process's to scribble on

    def unspent(self, box, dev: int) -> int:
        return sum(self.pages[pid].unspent(dev) for pid in box.pids & self.pages.keys())

    def settle(self, pid: int, dev: int, size: int):
        """`size` bytes of pid's pending were allocated (charged by now) or given back."""
        box = self.books.pid_box.get(pid)
        held = self.pending[pid][dev]
        take = min(held, size)
        self.pending[pid][dev] = held - take
        if box is not None:
            box.shim_pending[dev] = max(0, box.shim_pending.get(dev, 0) - take)

    def drop(self, pid: int):
        """pid's shim process is gone: its page closes, its pending bytes leave its container."""
        page = self.pages.pop(pid, None)
        if page is not None:
            page.close()
        for dev, held in self.pending.pop(pid, {}).items():
            box = self.books.pid_box.get(pid)
            if box is not None:
                box.shim_pending[dev] = max(0, box.shim_pending.get(dev, 0) - held)
