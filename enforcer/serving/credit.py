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
