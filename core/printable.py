"""Text from tenants, shown. Process names (a process sets its own: PR_SET_NAME), container and
unit names, labels, job, pod and claim names, paths: whoever starts a container chooses them, and
a terminal obeys the control characters among them. Issue 47 finding 6: a process named
`\\x1b]0;PWNED\\x07\\x1b[8m` set the terminal's title from `convgpu trace` and made the lines after
it invisible. printable() is the one function every view, table, message and log line shows such
text through (cli/view.py `text`, cli/common.py's log formatter and `fail`); JSON outputs escape
control characters by JSON's own rules."""
import re

# C0 controls (ESC, BEL, CR, LF, ...), DEL and C1 controls (0x9b is a CSI by itself on some
# terminals), and the bidirectional controls that reorder what is shown around them
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text) -> str:
    """text with every control character escaped as Python writes it (`\\x1b`, `\\u202e`);
    everything else (letters of any script, `\\`, markup) as it is."""
    return _UNSHOWN.sub(_escape, str(text))
