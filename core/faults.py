"""Fault points for the kill -9 torture (issue 31, tests/system/test_torture.py, bench/torture.py):
CONVGPU_FAULT=POINT:N[,POINT:N...] makes the enforcer SIGKILL itself the N-th time it reaches
POINT, where a random kill from outside would seldom land:

    place   placing a process: its membership and first assignment written to BPF, its
            waiter not yet recorded (enforcer/events.py _place)
    grant   a grant written to BPF, its waiter not yet resumed (enforcer/decisions.py _grant)
    resume  a waiter's stopped calls being let go, some of them not yet (enforcer/actions.py)
    save    a decision written to its temporary file and fsynced, not yet renamed into place
            (enforcer/tenants/durable.py)
    held    the watchdog's state file about to be replaced (enforcer/reporting.py _save_held)
    ack     a decision made durable and applied, its reply not yet sent (serving/control.py)

Read once, at import. Unset (every real run), FAULT is None and each point costs one test of a
module global: `if FAULT: FAULT.hit("grant")`."""
import os
import signal

POINTS = ("place", "grant", "resume", "save", "held", "ack")


class Faults:
    def __init__(self, spec: str):
        self.left: dict[str, int] = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            point, _, n = item.partition(":")
            if point not in POINTS or not n.isdigit() or int(n) < 1:
                raise ValueError(f"CONVGPU_FAULT {item!r}: give POINT:N with POINT one of {', '.join(POINTS)}")
            self.left[point] = int(n)

    def hit(self, point: str):
        n = self.left.get(point)
        if n is None:
            return
        if n > 1:
            self.left[point] = n - 1
            return
        os.write(2, f"convgpu fault point {point}: SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def _from_env() -> "Faults | None":
    spec = os.environ.get("CONVGPU_FAULT", "")
    return Faults(spec) if spec else None


FAULT = _from_env()
