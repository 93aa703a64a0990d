"""The child that makes the driver's checkpoint calls for the enforcer (issue 46). The enforcer
never loads the driver or makes a context itself; this child loads the host's own driver (the
path the enforcer trusts: never a file a container supplies), calls cuInit(0) (the driver's
restore needs it in the caller, or persistence mode), and then, one request a line on stdin,
answers one JSON line each on stdout:

    {"op": "lock", "pid": P, "timeout_ms": T}  ->  {"rc": CUresult, "state": S, "s": seconds}
    ops: state, lock, checkpoint, restore, unlock

state: CUprocessState after the call (0 running, 1 locked, 2 checkpointed, 3 failed; -1: not
asked). A call of the driver may take long (a 44 GiB checkpoint: 34 s on an H100) or never
return (a lock of a process that cannot run: FACTS.md): the enforcer's side (client.py) has its
own deadline and kills this child then.

    python -m convgpu.enforcer.swap.agent DRIVER                  serve requests
    python -m convgpu.enforcer.swap.agent DRIVER --release FILE   what a dead enforcer swapped

--release (the watchdog's, failsafe/watchdog.py): no process is left locked with nobody to
unlock it. Each process FILE lists (pid and start time, as the enforcer kept them) that is
locked is unlocked; one checkpointed is restored and unlocked once NVML shows its bytes free on
its GPU (a restore without the room left it beyond saving on driver 580: FACTS.md); until none
is left, or SIGTERM (a successor took over). Stdlib, ctypes and pynvml only."""
import ctypes
import json
import os
import signal
import sys
import time

CALLS = ("cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
         "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")
RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
MARGIN = 256 << 20    # --release: NVML's free memory must exceed a restore's bytes by this


class LockArgs(ctypes.Structure):    # CUcheckpointLockArgs (cuda.h 12.8+)
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class Reserved(ctypes.Structure):    # CUcheckpointCheckpointArgs, CUcheckpointUnlockArgs
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class RestoreArgs(ctypes.Structure):  # CUcheckpointRestoreArgs: no GPU remapped
    _fields_ = [("gpuPairs", ctypes.c_void_p), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))), ("reserved1", ctypes.c_uint64)]


class Driver:
    def __init__(self, path: str):
        self.cu = ctypes.CDLL(path)
        missing = [c for c in CALLS if not hasattr(self.cu, c)]
        if missing:
            raise RuntimeError(f"the driver has no checkpoint API ({', '.join(missing)} missing: a driver "
                               "older than CUDA 12.8's)")
        rc = self.cu.cuInit(0)
        if rc:
            raise RuntimeError(f"cuInit returned CUresult {rc}")

    def state(self, pid: int) -> int:
        s = ctypes.c_int(-1)
        rc = self.cu.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(s))
        return s.value if rc == 0 else -1

    def call(self, op: str, pid: int, timeout_ms: int = 0) -> int:
        p = ctypes.c_int(pid)
        if op == "lock":
            return self.cu.cuCheckpointProcessLock(p, ctypes.byref(LockArgs(timeoutMs=timeout_ms)))
        if op == "checkpoint":
            return self.cu.cuCheckpointProcessCheckpoint(p, ctypes.byref(Reserved()))
        if op == "restore":
            return self.cu.cuCheckpointProcessRestore(p, ctypes.byref(RestoreArgs()))
        if op == "unlock":
            return self.cu.cuCheckpointProcessUnlock(p, ctypes.byref(Reserved()))
        if op == "state":
            return 0
        raise ValueError(op)


def serve(drv: Driver):
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            t0 = time.monotonic()
            rc = drv.call(req["op"], int(req["pid"]), int(req.get("timeout_ms", 0)))
            out = {"rc": rc, "state": drv.state(int(req["pid"])), "s": round(time.monotonic() - t0, 3)}
        except Exception as e:   # a request we cannot read: said, never a crash
            out = {"rc": -1, "state": -1, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


def start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def free_on(dev: int) -> int:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(dev)).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def release(drv: Driver, path: str, every: float = 1.0) -> int:
    """Unlock what is locked, restore what fits; until nothing is left or SIGTERM."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        with open(f"{path}.pid", "w") as f:   # a successor stops us (swapper._stop_release)
            f.write(str(os.getpid()))
    except OSError:
        pass
    try:
        with open(path) as f:
            left = {int(k): v for k, v in json.load(f).get("procs", {}).items()}
    except (OSError, ValueError):
        return 0
    done = 0
    while left and not stop:
        for pid, rec in list(left.items()):
            if start_time(pid) != rec.get("start"):
                del left[pid]        # gone: its host copy went with it
                continue
            st = drv.state(pid)
            if st == LOCKED:
                rc = drv.call("unlock", pid)
                print(f"convgpu swap release: pid {pid} unlocked (CUresult {rc})", file=sys.stderr, flush=True)
            elif st == CHECKPOINTED:
                need = sum(rec.get("bytes", {}).values())
                dev = int(next(iter(rec.get("bytes", {"0": 0}))))
                if free_on(dev) < need + MARGIN:
                    continue          # not yet: a restore without the room is fatal
                rc = drv.call("restore", pid)
                if rc == 0:
                    rc = drv.call("unlock", pid)
                print(f"convgpu swap release: pid {pid} restored and unlocked (CUresult {rc})", file=sys.stderr,
                      flush=True)
            else:
                del left[pid]
                continue
            if drv.state(pid) == RUNNING:
                del left[pid]
                done += 1
        if left and not stop:
            time.sleep(every)
    return done


def main() -> int:
    args = sys.argv[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        drv = Driver(args[0])
    except Exception as e:
        print(json.dumps({"ready": False, "why": str(e)}), flush=True)
        return 1
    if len(args) == 3 and args[1] == "--release":
        release(drv, args[2])
        return 0
    serve(drv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
