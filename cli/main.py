"""`convgpu`: joins the sub-command modules. Help is plain text (no markup: `[enforce]` in a help
is text), each default said once, `-h` and `--version` work, each command ends its help with
examples, and every error, a usage error included, is one line on stderr and exit status 1
(issue 52)."""
import importlib
import sys

import typer

from .. import __version__
from . import common

try:   # typer >= 0.20 carries its own copy of click
    from typer._click.exceptions import ClickException, UsageError
except ImportError:   # pragma: no cover (older typer: click itself)
    from click.exceptions import ClickException, UsageError

_app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                   context_settings={"help_option_names": ["-h", "--help"]},
                   help="Share one GPU's memory between containers: trace and limit CUDA allocations.")


def _print_version(value: bool):
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@_app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Tracebacks and debug logs."),
          verbose: bool = typer.Option(False, "--verbose", "-v", help="Info logs."),
          version_: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                        help="Print the version and exit.")):
    common.state["debug"] = debug
    common.setup_logging(verbose, debug)


@_app.command("version")
def version():
    """Print the version."""
    typer.echo(__version__)


def examples(*lines: str) -> str:
    """A command's epilog: its examples, one a line (\b keeps click from joining them)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


EXAMPLES = {
    "trace": ("convgpu trace                      # the live view (q or Ctrl-C to end)",
              "convgpu trace --container trainer  # one container",
              "convgpu trace --json --interval 2 > trace.jsonl"),
    "doctor": ("sudo convgpu doctor                # what works here; the last line is the verdict",),
    "enforce": ("convgpu enforce --config /etc/convgpu/config.toml",
                "convgpu enforce --policy bf --gpu-memory 20GiB --limit trainer=4GiB --default-limit 1GiB"),
    "status": ("convgpu status", "convgpu status --json | jq '.containers[] | {name, limit}'"),
    "reload": ("convgpu reload                     # or: systemctl reload convgpu-enforce",),
    "run": ("convgpu run --limit 4GiB --name train -- python train.py",
            "convgpu run --shim --limit 2GiB -- ./app   # over the limit: an out-of-memory error, no wait"),
    "shim": ("eval \"$(convgpu shim --print-env)\" ./app",),
    "kube": ("convgpu kube --unit 256MiB         # the DaemonSet runs it (docs/KUBERNETES.md)",
             "convgpu kube --dra"),
    "recommend": ("convgpu recommend", "convgpu recommend run:train",
                  "convgpu recommend --plot run:train --out train.png"),
}

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
            _app.command(name, **settings, **({"epilog": examples(*EXAMPLES[name])} if name in EXAMPLES else {}))(obj)
    return _app


_registered: set[str] = set()


def __getattr__(name: str):
    """`app`, with every command (tests drive it through typer's CliRunner)."""
    if name == "app":
        return _register()
    raise AttributeError(name)


def main(argv: list[str] | None = None):
    """The `convgpu` command: a usage error is one line and exit 1, as every other error is
    (common.fail), not a box and exit 2."""
    args = sys.argv[1:] if argv is None else list(argv)
    app = _register(args)
    try:
        rc = app(args, prog_name="convgpu", standalone_mode=False)
    except UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":   # `convgpu` alone: the help was printed
            sys.exit(0)
        where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "convgpu"
        raise SystemExit(_one_line(f"{e.format_message().rstrip('.')}; see `{where} --help`"))
    except ClickException as e:
        raise SystemExit(_one_line(e.format_message()))
    except typer.Abort:
        raise SystemExit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


def _one_line(message: str) -> int:
    common.fail(" ".join(message.split()))
    return 1


if __name__ == "__main__":
    main()
