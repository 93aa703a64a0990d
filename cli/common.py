"""What every command shares: logging set-up and the one place errors become output."""
import functools
import logging
import sys

import typer
from rich.console import Console
from rich.logging import RichHandler

from ..errors import ConvgpuError

err_console = Console(stderr=True)
state = {"debug": False}


def setup_logging(verbose: bool = False, debug: bool = False) -> None:
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    if sys.stderr.isatty():
        handler: logging.Handler = RichHandler(console=err_console, show_path=False)
        fmt = "%(message)s"
    else:   # daemons and pipes: plain lines
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger("convgpu")
    root.handlers[:] = [handler]
    root.setLevel(level)


def decisions_visible() -> None:
    """Daemons log one line per decision: at least INFO, whatever --verbose says."""
    log = logging.getLogger("convgpu")
    if log.level > logging.INFO or log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def fail(message: str) -> "typer.Exit":
    err_console.print(f"[bold red]convgpu:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def handle_errors(fn):
    """Domain errors -> one line with the remedy, exit 1; tracebacks only with --debug."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConvgpuError as e:
            if state["debug"]:
                raise
            raise fail(str(e)) from None
    return wrapper
