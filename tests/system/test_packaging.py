"""The test bed and the service files: the Vagrantfile parses and provisions with the README's
own commands, the systemd unit verifies, the example config loads with the real loader, and
every `convgpu enforce` option is documented (operator guide and example config)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    return re.findall(r"```sh\n(sh scripts/setup.sh && [^\n]+)\n```", (REPO / "README.md").read_text())


@pytest.mark.system
@pytest.mark.parametrize("gpu", ["", "0000:65:00.0"])
def test_vagrantfile_validates(gpu, tmp_path):
    need(shutil.which("vagrant") is not None, "vagrant not installed (scripts/setup.sh installs it)")
    env = dict(os.environ, CONVGPU_GPU_PCI=gpu, VAGRANT_HOME=str(tmp_path), VAGRANT_DOTFILE_PATH=str(tmp_path / "dot"))
    r = subprocess.run(["vagrant", "validate", "--ignore-provider"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "Vagrantfile validated successfully." in r.stdout, r.stdout + r.stderr


def test_the_tree_runs_in_place_as_the_package():
    """From the repository root, whose folder is first on sys.path (no -P), `python -m convgpu`
    is the package that scripts/setup.sh installed: no folder at the root is named convgpu and
    shadows it (core/ holds the package's own modules: pyproject.toml's package-dir)."""
    r = subprocess.run([sys.executable, "-m", "convgpu", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Usage: convgpu " in r.stdout     # the command's name however it is started (cli/main.py)
    for command in ("trace", "enforce", "status", "limit", "run", "doctor", "shim", "recommend"):
        assert re.search(rf"^  {command} ", r.stdout, re.M), command
    # the same package with the root on sys.path (python -c puts it first) as without (-P): the
    # editable install's finder papers over a shadowing folder for submodules, a --target
    # install (the GPU machine's) does not
    where = "import convgpu, convgpu.enforcer.daemon as d; print(convgpu.__file__, d.__file__)"
    found = [subprocess.run([sys.executable, *flag, "-c", where], cwd=REPO, capture_output=True, text=True,
                            timeout=120) for flag in ((), ("-P",))]
    assert [r.returncode for r in found] == [0, 0], [r.stderr for r in found]
    assert found[0].stdout == found[1].stdout, [r.stdout for r in found]


def test_vagrant_provisions_with_the_readme_commands():
    """One set-up script, not a copy: the VM runs the README's set-up and test command."""
    setup, test = readme_commands()[0].split(" && ")[0], readme_commands()[1]
    assert setup == "sh scripts/setup.sh"
    vf = (REPO / "Vagrantfile").read_text()
    assert f'"cd /vagrant && {setup}"' in vf
    assert f'"cd /vagrant && {test.split(" && ", 1)[1]} -q"' in vf
    assert 'config.vm.box = "bento/ubuntu-24.04"' in vf and '"virtualbox"' in vf and '"libvirt"' in vf
    assert (REPO / ".ci" / "run").read_text().count(readme_commands()[1].split(" && ", 1)[1]) == 1


@pytest.mark.system
def test_systemd_unit_verifies(tmp_path):
    need(shutil.which("systemd-analyze") is not None, "no systemd-analyze")
    unit = (REPO / "contrib/systemd/convgpu-enforce.service").read_text()
    assert "KillMode=process" in unit and "RuntimeDirectoryPreserve=yes" in unit and "Restart=on-failure" in unit
    # verify needs ExecStart to exist: point it at this checkout's venv
    (tmp_path / "convgpu-enforce.service").write_text(
        unit.replace("/usr/local/bin/convgpu", str(Path(sys.executable).parent / "convgpu")))
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "convgpu-enforce.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "convgpu-enforce.service" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_example_config_loads_and_every_option_is_documented():
    from convgpu.enforcer.tenants import config as cfg
    conf = cfg.load(str(REPO / "contrib/config.example.toml"))
    off = {"gpu_memory", "seed", "metrics_tls", "ctx_overhead", "swap_budget"}   # commented out: no value fits every host
    assert set(conf.settings) == set(cfg.SETTINGS) - off
    example = (REPO / "contrib/config.example.toml").read_text()
    assert all(f"# {k} = " in example for k in off)
    assert len(conf.rules) == 3
    # issue 52: 9400 is dcgm-exporter's port, often on the same host; and no context charged 0
    assert conf.settings["metrics_port"] not in (0, 9400) and "ctx_overhead" not in conf.settings
    r = subprocess.run([sys.executable, "-m", "convgpu.cli.main", "enforce", "--help"], capture_output=True,
                       text=True, env=dict(os.environ, COLUMNS="200"), timeout=60)
    options = set(re.findall(r"--[a-z][a-z-]+", r.stdout)) - {"--help", "--no-discover", "--no-probes"}
    guide = (REPO / "docs/OPERATOR.md").read_text()
    assert options and all(f"`{o}" in guide for o in options), sorted(o for o in options if f"`{o}" not in guide)
    # per start, not per host: --no-bpf-cache (CONVGPU_BPF_CACHE=off is the lasting switch)
    for o in options - {"--config", "--limit", "--duration", "--lib", "--no-bpf-cache"}:
        assert o[2:].replace("-", "_") in cfg.SETTINGS, o
    assert "libs" in cfg.SETTINGS and "rule" in example


@pytest.mark.system
def test_the_host_install_upgrade_and_uninstall_in_a_scratch_root(tmp_path):
    """Issue 52: set-up left `convgpu` in .venv/bin and installed a developer's host (podman,
    vagrant, the tests' extras). scripts/install.sh --root DIR (every path under DIR, no apt, no
    systemd; a fresh Debian root runs it whole: scripts/test-host-install.sh): convgpu on PATH,
    a venv with only what the enforcer needs, the unit running that command, the config written
    once; run again (an upgrade) it keeps the config; --uninstall --purge leaves nothing of it
    but a job's cgroup that still has a process."""
    root = tmp_path / "host"
    r = subprocess.run(["sh", str(REPO / "scripts/install.sh"), "--root", str(root)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = root / "usr/local/bin/convgpu"
    assert os.readlink(cmd) == str(root / "opt/convgpu/bin/convgpu")
    assert subprocess.run([str(cmd), "--version"], capture_output=True, text=True).stdout.strip() == "0.1.0"
    unit = (root / "etc/systemd/system/convgpu-enforce.service").read_text()
    assert f"\nExecStart={cmd} enforce --config /etc/convgpu/config.toml --handover 60\n" in unit
    assert (root / "etc/convgpu/config.toml").read_text() == (REPO / "contrib/config.example.toml").read_text()
    assert (root / "opt/convgpu/share/doc/convgpu/OPERATOR.md").is_file()
    pkgs = subprocess.run([str(root / "opt/convgpu/bin/python"), "-m", "pip", "list", "--local", "--format", "json"],
                          capture_output=True, text=True).stdout
    names = {p["name"].lower().replace("_", "-") for p in __import__("json").loads(pkgs)}
    assert {"convgpu", "typer", "rich", "prometheus-client"} <= names and not names & {
        "pytest", "pytest-xdist", "hypothesis", "matplotlib", "kubernetes", "grpcio"}, names
    (root / "etc/convgpu/config.toml").write_text("[enforce]\npolicy = \"bf\"\n")
    r = subprocess.run(["sh", str(REPO / "scripts/install.sh"), "--root", str(root)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "convgpu 0.1.0 installed" in r.stdout and "(was: 0.1.0)" in r.stdout, r.stderr
    assert (root / "etc/convgpu/config.toml").read_text() == "[enforce]\npolicy = \"bf\"\n"   # never replaced
    for d in ("var/lib/convgpu", "var/cache/convgpu/bpf", "run/convgpu/shim", "sys/fs/bpf/convgpu-1217619bf202",
              "sys/fs/cgroup/unified/convgpu.run/job-7", "sys/fs/cgroup/freezer/convgpu.run/job-7"):
        (root / d).mkdir(parents=True)
    (root / "var/lib/convgpu/decisions.json").write_text("{}")
    busy = root / "sys/fs/cgroup/unified/convgpu.run/busy-8"   # a job still running: its cgroup stays
    busy.mkdir()
    (busy / "cgroup.procs").write_text("8\n")
    r = subprocess.run(["sh", str(REPO / "scripts/install.sh"), "--root", str(root), "--uninstall", "--purge"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"left (processes still in them): {busy}" in r.stdout, r.stdout + r.stderr
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())
    assert files == ["sys/fs/cgroup/unified/convgpu.run/busy-8/cgroup.procs"], files
