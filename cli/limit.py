"""`convgpu limit set CONTAINER SIZE`: change a running container's limit."""
import typer

from ..printable import printable
from ..units import parse_size
from . import common

app = typer.Typer(help="Change limits of running containers.", no_args_is_help=True, rich_markup_mode=None)


@app.command("set", epilog="\b\nExamples:\n  convgpu limit set trainer 6GiB\n  convgpu limit set 3f2a9c1b7e4d 2GiB --force   # by id; below what it holds")
@common.handle_errors
def set_limit(container: str = typer.Argument(..., help="Name, id (or a 6+ character prefix) or cgroup; a name two containers share is refused: give an id."),
              size: str = typer.Argument(..., help="New limit, e.g. 4GiB."),
              force: bool = typer.Option(False, "--force", help="Set it even below what the container holds now (it then waits until it frees the difference)."),
              run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Set CONTAINER's limit until it exits (beats --limit, rules and labels)."""
    parse_size(size, "SIZE")   # a typo is refused here, before the daemon is asked
    reply = common.control(run_dir, {"cmd": "limit-set", "container": container, "size": size, "force": force})
    # the message names the container (its name is its owner's): printable
    typer.echo(printable(reply["message"]))
    if reply.get("warning"):
        common.warn(printable(reply["warning"]))


@common.handle_errors
def reload(run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Re-read the enforcer's config file (like SIGHUP); a bad file keeps the last good one."""
    common.control(run_dir, {"cmd": "reload"})
    typer.echo("config reloaded")
