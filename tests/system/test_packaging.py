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
    assert "Usage: python -m convgpu" in r.stdout
    for command in ("trace", "enforce", "status", "limit", "run", "doctor", "shim", "recommend"):
        assert re.search(rf"│ {command} ", r.stdout), command
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
        unit.replace("/opt/convgpu/.venv/bin/convgpu", str(Path(sys.executable).parent / "convgpu")))
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "convgpu-enforce.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "convgpu-enforce.service" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_example_config_loads_and_every_option_is_documented():
    from convgpu.enforcer.tenants import config as cfg
    conf = cfg.load(str(REPO / "contrib/config.example.toml"))
    off = {"gpu_memory", "seed", "metrics_tls", "swap_budget"}     # commented out: no value fits every host
    assert set(conf.settings) == set(cfg.SETTINGS) - off
    example = (REPO / "contrib/config.example.toml").read_text()
    assert all(f"# {k} = " in example for k in off)
    assert len(conf.rules) == 3
    r = subprocess.run([sys.executable, "-m", "convgpu.cli.main", "enforce", "--help"], capture_output=True,
                       text=True, env=dict(os.environ, COLUMNS="200"), timeout=60)
    options = set(re.findall(r"--[a-z][a-z-]+", r.stdout)) - {"--help", "--no-discover", "--no-probes"}
    guide = (REPO / "docs/OPERATOR.md").read_text()
    assert options and all(f"`{o}" in guide for o in options), sorted(o for o in options if f"`{o}" not in guide)
    # per start, not per host: --no-bpf-cache (CONVGPU_BPF_CACHE=off is the lasting switch)
    for o in options - {"--config", "--limit", "--duration", "--lib", "--no-bpf-cache"}:
        assert o[2:].replace("-", "_") in cfg.SETTINGS, o
    assert "libs" in cfg.SETTINGS and "rule" in example
