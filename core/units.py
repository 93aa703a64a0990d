"""Sizes: parse what operators type, print what they read.

Decision (the issues are silent): K/M/G/T and KiB/MiB/GiB/TiB are binary (docker's `-m 1g` is
1 GiB, and GPU memory is sold in GiB); KB/MB/GB/TB are decimal, as SI says. What an operator
types needs a unit (issue 52: `--gpu-memory 4` started with a capacity of 4 bytes): a bare
number other than 0 is an error naming what was probably meant, and bytes are written `4096B`.
Where a bare number means bytes by another's convention (a Kubernetes quantity, a container's
label), callers say bare=True. Anything else is an error naming the value and the accepted forms."""
import math
import re

from .errors import SizeError

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
MAX_SIZE = 1 << 62  # far above any GPU, and fits the BPF maps' u64 with room for sums
_FORMS = "use bytes or a number with K/M/G/T, KiB/MiB/GiB/TiB (binary) or KB/MB/GB/TB (decimal), e.g. 512MiB, 1.5G"


def parse_size(text, what: str = "size", bare: bool = False) -> int:
    """'1GiB' -> 1073741824. Raises SizeError (one line, with the fix) for anything else; a
    string without a unit too (but 0), unless bare (then bytes). An int is bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _RE.match(str(text)) if text is not None else None
        if not m or m.group(2).lower() not in _UNITS:
            raise SizeError(f"invalid {what} {text!r}", _FORMS)
        number = float(m.group(1))
        if not math.isfinite(number):
            raise SizeError(f"invalid {what} {text!r}", _FORMS)
        value = number * _UNITS[m.group(2).lower()]
        if value > MAX_SIZE:
            raise SizeError(f"{what} {text!r} is larger than {format_size(MAX_SIZE)}", "use a realistic size")
        if not m.group(2) and number != 0 and not bare:
            raise SizeError(f"{what} {text!r} has no unit", f"did you mean {_guess(m.group(1), number)}? "
                            "write the unit: B for bytes, or K/M/G/T, KiB/MiB/GiB/TiB, KB/MB/GB/TB")
        value = int(value)
    if value < 0 or value > MAX_SIZE:
        raise SizeError(f"invalid {what} {text!r}: out of range", _FORMS)
    return value


def _guess(digits: str, n: float) -> str:
    """What a bare number most likely meant: a few GiB, some hundreds of MiB, else bytes."""
    if n < 64:
        return f"{digits}GiB"
    if n < 1 << 16:
        return f"{digits}MiB"
    return f"{digits}B ({format_size(n)})"


def format_size(n: int | float | None) -> str:
    """1073741824 -> '1.0 GiB'; short enough for a table column."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_apart(a: int, b: int) -> tuple[str, str]:
    """Two sizes to be compared, printed so that they read apart where they differ (1536 MiB
    and 1500 MiB are both 1.5 GiB): in MiB, or bytes, where format_size makes them one."""
    fa, fb = format_size(a), format_size(b)
    if fa != fb or a == b:
        return fa, fb
    mib = (f"{a / (1 << 20):.0f} MiB", f"{b / (1 << 20):.0f} MiB")
    return mib if mib[0] != mib[1] else (f"{a} B", f"{b} B")


def format_duration(s: float | None) -> str:
    """Seconds as people read them (issue 52: three hours read `10800.0s`): 4.2s, 3m05s,
    3h00m, 2d04h; '-' for None."""
    if s is None:
        return "-"
    if s < 60:
        return f"{max(s, 0.0):.1f}s"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
