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


def test_sizes_that_leave_nothing_are_refused_before_anything_starts(tmp_path):
    """Issue 52: `--gpu-memory 4` started with a capacity of 4 bytes, `--default-limit 0` and
    `--limit a=0` were taken. Each is one line with the value and the fix, exit 1 (here the
    enforcer would run without probes for 0.1 s if it were taken)."""
    base = ["enforce", "--no-probes", "--run-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"),
            "--duration", "0.1"]
    for args, line in ((["--gpu-memory", "4"], "convgpu: --gpu-memory '4' has no unit; did you mean 4GiB? write the "
                        "unit: B for bytes, or K/M/G/T, KiB/MiB/GiB/TiB, KB/MB/GB/TB"),
                       (["--gpu-memory", "4GiB", "--default-limit", "0"], "convgpu: --default-limit is 0: a container "
                        "given it can allocate nothing, and its first CUDA call waits until the limit is raised; give "
                        "a size, e.g. 1GiB"),
                       (["--gpu-memory", "4GiB", "--limit", "a=0"], "convgpu: --limit a is 0: a container given it "
                        "can allocate nothing, and its first CUDA call waits until the limit is raised; give a size, "
                        "e.g. 1GiB")):
        r = runner.invoke(app, base + args)
        assert (r.exit_code, r.output.strip()) == (1, line), r.output


def test_a_metrics_port_in_use_is_said_as_such(tmp_path):
    """Issue 52: a port already taken blamed the TLS files."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = runner.invoke(app, ["enforce", "--no-probes", "--gpu-memory", "4GiB", "--metrics-port", str(port),
                                "--run-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"),
                                "--duration", "0.1"])
    assert r.exit_code == 1 and r.output.strip() == (
        f"convgpu: cannot serve metrics on 127.0.0.1:{port}: the port is in use (`ss -ltnp 'sport = :{port}'` says "
        "by what); choose a free --metrics-port"), r.output
    r = runner.invoke(app, ["enforce", "--no-probes", "--gpu-memory", "4GiB", "--metrics-port", str(port),
                            "--metrics-tls", f"{tmp_path}/no.pem,{tmp_path}/no.key", "--run-dir", str(tmp_path / "run"),
                            "--state-dir", str(tmp_path / "state"), "--duration", "0.1"])
    assert r.exit_code == 1 and r.output.strip() == (
        f"convgpu: --metrics-tls {tmp_path}/no.pem,{tmp_path}/no.key: No such file or directory; give readable PEM "
        "files: CERT,KEY[,CLIENT_CA]"), r.output


def cli(*args):
    """`convgpu ARGS` as a user runs it (a process: main(), not typer's runner), 100 columns."""
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "convgpu", *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, COLUMNS="100"))


def test_help_is_text_each_default_once_with_examples_version_and_h():
    """Issue 52: rich markup ate `[enforce]` and `[[rule]]` in `enforce --config`'s help;
    defaults were shown twice; trace's --ctx-overhead said "default 519MiB" alone; no
    examples, no --version, no -h."""
    r = cli("enforce", "-h")
    assert r.returncode == 0 and "([enforce] options and\n" in r.stdout and "[[rule]] limits;" in r.stdout, r.stdout
    assert r.stdout.rstrip().splitlines()[-2:] == [
        "    convgpu enforce --config /etc/convgpu/config.toml",
        "    convgpu enforce --policy bf --gpu-memory 20GiB --limit trainer=4GiB --default-limit 1GiB"]
    for cmd in ("status", "run", "doctor", "recommend", "trace", "kube", "reload"):
        out = cli(cmd, "--help").stdout
        assert "Examples:\n    convgpu " in out or "Examples:\n    sudo convgpu " in out, (cmd, out)
        assert "default /run/convgpu" not in out and "default /var/lib/convgpu" not in out, out   # once: [default: ...]
    trace = " ".join(cli("trace", "--help").stdout.split())
    assert "Not given: 519MiB (a bare context on an H100), 64MiB in the demo; with an enforcer running, its own " \
        "charges are shown." in trace
    assert cli("--version").stdout.strip() == __version__ and cli("limit", "set", "-h").returncode == 0


def test_a_usage_error_is_one_line_and_exit_1_like_every_error():
    """Issue 52: usage errors were a box with exit 2, other errors one line with exit 1."""
    r = cli("trace", "--interval", "abc")
    assert (r.returncode, r.stderr.splitlines()) == (1, [
        "convgpu: Invalid value for '--interval' / '-i': Input should be a valid number, unable to parse string as a "
        "number; see `convgpu trace --help`"]), r.stderr
    r = cli("limit", "set", "x")
    assert (r.returncode, r.stderr.splitlines()) == (1, [
        "convgpu: Missing argument 'size'; see `convgpu limit set --help`"]), r.stderr
    r = cli("nosuch")
    assert (r.returncode, r.stderr.strip()) == (1, "convgpu: No such command 'nosuch'; see `convgpu --help`")
