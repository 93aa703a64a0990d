"""The CLI through typer's CliRunner: bad input gives one line with the value and the fix, and
exit code 1; never a traceback."""
from typer.testing import CliRunner

from convgpu import __version__
from convgpu.cli.main import app

runner = CliRunner()


def test_version():
    r = runner.invoke(app, ["version"])
    assert r.exit_code == 0 and r.output.strip() == __version__


def test_unknown_pid_is_one_line_error():
    r = runner.invoke(app, ["trace", "--pid", "999999999"])
    assert r.exit_code == 1
    assert "no process with pid 999999999" in r.output and "ps -p" in r.output
    assert "Traceback" not in r.output


def test_bad_overhead_size():
    r = runner.invoke(app, ["trace", "--ctx-overhead", "12 parsecs"])
    assert r.exit_code == 1 and "'12 parsecs'" in r.output and "512MiB" in r.output


def test_unknown_container():
    r = runner.invoke(app, ["trace", "--container", "no-such-container-xyz"])
    assert r.exit_code == 1 and "no running container or cgroup matches 'no-such-container-xyz'" in r.output


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "trace" in r.output and "doctor" in r.output


def test_the_demo_only_where_nothing_is_named():
    """--demo auto: the demo only on a host without a driver and with no --pid, --lib or
    --container (each names what to watch); always / never as said."""
    from convgpu.cli.trace import DemoMode, demo_wanted
    auto, always, never = DemoMode.auto, DemoMode.always, DemoMode.never
    cases = [((auto, False, [], [], None), True), ((auto, True, [], [], None), False),
             ((auto, False, [42], [], None), False), ((auto, False, [], ["/x/libcuda.so.1"], None), False),
             ((auto, False, [], [], "web"), False), ((always, True, [], [], None), True),
             ((never, False, [], [], None), False)]
    assert [(args, demo_wanted(*args)) for args, _ in cases] == cases


def test_demo_always_with_a_filter_is_one_line_error():
    r = runner.invoke(app, ["trace", "--demo", "always", "--pid", "1"])
    assert r.exit_code == 1
    assert r.output.strip() == ("convgpu: --demo always shows only the demo's own workers, and --pid 1 would hide "
                                "them; drop --pid, or use --demo auto")
    r = runner.invoke(app, ["trace", "--demo", "always", "--container", "web"])
    assert r.exit_code == 1 and "--container web would hide them; drop --container" in r.output
