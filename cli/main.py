"""`convgpu`: joins the sub-command modules."""
import typer

from .. import __version__
from . import common, doctor, enforce, kube, limit, run, shim, status, trace

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Share one GPU's memory between containers: trace and limit CUDA allocations.")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Tracebacks and debug logs."),
          verbose: bool = typer.Option(False, "--verbose", "-v", help="Info logs.")):
    common.state["debug"] = debug
    common.setup_logging(verbose, debug)


@app.command("version")
def version():
    """Print the version."""
    typer.echo(__version__)


app.command("trace")(trace.trace)
app.command("doctor")(doctor.doctor)
app.command("enforce")(enforce.enforce)
app.command("status")(status.status)
app.add_typer(limit.app, name="limit")
app.command("reload")(limit.reload)
app.command("run", context_settings={"allow_interspersed_args": False})(run.run)
app.command("shim")(shim.shim)
app.command("kube")(kube.kube)


def main():
    app()


if __name__ == "__main__":
    main()
