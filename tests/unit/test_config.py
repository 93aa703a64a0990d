"""The enforcer's TOML config, its rules and the limit precedence; Prometheus rendering."""
import pytest

from convgpu.cli.enforce import DEFAULTS, rules_from, settings_from
from convgpu.enforcer.tenants import config as cfg
from convgpu.enforcer.tenants.containers import Container
from convgpu.enforcer.metrics import render
from convgpu.errors import ConfigError
from conftest import prom_samples

GiB = 1 << 30
POD = Container(kind="podman", id="ab" * 32, cgroup="/libpod_parent/libpod-" + "ab" * 32)


def load(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return cfg.load(str(p))


def test_settings_and_rules_parse(tmp_path):
    c = load(tmp_path, '[enforce]\npolicy = "bf"\ngpu_memory = "5GiB"\nmax_wait = 12.5\nlibs = ["/x/libcuda.so.1"]\n'
                       'discover = false\nmetrics_port = 9400\n'
                       '[[rule]]\nmatch = "name"\npattern = "train-*"\nlimit = "4GiB"\n'
                       '[[rule]]\nmatch = "label"\npattern = "team=vision*"\nlimit = 1073741824\n'
                       '[[rule]]\nmatch = "cgroup"\npattern = "/libpod_parent/*"\nlimit = "1.5G"\n')
    assert c.settings == {"policy": "bf", "gpu_memory": 5 * GiB, "max_wait": 12.5, "libs": ["/x/libcuda.so.1"],
                          "discover": False, "metrics_port": 9400}
    assert [(r.match, r.limit) for r in c.rules] == [("name", 4 * GiB), ("label", GiB), ("cgroup", 3 * GiB // 2)]
    # command line > file > defaults
    s = settings_from(c, {"policy": "fifo", "gpu_memory": None})
    assert (s["policy"], s["gpu_memory"], s["reserve"]) == ("fifo", 5 * GiB, DEFAULTS["reserve"])
    rules = rules_from(c, {"pinned": 2 * GiB}, GiB)
    assert rules.limit_for(POD, "pinned", {}) == (2 * GiB, "--limit pinned")            # --limit first
    assert rules.limit_for(POD, "train-7", {"com.nvidia.memory.limit": "8GiB"}) == (4 * GiB, "rule name 'train-*'")
    assert rules.limit_for(POD, "x", {"team": "vision-a"}) == (GiB, "rule label 'team=vision*'")
    assert rules.limit_for(POD, "x", {"team": "audio"}) == (3 * GiB // 2, "rule cgroup '/libpod_parent/*'")
    rules.runtime[POD.id] = 7 * GiB                                                     # limit set beats all
    assert rules.limit_for(POD, "pinned", {}) == (7 * GiB, "convgpu limit set")
    plain = Container(kind="cgroup", id="/a/b", cgroup="/a/b")
    assert rules.limit_for(plain, "b", {"com.nvidia.memory.limit": "3GiB"}) == (3 * GiB, "label com.nvidia.memory.limit")


@pytest.mark.parametrize("text,msg", [
    ('[enforce]\npolicy = "lifo"\n', "[enforce] policy = 'lifo'; use one of fifo, bf, ru, rand, bfa"),
    ('[enforce]\ngpu_memory = "-1"\n', "[enforce] gpu_memory '-1'"),
    ('[enforce]\ngpu_memory = ""\n', "[enforce] gpu_memory ''"),
    ('[enforce]\nmax_wait = "soon"\n', "use a number of seconds >= 0"),
    ('[enforce]\nmetrics_port = 70000\n', "use a port 0-65535"),
    ('[enforce]\ndiscover = "yes"\n', "use true or false"),
    ('[enforce]\nturbo = 1\n', "unknown key [enforce] turbo"),
    ('[enforce]\nseed = 1.5\n', "use an integer"),
    ('[limits]\n', "unknown table 'limits'"),
    ('enforce = 3\n', "'enforce' must be a table"),
    ('rule = 3\n', "'rule' must be an array of tables"),
    ('[[rule]]\nmatch = "image"\npattern = "x"\nlimit = "1GiB"\n', "rule #1: invalid match 'image'"),
    ('[[rule]]\nmatch = "name"\npattern = ""\nlimit = "1GiB"\n', "rule #1: invalid pattern ''"),
    ('[[rule]]\nmatch = "name"\npattern = "x"\nlimit = "1e40"\n', "rule #1 limit '1e40' is larger"),
    ('[[rule]]\nmatch = "name"\npattern = "x"\n', "must have exactly match, pattern and limit"),
    ('[enforce\n', "fix the TOML syntax"),
])
def test_bad_config_names_the_value(tmp_path, text, msg):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    assert msg in str(e.value) and str(tmp_path) in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found; give an existing file with --config"):
        cfg.load(str(tmp_path / "nope.toml"))


def test_prometheus_text():
    st = {"gpus": {"0": {"capacity": 5 * GiB}},
          "containers": [{"name": 'we"ird', "id": "abc", "limit": 2 * GiB, "stalled_s": 1.5, "stalls": 3, "grants": 2,
                          "over_limit_events": 1, "gpus": {"0": {"assigned": GiB, "used": 512, "context_overhead": 7}}}]}
    text = render(st)
    lines, got = text.splitlines(), prom_samples(text)
    lab = 'container="we\\"ird",id="abc"'
    for want in (f'convgpu_container_limit_bytes{{{lab},gpu="0"}} {2 * GiB}',
                 f'convgpu_container_assigned_bytes{{{lab},gpu="0"}} {GiB}',
                 f'convgpu_container_used_bytes{{{lab},gpu="0"}} 512',
                 f'convgpu_container_context_overhead_bytes{{{lab},gpu="0"}} 7',
                 f'convgpu_container_stalled_seconds_total{{{lab}}} 1.5',
                 f"convgpu_stalls_total{{{lab}}} 3", f"convgpu_grants_total{{{lab}}} 2",
                 f"convgpu_over_limit_total{{{lab}}} 1", f'convgpu_gpu_capacity_bytes{{gpu="0"}} {5 * GiB}',
                 "# TYPE convgpu_stalls_total counter", "# TYPE convgpu_container_used_bytes gauge"):
        assert (want in lines) if want.startswith("#") else (prom_samples(want) <= got), (want, text)
