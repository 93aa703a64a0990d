"""The job history without a kernel (enforcer/history/): who a job is and that a tenant's name
cannot reach another's history (jobs.py); the file's format, caps and a corrupt file kept as it
is (store.py); what the recorder makes of its samples (recorder.py)."""
import json
import logging
import os

import pytest

from convgpu.enforcer.history import jobs, store
from convgpu.enforcer.history.jobs import Job, identify, parse_key, safe
from convgpu.enforcer.history.recorder import Recorder
from convgpu.enforcer.history.seen import GpuSeen, ProcSeen, Seen
from convgpu.enforcer.history.store import GpuRun, History, HistoryFile, Run, Series, Unreadable, add, decode, encode

MiB, GiB = 1 << 20, 1 << 30
RUN = Job("run", "train")


def run(rid, ended, peak=GiB, limit=2 * GiB, series=True, **kw):
    s = Series((0.0, 1.0), {0: (1, peak // MiB)}, {0: (0, 64)}, {0: (limit // MiB,) * 2}, ((0.5, 1.0, 0),)) if series else None
    return Run(rid, ended - 2, ended, "abc", limit, "convgpu run --limit", {0: GpuRun(peak, peak - 64 * MiB, 64 * MiB, 1, limit)},
               series=s, **kw)


# ---- jobs ----

def test_a_jobs_key_says_where_its_name_came_from():
    pod = "ml/Deployment/web/app"
    assert identify("kubernetes", "c" * 64, "/kubepods/x", "app", None, pod).key == "k8s:ml/Deployment/web/app"
    assert identify("cgroup", "/convgpu.run/train-9", "/convgpu.run/train-9", "train", "train").key == "run:train"
    assert identify("podman", "ab" * 32, "/libpod_parent/libpod-x", "web").key == "podman:web"
    assert identify("podman", "ab" * 32, "/libpod_parent/libpod-x", None).key == "podman:" + "ab" * 32
    assert identify("cgroup", "/my/jobs", "/my/jobs", "jobs").key == "cgroup:/my/jobs"
    # a run name outside convgpu run's cgroups is not a convgpu run job
    assert identify("cgroup", "/evil", "/evil", "train", "train").key == "cgroup:/evil"
    assert identify("kubernetes", "c", "/x", "a", None, pod).scope == "k8s:ml"
    assert Job("podman", "web").scope == "podman"


def test_a_chosen_name_cannot_reach_another_jobs_key_or_carry_markup():
    """A container named like another source's job gets its own key; markup, quotes and
    newlines are encoded; distinct names stay distinct, long ones too, and every key made
    reads back (parse_key) while a forged one does not."""
    assert identify("podman", "x", "/c", "run:train").key == "podman:run%3Atrain"
    assert identify("podman", "x", "/c", "k8s:ml/Job/a/b").key == "podman:k8s%3Aml/Job/a/b"
    hostile = ['[bold red]x[/]', 'a"b\nc', "$\\mathrm{x}$", "a b", "a%20b", "é", "", "/", "../.."]
    keys = [identify("docker", "x", "/c", n).key for n in hostile]
    assert len(set(keys)) == len(hostile)
    for k in keys:
        assert parse_key(k).key == k and not set(k) & set('[]"\n $\\ é')
    long = ["x" * 300 + "a", "x" * 300 + "b"]
    made = [safe(n) for n in long]
    assert made[0] != made[1] and all(len(m) <= jobs.MAX_NAME for m in made)
    for forged in ("evil:x", "run:<b>", "run:", "run:" + "x" * 200, "nocolon"):
        with pytest.raises(ValueError):
            parse_key(forged)


# ---- the file ----

def test_round_trip_and_what_a_run_keeps():
    h = add(History(), RUN, [run("a", 10.0, allocs=7, contexts=2, stalls=1, stalled_s=0.5, at_limit_s=1.0,
                                 over_limits=1, end="stopped", by="trace")])
    again = decode(encode(h, "test"))
    assert again == h and again.runs("run:train")[0].peak == GiB
    head, line, end = encode(h, "test").split(b"\n")     # a header, then one line a job
    doc = json.loads(head)
    assert (doc["format"], doc["version"], doc["by"], doc["jobs"], end) == ("convgpu-history", 1, "test", 1, b"")
    key, runs = json.loads(line)
    assert key == "run:train" and runs[0]["gpus"] == {"0": [GiB, GiB - 64 * MiB, 64 * MiB, 1, 2 * GiB]}
    assert decode(encode(History())) == History()


def test_the_newest_runs_of_a_job_are_kept_and_only_the_newest_keep_their_series():
    h = History()
    for i in range(store.MAX_RUNS + 2):
        h = add(h, RUN, [run(f"r{i}", 100.0 + i)])
    h = add(h, RUN, [run("r11", 111.0)])          # the same run again: kept once
    kept = h.runs("run:train")
    assert [r.id for r in kept] == [f"r{i}" for i in range(2, 12)]
    assert [r.series is not None for r in kept] == [False] * 7 + [True] * 3
    assert decode(encode(h)) == h


def test_a_full_history_drops_the_oldest_job_of_the_scope_with_the_most(monkeypatch):
    """A namespace that invents job names pushes out its own jobs first, never another's."""
    monkeypatch.setattr(store, "MAX_JOBS", 4)
    h = History()
    for i, key in enumerate(("k8s:b/Job/x/c", "k8s:a/Job/1/c", "k8s:a/Job/2/c", "podman:web")):
        h = add(h, parse_key(key), [run(f"r{i}", 10.0 + i)])
    h = add(h, parse_key("k8s:a/Job/3/c"), [run("r9", 50.0)])
    assert sorted(h.jobs) == ["k8s:a/Job/2/c", "k8s:a/Job/3/c", "k8s:b/Job/x/c", "podman:web"]
    h = add(h, parse_key("k8s:a/Job/4/c"), [run("r10", 60.0)])   # namespace a again: its own oldest goes
    assert sorted(h.jobs) == ["k8s:a/Job/3/c", "k8s:a/Job/4/c", "k8s:b/Job/x/c", "podman:web"]
    h = add(h, parse_key("docker:db"), [run("r11", 70.0)])      # a has 2, the others 1: a's oldest
    assert sorted(h.jobs) == ["docker:db", "k8s:a/Job/4/c", "k8s:b/Job/x/c", "podman:web"]


def test_one_user_that_invents_jobs_evicts_only_its_own(monkeypatch):
    """Issue 47 finding 7 (b): users of one host (rootless podman, a login session's scope, a
    user's units) had one scope per kind, so one user's 256 names evicted every other user's
    jobs of that kind. A container in a user's slice (systemd's /user.slice/user-UID.slice, a
    path only root names) is that user's job and that user's scope: a flood pushes out its own."""
    monkeypatch.setattr(store, "MAX_JOBS", 4)

    def session(uid, n):
        cg = f"/user.slice/user-{uid}.slice/session-{n}.scope"
        return identify("systemd", cg, cg, f"session-{n}.scope")
    other = session(1001, 2)
    rootless = identify("podman", "ab" * 32, "/user.slice/user-1001.slice/user@1001.service/user.slice/libpod-"
                        + "ab" * 32 + ".scope", "web")
    unit = identify("systemd", "/system.slice/train.service", "/system.slice/train.service", "train.service")
    assert (other.key, other.scope) == ("systemd@1001:session-2.scope", "user:1001")
    assert (rootless.key, rootless.scope) == ("podman@1001:web", "user:1001")
    assert (unit.key, unit.scope) == ("systemd:train.service", "systemd")
    assert parse_key(other.key) == other and parse_key(rootless.key) == rootless
    h = History()
    for i, job in enumerate((other, rootless, unit)):
        h = add(h, job, [run(f"r{i}", 10.0 + i)])
    for n in range(6):              # user 1000 logs in again and again, a GPU job in each session
        h = add(h, session(1000, 100 + n), [run(f"f{n}", 100.0 + n)])
    assert sorted(h.jobs) == ["podman@1001:web", "systemd:train.service", "systemd@1000:session-105.scope",
                              "systemd@1001:session-2.scope"]
    # a name can never say whose it is: the owner is ours, from the container's path
    assert identify("systemd", "/evil", "/evil", "x@1001:y").key == "systemd:x%401001%3Ay"
    for forged in ("systemd@:x", "systemd@1x:x", "k8s@1000:a/b", "systemd@-1:x"):
        with pytest.raises(ValueError):
            parse_key(forged)


def test_a_file_too_large_drops_the_oldest_runs_series_first(monkeypatch):
    h = add(add(History(), RUN, [run("old", 10.0)]), Job("podman", "web"), [run("new", 20.0)])
    without_old = History({**h.jobs, "run:train": (run("old", 10.0, series=False),)})
    monkeypatch.setattr(store, "MAX_BYTES", len(encode(without_old)) + 20)
    got = decode(encode(h))
    assert got.runs("run:train")[0].series is None and got.runs("podman:web")[0].series is not None


def _lines(raw):
    head, *jobs, _ = raw.split(b"\n")
    return json.loads(head), [json.loads(x) for x in jobs]


def _resealed(head, jobs):
    """A file whose header counts and checksums these job lines: only its entries can be wrong."""
    import hashlib
    body = b"".join(json.dumps(j).encode() + b"\n" for j in jobs)
    return json.dumps({**head, "jobs": len(jobs), "sha256": hashlib.sha256(body).hexdigest()}).encode() + b"\n" + body


def _header(**change):
    return lambda raw: json.dumps({**_lines(raw)[0], **change}).encode() + raw[raw.index(b"\n"):]


def _jobs(fn):
    return lambda raw: _resealed(_lines(raw)[0], fn(_lines(raw)[1]))


@pytest.mark.parametrize("change, why", [
    (lambda raw: raw[:-20], "checksum does not match"),                    # cut short
    (lambda raw: raw[:20], "not JSON"),
    (lambda raw: raw + b'["run:x",[]]\n', "checksum does not match"),       # a line more
    (lambda raw: raw.replace(b'"limit":2147483648', b'"limit":4294967296'), "checksum does not match"),
    (_header(version=2), "written by a newer convgpu (format version 2; this one reads up to 1)"),
    (_header(format="x"), "not a convgpu-history file"),
    (_header(jobs=300), "its header gives 300 jobs (at most 256)"),
    (_header(jobs=2), "checksum does not match"),
    (_jobs(lambda jobs: [[jobs[0][0], jobs[0][1] * 11]]), "runs of 'run:train': at most 10"),
    (_jobs(lambda jobs: [["evil:x", jobs[0][1]]]), "job key 'evil:x'"),
    (_jobs(lambda jobs: [["run:z", []], ["run:a", []]]), "job 'run:a' out of order"),
    (_jobs(lambda jobs: [["run:a", []], ["run:a", []]]), "job 'run:a' out of order"),     # twice
    (_jobs(lambda jobs: [[jobs[0][0], [{**jobs[0][1][0], "stalls": -3}]]]), "an entry is not valid (stalls -3)"),
    (_jobs(lambda jobs: [[jobs[0][0], [{**jobs[0][1][0], "end": "<b>"}]]]), "an entry is not valid (end '<b>')"),
])
def test_a_file_that_fails_its_check_is_unreadable(change, why):
    raw = encode(add(History(), RUN, [run("a", 10.0)]))
    with pytest.raises(Unreadable) as e:
        decode(change(raw))
    assert why in str(e.value)


def test_a_file_is_read_with_caps(tmp_path, monkeypatch):
    f = HistoryFile(str(tmp_path))
    assert f.read() == History()                      # none yet
    (tmp_path / "elsewhere.json").write_bytes(encode(add(History(), RUN, [run("a", 10.0)])))
    os.symlink(tmp_path / "elsewhere.json", tmp_path / store.FILE)
    with pytest.raises(OSError):                      # never through a symlink (ELOOP)
        f.read()
    os.unlink(tmp_path / store.FILE)
    os.mkfifo(tmp_path / store.FILE)
    with pytest.raises(Unreadable, match="not a regular file"):
        f.read()
    os.unlink(tmp_path / store.FILE)
    (tmp_path / store.FILE).write_bytes(b" " * 101)
    monkeypatch.setattr(store, "MAX_BYTES", 100)
    with pytest.raises(Unreadable, match="101 bytes, more than a history file holds"):
        f.read()


def test_two_writers_add_to_what_the_file_holds(tmp_path):
    a, b = HistoryFile(str(tmp_path), "a"), HistoryFile(str(tmp_path), "b")
    a.append([(RUN, run("r1", 10.0))])
    got = b.append([(Job("podman", "web"), run("r2", 11.0)), (RUN, run("r1", 10.0))])
    assert {k: [r.id for r in v] for k, v in got.jobs.items()} == {"run:train": ["r1"], "podman:web": ["r2"]}
    assert a.read() == got and sorted(os.listdir(tmp_path)) == [".history.lock", store.FILE]


def seen(key="c1", held=0, demand=0, procs=(), limit=2 * GiB, assigned=2 * GiB, wait=None, dev=0, **kw):
    return Seen(key, RUN, "abc", limit, "convgpu run --limit",
                {dev: GpuSeen(held, 0, 64 * MiB, 1, limit, assigned, wait, demand)}, tuple(procs), **kw)


def proc(pid, peak, ctx=64 * MiB, allocs=1, dev=0):
    return ProcSeen(pid, pid * 10, dev, peak, ctx, 1, allocs)


def test_a_corrupt_file_is_reported_once_kept_as_it_is_and_written_once_moved_aside(tmp_path, caplog):
    path = tmp_path / store.FILE
    path.write_bytes(b'{"format": "convgpu-history", "version": 1, "jobs": 0, "sha256": "0"}\n')
    before = path.read_bytes()
    # from the start: the writer's thread (started by sample) reads the file too, and may be the
    # one that says it, before or after the flushes below (once, whoever: Recorder._failed)
    caplog.set_level(logging.ERROR, logger="convgpu.enforcer.history.recorder")
    r = Recorder(HistoryFile(str(tmp_path)), clock=lambda: 0.0)
    for t in (1.0, 2.0):
        r.sample([seen(procs=[proc(1, 100 * MiB)])], now=t)
    r.ended("c1", now=3.0)
    assert not r.flush() and not r.flush()
    assert path.read_bytes() == before and len(r.pending) == 1
    assert "checksum does not match" in r.error and str(path) in r.error
    assert r.status() == {"path": str(path), "state": "unreadable", "error": r.error, "live": 0, "pending": 1,
                          "dropped": 0, "jobs": 0, "writes": 0}
    assert [rec.getMessage().split(" (")[0] for rec in caplog.records] == ["job history cannot be read"]
    os.rename(path, tmp_path / "history.jsonl.bad")
    assert r.flush() and r.error == "" and r.pending == []
    assert (r.status()["state"], r.status()["jobs"], r.status()["writes"]) == ("ok", 1, 1)
    assert [x.peak for x in HistoryFile(str(tmp_path)).read().runs("run:train")] == [164 * MiB]


def test_runs_waiting_for_a_file_are_bounded(tmp_path, monkeypatch):
    from convgpu.enforcer.history import recorder
    monkeypatch.setattr(recorder, "MAX_PENDING", 3)
    (tmp_path / store.FILE).write_text("not json")
    r = Recorder(HistoryFile(str(tmp_path)))
    for i in range(5):
        r.sample([seen(key=f"c{i}")], now=float(i))
        r.ended(f"c{i}", now=i + 0.5)
    assert not r.flush() and len(r.pending) == 3 and r.dropped == 2
    assert [run.started for _, run in r.pending] == [2.0, 3.0, 4.0]


# ---- the recorder ----

def test_the_peak_is_what_was_held_never_what_was_asked_nor_a_sum_of_peaks():
    """Issue 52: a request that stalled a self-test child read as a peak of 676473.8 TiB (the
    demand of a stopped call counted), and trainB read 576 MiB where it held at most 448 (the
    peaks of processes that peaked at different times were summed). The peak is what the
    container held: the books' samples, one process's own exact peak where it is alone on the
    GPU, and what a process held as it exited."""
    r = Recorder()
    r.sample([seen(held=100 * MiB, procs=[proc(1, 300 * MiB, allocs=3)])], now=0.0)
    assert r.live["c1"].gpus[0][:2] == [364 * MiB, 300 * MiB]     # alone: its peak 300 and its context 64
    r.sample([seen(held=448 * MiB, procs=[proc(1, 300 * MiB, allocs=3), proc(2, 200 * MiB, allocs=2)])], now=1.0)
    assert r.live["c1"].gpus[0][0] == 448 * MiB                   # two: what they held together, not 300+200+128
    r.exited("c1", 2, {0: 500 * MiB})                             # 2 took more after its last sample
    assert r.live["c1"].gpus[0][0] == 500 * MiB
    r.sample([seen(held=50 * MiB, demand=1 << 60, procs=[proc(3, 0, allocs=0), proc(4, 0, allocs=0)])], now=2.0)
    r.ended("c1", now=3.0)                                         # stopped at a 1 EiB request: never held
    (job, got), = r.pending
    assert (job, got.peak, got.gpus[0].peak, got.allocs) == (RUN, 500 * MiB, 500 * MiB, 3 + 2)
    assert max(got.series.held[0]) * MiB == got.peak               # the plot's line and its title agree


def test_waits_and_the_time_waited_with_the_whole_limit_assigned():
    r = Recorder()
    r.sample([seen()], now=100.0)
    r.sample([seen(wait=100.5, assigned=GiB, stalls=1)], now=101.0)            # waits for the card
    r.sample([seen(wait=100.5, assigned=2 * GiB, stalls=1)], now=102.0)        # then on itself
    r.sample([seen(wait=102.5, assigned=2 * GiB, stalls=2)], now=103.0)
    r.sample([seen(stalls=2, stalled_s=2.5)], now=104.0)
    r.ended("c1", now=104.0)
    got = r.pending[0][1]
    assert (got.at_limit_s, got.stalls, got.stalled_s) == (2.0, 2, 2.5)
    assert got.series.waits == ((0.5, 2.0, 0), (2.5, 3.0, 0))


def test_a_long_run_keeps_a_bounded_series_with_its_maxima():
    r = Recorder()
    n = 5 * store.POINTS + 7
    for i in range(n):
        r.sample([seen(held=(900 if i == 333 else 100) * MiB, limit=GiB)], now=float(i))
    r.ended("c1", now=float(n))
    s = r.pending[0][1].series
    assert len(s.t) <= store.POINTS and s.t[0] == 0.0 and list(s.t) == sorted(s.t)
    assert max(s.held[0]) == 900 and min(s.held[0]) == 100 and set(s.limit[0]) == {1024} and set(s.ctx[0]) == {64}
    assert decode(encode(add(History(), RUN, [r.pending[0][1]]))).runs("run:train")[0].series == s


def test_a_run_begins_when_its_container_was_first_seen():
    r = Recorder()
    r.sample([Seen("c1", RUN, "abc", None, "", {0: GpuSeen(0, 0, 0, 0)}, since=95.5)], now=100.0)
    r.ended("c1", now=101.0)
    got = r.pending[0][1]
    assert (got.started, got.ended, got.series.t) == (95.5, 101.0, (4.5,))


def test_trace_ends_a_run_when_its_container_is_gone_and_close_keeps_runs_cut_short():
    r = Recorder(by="trace", absent_ends=True)
    r.sample([seen("a"), seen("b")], now=0.0)
    r.sample([seen("b")], now=1.0)
    assert [run.end for _, run in r.pending] == ["exit"] and set(r.live) == {"b"}
    r.close(now=2.0)
    assert r.pending == [] and not r.live       # no file: kept in memory
    assert [(run.end, run.by, run.ended) for run in r.latest.runs("run:train")] == [("exit", "trace", 1.0),
                                                                                   ("stopped", "trace", 2.0)]
    assert r.summary[0].job == "run:train" and r.summary[0].runs == 2


def test_what_the_books_show_the_recorder():
    """from_books: per container and GPU what the books hold, with the call it is stopped at
    (demand), its wait on the wall clock; per process BPF's peak and NVML's measured overhead
    where there is one (else the estimate per context); the job from the Kubernetes agent's
    entry, else `convgpu run --name`, else the container's name."""
    from types import SimpleNamespace

    from convgpu.enforcer.books import Ask, Books, Box, Wait
    from convgpu.enforcer.history.seen import from_books
    from convgpu.enforcer.tenants.containers import Container
    from convgpu.enforcer.tenants.limits import LimitRules, PodLimit
    from convgpu.probes.tracer import ProcUsage
    CTX = 500 * MiB
    state = {}
    b = Books({0: 8 * GiB}, {0: 8 * GiB}, lambda box, dev: state.get((box.key, dev)), lambda dev: CTX,
              lambda box, dev: box.limit)
    pod = Box(1, Container("kubernetes", "c" * 64, "/kubepods/podu/" + "c" * 64, "u"), "app", 0.0, 2 * GiB,
              "pod ml/web-1 app", {10, 11}, assigned={0: 2 * GiB})
    job = Box(2, Container("cgroup", "/convgpu.run/train-7", "/convgpu.run/train-7"), "train", 0.0, GiB,
              "convgpu run --limit", {20}, assigned={0: GiB}, stalls=1, stalled_s=2.0, over_limits=1)
    for x in (pod, job):
        b.boxes[x.container.id] = b.by_key[x.key] = x
    state[(1, 0)] = SimpleNamespace(used=300 * MiB, contexts=2, reserved=0, tearing=0)
    state[(2, 0)] = SimpleNamespace(used=900 * MiB, contexts=1, reserved=0, tearing=0)
    job.waiting[0] = Wait(95.0, {20}, asks={20: Ask(20, 20, 400 * MiB, 95.0)})
    job.going[0] = {21: Ask(20, 21, 64 * MiB, 90.0)}    # resumed, not past its recheck: not in the demand

    def row(pid, peak, contexts, n):
        return ProcUsage(pid, 0, pid, 7, "x", peak // 2, peak, n, 0, peak, 0, 0, contexts, 0)
    usage = [row(10, 200 * MiB, 1, 4), row(11, 100 * MiB, 1, 2), row(20, 900 * MiB, 1, 9), row(99, GiB, 1, 1)]
    rules = LimitRules(pods={"c" * 64: PodLimit(2 * GiB, "pod", False, (), "ml/Deployment/web/app")})
    got = {s.key: s for s in from_books(b, usage, {(10, 0): (520 * MiB, 1)}, lambda dev: CTX,
                                        {"/convgpu.run/train-7": "train"}, rules, mono=100.0, wall=1000.0)}
    p, j = got["c" * 64], got["/convgpu.run/train-7"]
    assert (p.job.key, p.container, p.limit) == ("k8s:ml/Deployment/web/app", "c" * 12, 2 * GiB)
    assert p.gpus == {0: GpuSeen(300 * MiB + 2 * CTX, 300 * MiB, 2 * CTX, 2, 2 * GiB, 2 * GiB, None, 300 * MiB + 2 * CTX)}
    assert p.procs == (ProcSeen(10, 10, 0, 200 * MiB, 520 * MiB, 1, 4), ProcSeen(11, 11, 0, 100 * MiB, CTX, 1, 2))
    assert (j.job.key, j.container, j.stalls, j.stalled_s, j.over_limits) == ("run:train", "/convgpu.run/train-7", 1, 7.0, 1)
    assert (p.since, j.since) == (900.0, 900.0)         # created at monotonic 0.0
    assert j.gpus[0].wait_since == 995.0 and j.gpus[0].demand == 900 * MiB + CTX + 400 * MiB
