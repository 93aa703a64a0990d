"""What every command shares: logging set-up and the one place errors become output."""
import functools
import logging
import os
import signal
import sys

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from ..errors import ConvgpuError, EnforcerUnreachable
from ..printable import printable

err_console = Console(stderr=True)
state = {"debug": False}


_stopping: list[int] = []


def stop_on_signals(interrupt: bool = True) -> None:
    """SIGINT, SIGTERM and SIGHUP (its terminal went away) end a long-running command through
    its finally blocks (resume what is stopped, detach, stop the demo's containers). Once:
    repeats never interrupt the clean-up. The loops call check_stop() after each poll: bcc
    delivers events in a ctypes callback, which prints and drops an exception raised there, so
    a KeyboardInterrupt from the handler alone can be lost. interrupt=False (the enforcer)
    only leaves the flag: no event is ever handled halfway, and the loop sees it within a tick."""
    def handler(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        _stopping.append(signum)
        if interrupt:
            raise KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def hold_signals() -> None:
    """From here on SIGINT, SIGTERM and SIGHUP only leave the flag: a clean-up (the demo's
    containers, probes) runs to its end. A command that ended by --duration has no handler
    that ignores them yet, and a `timeout` or a closed terminal then cut its clean-up short."""
    def note(signum, frame):
        _stopping.append(signum)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, note)


def stopped_by(sig: int) -> bool:
    """The command is ending because of this signal (the enforcer hands over at a SIGTERM)."""
    return sig in _stopping


def check_stop(*_) -> None:
    """Raise the KeyboardInterrupt that a ctypes callback may have swallowed."""
    if _stopping:
        raise KeyboardInterrupt


class PrintableFormatter(logging.Formatter):
    """Log lines name containers, processes, paths and units, which tenants choose: each
    message is printable (control characters escaped: no terminal escape reaches a terminal,
    and no newline makes a line that looks like another), a traceback after it as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


def setup_logging(verbose: bool = False, debug: bool = False) -> None:
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    if sys.stderr.isatty():
        handler: logging.Handler = RichHandler(console=err_console, show_path=False)
        fmt = "%(message)s"
    else:   # daemons and pipes: plain lines
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(PrintableFormatter(fmt))
    root = logging.getLogger("convgpu")
    root.handlers[:] = [handler]
    root.setLevel(level)


def decisions_visible() -> None:
    """Daemons log one line per decision: at least INFO, whatever --verbose says."""
    log = logging.getLogger("convgpu")
    if log.level > logging.INFO or log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def fail(message: str) -> "typer.Exit":
    err_console.print(f"[bold red]convgpu:[/] {escape(printable(message))}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def warn(message: str):
    """A warning: one line on stderr; the command goes on (and exits 0)."""
    err_console.print(f"[bold yellow]convgpu: warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


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


RUN_DIR = "/run/convgpu"
RUN_DIR_HELP = "The enforcer's --run-dir."
NO_BPF_CACHE_HELP = ("Compile the BPF program even where a compile of it is cached (the cache: "
                     "$CONVGPU_BPF_CACHE, default /var/cache/convgpu/bpf; CONVGPU_BPF_CACHE=off: never used).")


def bpf_cache(no_cache: bool) -> str | None:
    """Tracer(bpf_cache=) for --no-bpf-cache."""
    return "off" if no_cache else None


def control(run_dir: str, msg: dict) -> dict:
    """One request to the running enforcer's control socket; its error becomes ours."""
    from ..enforcer.serving.server import request
    path = f"{run_dir.rstrip('/')}/control.sock"
    try:
        reply = request(path, msg)
    except (FileNotFoundError, ConnectionRefusedError):
        from ..enforcer.hostlock import running
        other = running()
        if other.get("run_dir") not in (None, "?", os.path.abspath(run_dir)):
            raise EnforcerUnreachable(f"no enforcer answers on {path}; one runs with --run-dir {other['run_dir']} "
                                      f"(pid {other['pid']})", f"add --run-dir {other['run_dir']}") from None
        raise EnforcerUnreachable(f"no enforcer answers on {path}",
                                  "start one with `convgpu enforce` (or give its --run-dir)") from None
    except PermissionError:
        raise EnforcerUnreachable(f"permission denied on {path}", "run it as root") from None
    except (OSError, ValueError) as e:
        raise EnforcerUnreachable(f"the enforcer on {path} did not answer ({e})", "check its log") from None
    if not reply.get("ok"):
        raise ConvgpuError(reply.get("error", "the enforcer refused the request"))
    return reply


def own_status(run_dir: str) -> dict:
    """The caller's own container, asked over the shim socket (any process may connect; the
    enforcer answers from the kernel's word of who asks: docs/TENANT.md)."""
    from ..enforcer.serving.server import request
    path = os.environ.get("CONVGPU_SHIM_SOCKET") or f"{run_dir.rstrip('/')}/shim/shim.sock"
    try:
        reply = request(path, {"op": "status"})
    except (FileNotFoundError, ConnectionRefusedError):
        raise EnforcerUnreachable(f"no enforcer answers on {path}",
                                  "ask the operator whether convgpu runs, and to mount its shim dir (pods get it)") from None
    except (OSError, ValueError) as e:
        raise EnforcerUnreachable(f"the enforcer on {path} did not answer ({e})", "ask the operator") from None
    if not reply.get("ok"):
        raise ConvgpuError(reply.get("error", "the enforcer refused the request"))
    return reply["status"]
