"""The per-container quotas on the BPF maps (enforcer/quotas.py, cli/enforce.py map_quota):
what the options and the config file give, and the bad values."""
import logging

import pytest

from convgpu.cli.enforce import DEFAULTS, map_quota, settings_from
from convgpu.enforcer.quotas import MapQuota
from convgpu.enforcer.tenants import config as cfg
from convgpu.errors import ConfigError


def test_defaults_fit_the_maps_sixteen_times():
    q = map_quota(settings_from(None, {}))
    assert q == MapQuota(16384, 4096, 1024)
    # bpf/maps.bpf.c: MAX_OBJS 262144, MAX_THREADS 65536 (threads, procs, members, held)
    assert 16 * q.objects == 262144 and 16 * q.threads == 65536 and 64 * q.processes == 65536
    assert q.leaf() == {"max_objs": 16384, "max_threads": 4096, "max_procs": 1024}


def test_config_file_and_command_line(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[enforce]\nmax_objects = 4096\nmax_processes = 8\n")
    s = settings_from(cfg.load(str(p)), {"max_processes": 16})
    assert map_quota(s) == MapQuota(4096, DEFAULTS["max_threads"], 16)


def test_zero_is_one_clear_error_and_a_large_quota_warns(caplog):
    with pytest.raises(ConfigError) as e:
        map_quota(settings_from(None, {"max_threads": 0}))
    assert "max_threads 0" in str(e.value)
    with caplog.at_level(logging.WARNING):
        assert map_quota(settings_from(None, {"max_objects": 100_000})).objects == 100_000
    assert any("max_objects 100000" in r.getMessage() for r in caplog.records)


def test_a_bad_type_in_the_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[enforce]\nmax_objects = "lots"\n')
    with pytest.raises(ConfigError):
        cfg.load(str(p))
