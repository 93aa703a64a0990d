"""`convgpu doctor`'s verdict and report (cli/doctor.py) without a kernel: one line per check and
its fix, never cut; one verdict line; a decisions file that would make the enforcer hold every
container is not ready, not a warning (issue 52)."""
from convgpu.cli.doctor import Check, _decisions_check, report, verdict
from convgpu.enforcer.tenants import durable


def test_an_unreadable_decisions_file_makes_the_host_not_ready(tmp_path):
    (tmp_path / durable.FILE).write_bytes(b"not json")
    c = _decisions_check(str(tmp_path))
    assert (c.ok, c.fatal) == (False, True) and "moved aside" in c.fix
    ready, line = verdict([Check("root", True, "euid 0"), c])
    assert not ready and line.startswith("NOT READY: decisions failed;")


def test_the_verdict_is_one_line_and_warnings_do_not_fail():
    ok = [Check("root", True, "euid 0"), Check("libcuda", True, "/usr/lib/libcuda.so.1"),
          Check("NVML", False, "not found", "install it", fatal=False)]
    assert verdict(ok) == (True, "ready: `convgpu trace` and `convgpu enforce` work here; 1 warning(s) above limit "
                                 "what is measured or shown, not what is enforced")
    assert verdict(ok[:1]) == (True, "ready: `convgpu trace` and `convgpu enforce` work here (no NVIDIA driver: "
                                     "`convgpu trace` runs its demo)")


def test_the_report_never_cuts_a_path_or_a_fix():
    """Issue 52: a fixed ~100-column table split paths mid-word. One line per check, whole."""
    path = "/var/lib/" + "a-long-directory-name/" * 6 + "decisions.json"
    lines = [t.plain for t in report([Check("decisions", False, f"{path}: unreadable", "move it aside", fatal=True),
                                      Check("root", True, "euid 0")])]
    assert lines == [f"FAIL decisions  {path}: unreadable", " " * 16 + "fix: move it aside", "ok   root       euid 0"]
