"""`convgpu shim --print-env`: how to run a program under the preload shim."""
import os
import shlex

import typer

from .. import __file__ as _package
from ..errors import PrerequisiteError
from ..paths import shim_library
from . import common


def library() -> str:
    found = shim_library()
    if not found:
        raise PrerequisiteError(f"the shim library is not built in {os.path.dirname(os.path.abspath(_package))}",
                                "reinstall the package (scripts/setup.sh builds it)")
    return found


def shim_env(run_dir: str = common.RUN_DIR, fail_closed: bool = False) -> dict[str, str]:
    env = {"LD_PRELOAD": library(), "CONVGPU_SHIM_SOCKET": os.path.join(run_dir, "shim", "shim.sock")}
    if fail_closed:
        env["CONVGPU_SHIM_FAIL_CLOSED"] = "1"
    return env


@common.handle_errors
def shim(print_env: bool = typer.Option(True, "--print-env", help="Print the environment line to use."),
         fail_closed: bool = typer.Option(False, "--fail-closed", help="Without an enforcer, allocations fail instead of passing through."),
         run_dir: str = typer.Option(common.RUN_DIR, "--run-dir", help=common.RUN_DIR_HELP)):
    """Print the environment that runs a program under the preload shim (docs/SHIM.md)."""
    typer.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in shim_env(run_dir, fail_closed).items()))
