"""enforcer/tenants/durable.py and decisionfile.py without a kernel: the decisions file's format (version, checksum,
migration, caps), the atomic write and what a failed one leaves, entries dropped when their
container's cgroup is gone or replaced, the state dir's lock, and the order of limits."""
import errno
import json
import os

import pytest

from convgpu.enforcer.tenants import decisionfile, durable
from convgpu.enforcer.tenants.containers import Container
from convgpu.enforcer.tenants.decisionfile import Decisions, LimitSet, NotKept, Run, decode, encode
from convgpu.enforcer.tenants.durable import Store
from convgpu.enforcer.tenants.statefile import Unreadable
from convgpu.enforcer.tenants.limits import LimitRules, PodLimit, unknown

GiB = 1 << 30
POD = PodLimit(2 * GiB, "pod ns/p c: 2 x 1024 MiB convgpu.io/gpu-memory", False, (("GPU-a", 2 * GiB),))


class Cgroups:
    """A fake cgroupfs: path -> id; a removed cgroup is gone, a new one at its path a new id."""

    def __init__(self, *paths):
        self.ids, self.next = {}, 100
        for p in paths:
            self.make(p)

    def make(self, path):
        self.next += 1
        self.ids[path] = self.next
        return self.next

    def rm(self, path):
        del self.ids[path]

    def __call__(self, path):
        return self.ids.get(path)


def full(cg: Cgroups) -> Decisions:
    return (Decisions().with_run("/convgpu.run/job-1", Run(1536 << 20, "job", cg("/convgpu.run/job-1")))
            .with_limit("ab" * 32, LimitSet(3 * GiB, "/libpod_parent/libpod-" + "ab" * 32,
                                            cg("/libpod_parent/libpod-" + "ab" * 32)))
            .with_pods({"c" * 64: POD}))


def store(tmp_path, cg, **kw) -> Store:
    return Store(str(tmp_path / "state"), identity=cg, written_by="test", **kw).open(wait=0)


def test_round_trip_and_the_file_is_whole_and_checked(tmp_path):
    cg = Cgroups("/convgpu.run/job-1", "/libpod_parent/libpod-" + "ab" * 32)
    s = store(tmp_path, cg)
    assert s.value == Decisions() and s.status()["state"] == "ok"
    s.commit(full(cg), "test")
    doc = json.loads((tmp_path / "state" / durable.FILE).read_text())
    assert (doc["format"], doc["version"], doc["by"]) == ("convgpu-decisions", 2, "test")
    assert doc["decisions"]["runs"] == {"/convgpu.run/job-1": {"limit": 1536 << 20, "name": "job", "cgroup_id": 101}}
    s.close()
    again = store(tmp_path, cg)
    assert again.value == full(cg) and again.error == ""
    assert again.status() | {"write_ms": 0} == {"path": str(tmp_path / "state" / durable.FILE), "state": "ok", "error": "",
                                               "write_error": "", "runs": 1, "limits": 1, "pods": 1, "claims": 0, "writes": 0,
                                               "write_ms": 0}
    assert [n for n in os.listdir(tmp_path / "state")] == [durable.FILE]   # no temporary file left


@pytest.mark.parametrize("change, why", [
    (lambda doc: doc["decisions"]["runs"]["/convgpu.run/job-1"].update(limit=99 * GiB), "checksum does not match"),
    (lambda doc: doc.update(version=3), "written by a newer convgpu (format version 3; this one reads up to 2)"),
    (lambda doc: doc.update(format="something"), "not a convgpu-decisions file"),
    (lambda doc: doc.update(version=True), "format version True is not one"),
])
def test_a_file_that_fails_its_check_is_unreadable(tmp_path, change, why):
    cg = Cgroups("/convgpu.run/job-1", "/libpod_parent/libpod-" + "ab" * 32)
    doc = json.loads(encode(full(cg)))
    change(doc)
    with pytest.raises(Unreadable) as e:
        decode(json.dumps(doc).encode())
    assert why in str(e.value)


def test_cut_short_or_garbage_is_unreadable():
    raw = encode(Decisions().with_pods({"k": POD}))
    for bad in (raw[:len(raw) // 2], b"", b"\x00\xff" * 10, b"[]"):
        with pytest.raises(Unreadable):
            decode(bad)


def test_an_older_version_is_migrated(monkeypatch):
    """A newer convgpu reads an older file: each version's step of MIGRATIONS, in order."""
    v2 = json.loads(encode(Decisions().with_pods({"k": POD})))
    monkeypatch.setattr(decisionfile, "VERSION", 3)
    # a made-up version 3 that renamed "pods" to "kubernetes": reads as version 3 wants it
    monkeypatch.setattr(decisionfile, "MIGRATIONS", {2: lambda b: {"runs": b["runs"], "limits": b["limits"],
                                                              "kubernetes": b["pods"]}})
    monkeypatch.setattr(decisionfile, "_parse", lambda b: Decisions(pods={k: PodLimit(*v[:2]) for k, v in b["kubernetes"].items()}))
    assert decode(json.dumps(v2).encode()).pods == {"k": PodLimit(POD.bytes, POD.source)}


def test_a_version_1_file_reads_with_no_claims():
    """Version 2 added the DRA plugin's claims (issue 40): a version-1 file is read through
    MIGRATIONS[1], and an older convgpu refuses a version-2 file (it would drop the claims)."""
    body = {"runs": {}, "limits": {}, "pods": {"k": POD.wire()}}
    doc = {"format": "convgpu-decisions", "version": 1, "sha256": decisionfile.digest(body), "decisions": body}
    d = decode(json.dumps(doc).encode())
    assert (d.pods, d.claims) == ({"k": POD}, {})


def test_an_unreadable_file_is_reported_kept_and_never_written_over(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    (d / durable.FILE).write_bytes(b'{"format": "convgpu-decisions", "version": 1, "decisions": {}, "sha256": "0"}')
    before = (d / durable.FILE).read_bytes()
    s = Store(str(d), identity=Cgroups("/a")).open(wait=0)
    assert s.error == f"{d / durable.FILE}: its checksum does not match its decisions (changed or cut short)"
    assert s.status()["state"] == "unreadable" and s.value == Decisions()
    with pytest.raises(NotKept) as e:
        s.commit(Decisions().with_run("/a", Run(GiB, None, 101)), "the registration of a")
    assert "could not be read at start" in str(e.value) and "move it aside, then `convgpu reload`" in str(e.value)
    assert s.sweep() == [] and (d / durable.FILE).read_bytes() == before
    os.rename(d / durable.FILE, d / "aside.json")             # the operator moves it aside
    assert s.load() and s.error == "" and s.value == Decisions()


def test_a_failed_write_changes_nothing_and_says_why(tmp_path, monkeypatch):
    cg = Cgroups("/convgpu.run/job-1", "/libpod_parent/libpod-" + "ab" * 32)
    s = store(tmp_path, cg)
    s.commit(full(cg), "test")
    before = (tmp_path / "state" / durable.FILE).read_bytes()

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(durable.os, "write", full_disk)
    new = s.value.with_run("/convgpu.run/job-2", Run(GiB, "two", cg.make("/convgpu.run/job-2")))
    with pytest.raises(NotKept) as e:
        s.commit(new, "the registration of two")
    assert str(e.value) == (f"the registration of two is not kept: cannot write {tmp_path / 'state' / durable.FILE} "
                            "(No space left on device); nothing changed; free space in (or make writable) the "
                            "state dir, then try again")
    assert s.value == full(cg) and s.write_error == "No space left on device"
    assert (tmp_path / "state" / durable.FILE).read_bytes() == before
    assert os.listdir(tmp_path / "state") == [durable.FILE]   # its temporary file went too
    monkeypatch.undo()
    s.commit(new, "the registration of two")
    assert s.value == new and s.write_error == ""


def test_a_write_cut_between_fsync_and_rename_leaves_the_old_file(tmp_path, monkeypatch):
    """kill -9 inside the write (the `save` fault point): the old value is the file; the
    temporary file is removed at the next start."""
    cg = Cgroups("/convgpu.run/job-1", "/libpod_parent/libpod-" + "ab" * 32)
    s = store(tmp_path, cg)
    s.commit(full(cg), "test")

    def killed(src, dst):
        raise KeyboardInterrupt   # stands for the SIGKILL: nothing after it runs
    monkeypatch.setattr(durable.os, "replace", killed)
    monkeypatch.setattr(durable.os, "unlink", lambda p: None)   # the dying process cleans nothing
    with pytest.raises(KeyboardInterrupt):
        s.commit(Decisions(), "test")
    monkeypatch.undo()
    assert any(n.startswith(".decisions-") for n in os.listdir(tmp_path / "state"))
    s.close()
    again = store(tmp_path, cg)
    assert again.value == full(cg) and os.listdir(tmp_path / "state") == [durable.FILE]


def test_entries_go_with_their_cgroup_and_a_new_cgroup_at_the_path_is_not_the_old(tmp_path):
    job, ctr = "/convgpu.run/job-1", "/libpod_parent/libpod-" + "ab" * 32
    cg = Cgroups(job, ctr, "/convgpu.run/waits")
    s = store(tmp_path, cg)
    s.commit(full(cg).with_run("/convgpu.run/waits", Run(GiB, "waits", cg("/convgpu.run/waits"))), "test")
    assert s.sweep() == []                            # all there: a cgroup before its first CUDA call keeps its entry
    cg.rm(job)
    cg.rm(ctr)
    cg.make(ctr)                                      # restarted: the same path, a new cgroup
    assert s.sweep(("ab" * 32, ctr)) == ["limit set abababababab"]   # as it is placed
    assert s.sweep() == ["convgpu run /convgpu.run/job-1"]
    assert set(s.value.runs) == {"/convgpu.run/waits"} and s.value.limits == {} and s.value.pods == {"c" * 64: POD}
    s.close()
    again = store(tmp_path, cg)
    assert set(again.value.runs) == {"/convgpu.run/waits"}   # written
    again.close()
    cg.rm("/convgpu.run/waits")                       # gone while no enforcer ran: dropped when read
    assert store(tmp_path, cg).value.runs == {}


def test_caps(tmp_path, monkeypatch):
    monkeypatch.setattr(decisionfile, "MAX_ENTRIES", 3)
    cg = Cgroups(*(f"/r/{i}" for i in range(4)))
    d = Decisions()
    for i in range(3):
        d = d.with_run(f"/r/{i}", Run(GiB, None, cg(f"/r/{i}")))
    d = d.with_run("/r/0", Run(2 * GiB, None, cg("/r/0")))   # a key already there: replaced
    with pytest.raises(NotKept, match="keeps 3 `convgpu run` registrations already"):
        d.with_run("/r/3", Run(GiB, None, cg("/r/3")))
    with pytest.raises(NotKept, match="4 pod limits are more than the state dir keeps"):
        d.with_pods({str(i): POD for i in range(4)})
    s = store(tmp_path, cg)
    with pytest.raises(NotKept, match="name 'xxxx"):   # what would not read back is never written
        s.commit(Decisions().with_run("/r/0", Run(GiB, "x" * 2000, 1)), "a long name")
    assert not (tmp_path / "state" / durable.FILE).exists()
    (tmp_path / "state" / durable.FILE).write_bytes(b" " * (durable.MAX_BYTES + 1))
    assert not s.load() and "more than a decisions file holds" in s.error


def test_a_second_enforcer_on_a_state_dir_reads_it_and_keeps_nothing(tmp_path, caplog):
    cg = Cgroups("/a")
    first = store(tmp_path, cg)
    first.commit(Decisions().with_run("/a", Run(GiB, "a", cg("/a"))), "a")
    second = store(tmp_path, cg)
    assert second.value == first.value and second.status()["state"] == "another enforcer's"
    assert "its decisions are read, and run-time limits and names given to this one are refused" in caplog.text
    with pytest.raises(NotKept, match="is not kept: another enforcer keeps its decisions in"):
        second.commit(Decisions(), "b")
    cg.rm("/a")
    assert second.sweep() == ["convgpu run /a"]     # its own view only: nothing written
    assert json.loads((tmp_path / "state" / durable.FILE).read_text())["decisions"]["runs"]
    second.close()
    first.close()
    third = store(tmp_path, cg)                     # the lock went with the first
    assert third.status()["state"] == "ok" and third.value.runs == {}
    third.close()


def test_no_state_dir_keeps_them_in_memory(caplog):
    s = Store(None, identity=Cgroups("/a")).open()
    s.commit(Decisions().with_run("/a", Run(GiB, None, 101)), "a")
    assert s.value.runs["/a"].limit == GiB and s.status()["state"] == "memory"
    assert "kept in memory only, and a restart forgets them" in caplog.text


def test_limit_order_and_unknown():
    job = Container("cgroup", "/convgpu.run/job-1", "/convgpu.run/job-1")
    rules = LimitRules({"job": 3 * GiB}, GiB, runs={job.cgroup: 1536 << 20})
    assert rules.limit_for(job, "job", None) == (1536 << 20, "convgpu run --limit")   # beats --limit NAME
    rules.runtime[job.id] = 2 * GiB
    assert rules.limit_for(job, "job", None) == (2 * GiB, "convgpu limit set")
    rules.unreadable = "/var/lib/convgpu/decisions.json: not JSON"
    limit, source = rules.limit_for(job, "job", None)
    assert limit == 0 and unknown(source) and "not JSON" in source


def test_doctor_check(tmp_path):
    d = tmp_path / "state"
    assert durable.check(str(d)) == ("none", f"{d / durable.FILE}: none yet")   # not made yet: fine
    d.mkdir()
    (d / durable.FILE).write_bytes(encode(Decisions().with_pods({"k": POD})))
    assert durable.check(str(d)) == ("ok", f"{d / durable.FILE}: 0 convgpu run, 0 limit set, 1 pod limits, 0 DRA claims")
    (d / durable.FILE).write_bytes(b"{")
    state, detail = durable.check(str(d))
    assert state == "unreadable" and detail.startswith(f"{d / durable.FILE}: not JSON")


def test_fault_points_parse_and_count(monkeypatch):
    from convgpu import faults
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(faults.os, "write", lambda fd, b: len(b))
    f = faults.Faults("grant:2, save:1")
    assert f.left == {"grant": 2, "save": 1}
    f.hit("place")                      # not armed: nothing
    f.hit("grant")
    assert killed == []                 # the second time, not the first
    f.hit("grant")
    assert killed == [faults.signal.SIGKILL]
    for bad in ("grant", "grant:0", "nowhere:1", "grant:x"):
        with pytest.raises(ValueError, match="CONVGPU_FAULT"):
            faults.Faults(bad)
    assert faults.FAULT is None          # unset in the tests' environment: every point costs one test
