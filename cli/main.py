"""`convgpu`: joins the sub-command modules."""
import typer

from .. import __version__
import importlib
import sys

from . import common

_app = typer.Typer(add_completion=False, no_args_is_help=True,
                   help="Share one GPU's memory between containers: trace and limit CUDA allocations.")


@_app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Tracebacks and debug logs."),
          verbose: bool = typer.Option(False, "--verbose", "-v", help="Info logs.")):
    common.state["debug"] = debug
    common.setup_logging(verbose, debug)


@_app.command("version")
def version():
    """Print the version."""
    typer.echo(__version__)


# name -> (module, attribute, typer.command settings); "limit" is a group of its own
COMMANDS = {"trace": ("trace", "trace", {}), "doctor": ("doctor", "doctor", {}),
            "enforce": ("enforce", "enforce", {}), "status": ("status", "status", {}),
            "limit": ("limit", "app", None), "reload": ("limit", "reload", {}),
            "run": ("run", "run", {"context_settings": {"allow_interspersed_args": False}}),
            "shim": ("shim", "shim", {}), "kube": ("kube", "kube", {}),
            "recommend": ("recommend", "recommend", {}), "swap": ("swap", "app", None)}


def _register(argv: list[str] | None = None) -> typer.Typer:
    """Only the command named on the command line is imported (`convgpu enforce` starts
    without the others' imports: start-up is a stated property, docs/BENCHMARKS.md); every
    one for help, a name that is none of them (typer then says so), or argv None."""
    named = next((a for a in argv or () if not a.startswith("-")), None)
    for name, (module, attr, settings) in COMMANDS.items():
        if named in COMMANDS and name != named or name in _registered:
            continue
        _registered.add(name)
        obj = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
        if settings is None:
            _app.add_typer(obj, name=name)
        else:
            _app.command(name, **settings)(obj)
    return _app


_registered: set[str] = set()


def __getattr__(name: str):
    """`app`, with every command (tests drive it through typer's CliRunner)."""
    if name == "app":
        return _register()
    raise AttributeError(name)


def main(argv: list[str] | None = None):
    _register(sys.argv[1:] if argv is None else argv)()


if __name__ == "__main__":
    main()
