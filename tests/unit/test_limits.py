import pytest

from convgpu.enforcer.tenants.containers import Container
from convgpu.enforcer.tenants.limits import DEFAULT_LIMIT, LimitRules, parse_limit_args
from convgpu.errors import SizeError

GiB = 1 << 30
C = Container(kind="podman", id="ab" * 32, cgroup="/libpod_parent/libpod-" + "ab" * 32)


def test_parse_limit_args():
    assert parse_limit_args(["trainer=4GiB", " x = 512MiB"]) == {"trainer": 4 * GiB, "x": 512 << 20}
    for bad, text in (("nosize", "invalid --limit 'nosize'"), ("=1GiB", "invalid --limit '=1GiB'"),
                      ("a=abc", "--limit a 'abc'"), ("a=-1", "--limit a '-1'")):
        with pytest.raises(SizeError) as e:
            parse_limit_args([bad])
        assert text in str(e.value)


def test_limit_precedence_name_id_label_default(caplog):
    rules = LimitRules({"trainer": 4 * GiB, "ababab": 2 * GiB}, default=DEFAULT_LIMIT)
    assert rules.limit_for(C, "trainer", {"com.nvidia.memory.limit": "1GiB"}) == (4 * GiB, "--limit trainer")
    assert rules.limit_for(C, "other", {}) == (2 * GiB, "--limit ababab")          # id prefix
    plain = Container(kind="cgroup", id="/x/y", cgroup="/x/y")
    assert rules.limit_for(plain, "y", {"com.nvidia.memory.limit": "3GiB"}) == (3 * GiB, "label com.nvidia.memory.limit")
    assert rules.limit_for(plain, "y", None) == (GiB, "default")
    # a bad label: default and a warning, never an error
    assert rules.limit_for(plain, "y", {"com.nvidia.memory.limit": "lots"}) == (GiB, "default")
    assert "using the default limit 1.0 GiB" in caplog.text
