"""Domain errors. Each carries the one-line remedy the CLI prints (cli/main.py is the only place
that turns them into output and an exit code)."""


class ConvgpuError(Exception):
    """An error with a remedy: str() is '<what went wrong>; <what to do>'."""

    def __init__(self, problem: str, fix: str = ""):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


class SizeError(ConvgpuError, ValueError):
    pass


class PrerequisiteError(ConvgpuError):
    """Not root, no bcc, no headers, no BPF: tracing cannot start."""


class ProbeError(ConvgpuError):
    pass


class NotFoundError(ConvgpuError):
    """An unknown --pid / --container."""


class ConfigError(ConvgpuError):
    """A bad configuration file or setting: the enforcer refuses it whole."""


class EnforcerUnreachable(ConvgpuError):
    """No enforcer answers on the control socket."""


class MissingExtra(ConvgpuError):
    """An optional part of convgpu is not installed (the fix names the extra to install)."""
