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


def test_a_systemd_unit_is_named_by_its_unit_name_with_or_without_its_suffix():
    """Issue 47: a unit's id became its path, and `--limit victim.service=1GiB` fell to the
    default for /system.slice/victim.service, with nothing said. A unit is named as systemd
    shows it, with its suffix or without, by --limit and by a [[rule]] of name or id."""
    from convgpu.enforcer.tenants.config import Rule
    from convgpu.enforcer.tenants.containers import container_of_path
    unit = container_of_path("/system.slice/victim.service")
    name = unit.short                    # what the enforcer calls it when no engine names it
    assert (unit.kind, unit.id, unit.unit, name) == ("systemd", "/system.slice/victim.service", "victim.service", "victim")
    assert LimitRules({"victim.service": 3 * GiB}).limit_for(unit, name, None) == (3 * GiB, "--limit victim.service")
    assert LimitRules({"victim": 2 * GiB}).limit_for(unit, name, None) == (2 * GiB, "--limit victim")
    for match in ("name", "id"):
        rules = LimitRules({}, rules=[Rule(match, "victim.service", 5 * GiB)])
        assert rules.limit_for(unit, name, None) == (5 * GiB, f"rule {match} 'victim.service'")
    scope = container_of_path("/user.slice/user-1000.slice/session-4.scope")
    assert LimitRules({"session-4.scope": GiB // 2}).limit_for(scope, scope.short, None) == (GiB // 2,
                                                                                             "--limit session-4.scope")
    # anything else has no unit name: a podman container named like a unit is matched by its name only
    assert C.unit is None and LimitRules({"victim.service": 3 * GiB}).limit_for(C, "web", None) == (GiB, "default")


def test_the_limits_that_match_no_container_seen_so_far():
    from convgpu.enforcer.tenants.config import Rule
    from convgpu.enforcer.tenants.containers import container_of_path
    rules = LimitRules({"victim.service": 3 * GiB, "typo.servce": GiB, "ababab": GiB},
                       rules=[Rule("label", "team=ml", GiB), Rule("name", "nomatch*", GiB)])
    assert rules.unmatched() == ["--limit victim.service", "--limit typo.servce", "--limit ababab",
                                 "rule label 'team=ml'", "rule name 'nomatch*'"]
    rules.limit_for(container_of_path("/system.slice/victim.service"), "victim", None)
    rules.limit_for(C, "web", {"team": "ml"})      # matched by --limit ababab (id prefix) and, shadowed, the rule
    assert rules.unmatched() == ["--limit typo.servce", "rule name 'nomatch*'"]
    rules.take_config(LimitRules({"web": GiB}))     # a reload: what was seen stays seen
    assert rules.unmatched() == []
