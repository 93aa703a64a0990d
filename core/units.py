"""Sizes: parse what operators type, print what they read.

Decision (the issues are silent): K/M/G/T and KiB/MiB/GiB/TiB are binary (docker's `-m 1g` is
1 GiB, and GPU memory is sold in GiB); KB/MB/GB/TB are decimal, as SI says. Bare numbers are
bytes. Anything else is an error naming the value and the accepted forms."""
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


def parse_size(text, what: str = "size") -> int:
    """'1GiB' -> 1073741824. Raises SizeError (one line, with the fix) for anything else."""
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
        value = int(value)
    if value < 0 or value > MAX_SIZE:
        raise SizeError(f"invalid {what} {text!r}: out of range", _FORMS)
    return value


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
