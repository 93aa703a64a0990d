"""The live view's terminal: sized to the terminal at each refresh (cli/view.py render fits it),
and `q` ends it as Ctrl-C does (issue 52: `q` did nothing). The keyboard is read only where
stdin is a terminal, in cbreak mode (keys come one at a time, without echo; Ctrl-C still sends
SIGINT), and the terminal is put back as it was however the view ends."""
import os
import select
import sys
import termios
import time
import tty

from rich.console import Console
from rich.live import Live

from .view import WIDTH, render

QUIT_KEYS = b"qQ"


class Keys:
    """quit(timeout): waits up to timeout seconds for a key; True once `q` was pressed."""

    def __init__(self):
        try:
            self.fd = sys.stdin.fileno()
        except (AttributeError, ValueError, OSError):   # closed, or not a file (typer's CliRunner)
            self.fd = -1
        self.saved = None
        self.pressed = False

    def __enter__(self):
        try:
            if self.fd >= 0 and os.isatty(self.fd):
                self.saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd, termios.TCSANOW)
        except (OSError, termios.error):
            self.saved = None
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def quit(self, timeout: float = 0.0) -> bool:
        """Sleeps up to `timeout` (less if a key comes); True if `q` was pressed so far."""
        if self.saved is None:   # not a terminal: nothing to read
            if timeout > 0:
                time.sleep(timeout)
            return self.pressed
        end = time.monotonic() + timeout
        while not self.pressed:
            left = max(0.0, end - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                break
            try:
                got = os.read(self.fd, 32)
            except OSError:
                break
            if not got:        # the terminal is gone
                self.pressed = True
            self.pressed |= any(k in QUIT_KEYS for k in got)
        return self.pressed


class View:
    """rich's Live over the terminal, each frame rendered to its size at that moment."""

    def __init__(self):
        self.console = Console()
        self.live = None

    def frame(self, snap, alert: str | None = None):
        """Fitted to a terminal's height; into a pipe or a file, whole (nothing to scroll off)."""
        w, h = self.console.size
        height = max(h - 1, 10) if self.console.is_terminal else None
        return render(snap, width=min(WIDTH, w), height=height, alert=alert)

    def __enter__(self):
        self.live = Live(console=self.console, refresh_per_second=4, screen=False, auto_refresh=False)
        self.live.__enter__()
        return self

    def update(self, snap, alert: str | None = None):
        self.live.update(self.frame(snap, alert), refresh=True)

    def __exit__(self, *exc):
        return self.live.__exit__(*exc)
