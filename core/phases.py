"""Where a command's start goes, from the exec of its process (bench/startup.py reads the
line the CLI logs once the start is done: `start: 0.62 s from exec: imports 0.25, ...`).

mark(name) ends a phase (it lasted since the previous mark, the first since the exec);
timed(name) adds to a part of the current phase (attach, self-test), shown in brackets."""
import contextlib
import os
import time

_marks: list[tuple[str, float]] = []
_parts: dict[str, float] = {}
_notes: dict[str, str] = {}


def since_exec() -> float:
    """Seconds since this process was created (the kernel's start time, in 10 ms ticks)."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22, starttime
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start / os.sysconf("SC_CLK_TCK")


def mark(name: str, note: str = "") -> None:
    _marks.append((name, since_exec()))
    if note:
        _notes[name] = note


@contextlib.contextmanager
def timed(name: str):
    t0 = time.monotonic()
    try:
        yield
    finally:
        _parts[name] = _parts.get(name, 0.0) + time.monotonic() - t0


def summary() -> dict:
    """{"total": s, "phases": {name: s}, "parts": {name: s}, "notes": {name: text}}."""
    phases, last = {}, 0.0
    for name, at in _marks:
        phases[name] = phases.get(name, 0.0) + max(0.0, at - last)
        last = at
    return {"total": last, "phases": phases, "parts": dict(_parts), "notes": dict(_notes)}


def line() -> str:
    s = summary()
    out = []
    for name, secs in s["phases"].items():
        note = s["notes"].get(name, "")
        out.append(f"{name} {secs:.2f}" + (f" ({note})" if note else ""))
    parts = ", ".join(f"{n} {v:.2f}" for n, v in s["parts"].items())
    return f"start: {s['total']:.2f} s from exec: " + ", ".join(out) + (f"; of which {parts}" if parts else "")
