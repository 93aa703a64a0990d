"""Issue 31: run-time decisions survive a restart of `convgpu enforce` (kill -9, a clean stop
and start as `systemctl restart` does), and the state dir's faults. A real enforcer subprocess on
the stand-in driver, real cgroups: `convgpu run --limit --name`, `convgpu limit set` and the
Kubernetes agent's `pod-limits` are given at run time; after each restart `convgpu status --json`
shows every container with the limit, source and name it had, and a process that allocates
past the default within its limit runs. An entry goes with its cgroup, and a new cgroup at the
same path is a new container. A write the state dir refuses (read-only, full) is refused to the
client in one line, changes nothing, and the enforcer goes on; a decisions file that cannot be
read is kept, reported, and holds every container until it is repaired."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import Enforcing, GiB, MiB, popen_in, read_until, start_in, stop_all, until, wait_state
from convgpu.enforcer.tenants import decisionfile, durable
from convgpu.enforcer.tenants.limits import PodLimit

pytestmark = pytest.mark.system
ARGS = ("--gpu-memory", "6GiB", "--default-limit", "1GiB")
UID, CID = "0c0c0c0c-1111-2222-3333-444444444444", "c3" * 32


def status(enf) -> dict:
    return json.loads(enf.cli("status", "--json").stdout)


def rows(enf) -> dict:
    return {c["cgroup"]: (c["name"], c["limit"], c["source"]) for c in status(enf)["containers"]}


def run_job(enf, env, name, limit, *cmd):
    """`convgpu run --limit LIMIT --name NAME -- CMD` (its stdin piped to CMD)."""
    return subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "run", "--limit", limit, "--name", name,
                             "--run-dir", enf.run_dir, "--", *map(str, cmd)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def ready(p) -> str:
    """The caller's lines up to `ready`; its stderr if it ended before."""
    try:
        return " ".join(read_until(p, "ready"))
    except AssertionError as e:
        raise AssertionError(f"{e}; exit {p.poll()}, stderr: {p.stderr.read() if p.poll() is not None else ''}") from None


def job_cgroup(p, name) -> str:
    from convgpu.cli.run import PARENT
    return f"{PARENT}/{name}-{p.pid}"


def v2(path) -> str:
    from convgpu.enforcer.tenants.containers import cgroup_layout
    return cgroup_layout().v2_root + path


def restart(enf, how):
    if how == "kill -9":
        enf.p.kill()
        enf.p.wait()
        enf.wait_for("probes kept for a successor")   # the watchdog's line: it resumed what was held
    else:
        assert enf.stop() == 0                        # systemctl restart: SIGTERM, then a new start
    return enforcing(enf.build, *enf.args, run_dir=enf.run_dir)


def end(procs, *enforcers):
    """A test's finally: `convgpu run` jobs end as at a Ctrl-C (their cgroups removed), others killed."""
    for p in procs:
        if p and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    stop_all((), *enforcers)


def enforcing(build, *args, **kw):
    enf = Enforcing(build, *args, **kw)
    enf.build, enf.args = build, args
    return enf


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_run_time_limits_and_names_survive_restarts(cgroups, build, env5, how):
    """Three restarts in a row. Before them: a `convgpu run` job (1536 MiB, "jobx") holding 1 GiB,
    a registered job that has made no CUDA call yet ("idle", 768 MiB), a container given 2 GiB
    by `limit set`, a pod's container given 1280 MiB by the agent. After each: the same rows in
    `status` (kill -9: at once, from the pinned maps; a clean stop: as each calls CUDA again),
    and a process that allocates above the 1 GiB default within each limit runs."""
    enf = enforcing(build, *ARGS)
    procs = []
    try:
        jobx = run_job(enf, env5, "jobx", "1536MiB", build / "cgcaller", "alloc", "-n", 1, "-s", GiB, "--hold")
        procs.append(jobx)
        ready(jobx)
        idle = run_job(enf, env5, "idle", "768MiB", "/bin/sleep", "600")
        procs.append(idle)
        cg_x, cg_idle = job_cgroup(jobx, "jobx"), job_cgroup(idle, "idle")
        until(lambda: durable.FILE in os.listdir(enf.state_dir) and cg_idle in
              json.load(open(f"{enf.state_dir}/{durable.FILE}"))["decisions"]["runs"], 20, "idle registered")
        lim = cgroups("lim")
        procs.append(start_in(lim, build, env5, "alloc", "-n", 1, "-s", 512 * MiB, "--hold"))
        ready(procs[-1])
        enf.cli("limit", "set", "lim", "2GiB")
        pod = cgroups(f"kubepods/besteffort/pod{UID}/{CID}")
        r = enf.ctl(cmd="pod-limits", limits={CID: [1280 * MiB, "pod ml/p c: 5 x 256 MiB convgpu.io/gpu-memory"]})
        assert r["ok"], r
        procs.append(start_in(pod, build, env5, "alloc", "-n", 1, "-s", 256 * MiB, "--hold"))
        ready(procs[-1])
        cg_lim, cg_pod = str(lim)[len(v2("")):], str(pod)[len(v2("")):]
        want = {cg_x: ("jobx", 1536 * MiB, "convgpu run --limit"), cg_lim: ("lim", 2 * GiB, "convgpu limit set"),
                cg_pod: (CID[:12], 1280 * MiB, "pod ml/p c: 5 x 256 MiB convgpu.io/gpu-memory")}
        assert rows(enf) == want
        for n in range(3):
            enf = restart(enf, how)
            if how == "kill -9":                            # adopted at once, each with its decision
                assert rows(enf) == want, (n, enf.log)
            # each container: a new process allocating past the 1 GiB default, within its limit
            extra = {cg_x: 384 * MiB, cg_lim: 1280 * MiB, cg_pod: 1024 * MiB, cg_idle: 640 * MiB}
            news = []
            try:
                for cg, size in extra.items():
                    news.append(popen_in(v2(cg), build / "cgcaller", "alloc", "-n", 1, "-s", size, "--hold", env=env5))
                    assert f"allocated 1 {size}" in ready(news[-1]), (cg, n, enf.log[-20:])
                got = rows(enf)
            finally:
                stop_all(news)
            assert {k: got[k] for k in want} == want, (n, got)
            assert got[cg_idle] == ("idle", 768 * MiB, "convgpu run --limit"), got   # registered before its first CUDA call
            st = status(enf)["decisions"]
            assert (st["state"], st["runs"], st["limits"], st["pods"]) == ("ok", 2, 1, 1), st
    finally:
        end(procs, enf)


def test_each_decision_is_on_disk_before_it_is_acknowledged(cgroups, build, env5):
    """kill -9 right after each decision is acknowledged, before any other could write the file
    for it: `limit set`, a `convgpu run` registration, the agent's pod limits. Each successor
    has every decision made so far (in the test above a later write saved an earlier decision
    kept only in memory, and that passed)."""
    enf = enforcing(build, *ARGS)
    procs = []
    try:
        lim = cgroups("lim")
        procs.append(start_in(lim, build, env5, "alloc", "-n", 1, "-s", 512 * MiB, "--hold"))
        ready(procs[-1])
        cg_lim = str(lim)[len(v2("")):]

        def registered(e) -> dict:
            return {(r["what"], r["name"]): r["limit"] for r in status(e)["registered"]}
        want_rows, want_registered = {}, {}

        def successor(e, what):
            e = restart(e, "kill -9")
            got = rows(e)
            assert {k: got.get(k) for k in want_rows} == want_rows, (what, got, e.log[-20:])
            assert registered(e) == want_registered, (what, registered(e))
            return e
        assert enf.cli("limit", "set", "lim", "2GiB").stdout.strip() == "limit of lim set to 2.0 GiB"
        want_rows[cg_lim] = ("lim", 2 * GiB, "convgpu limit set")
        enf = successor(enf, "limit set")
        job = run_job(enf, env5, "idle", "768MiB", "/bin/sh", "-c", "echo started; exec sleep 600")
        procs.append(job)
        assert job.stdout.readline().strip() == "started"   # registered: the job runs only after
        want_registered[("registered", "idle")] = 768 * MiB
        enf = successor(enf, "convgpu run")
        r = enf.ctl(cmd="pod-limits", limits={CID: [1280 * MiB, "pod ml/p c: 5 x 256 MiB convgpu.io/gpu-memory"]})
        assert r["ok"], r
        want_registered[("pod", CID)] = 1280 * MiB
        enf = successor(enf, "pod limits")
    finally:
        end(procs, enf)


def test_an_entry_goes_with_its_cgroup_and_a_new_cgroup_there_is_new(cgroups, build, env5):
    """`limit set` on a container, then it is removed and a new cgroup made at its path (a
    container restarted under the same name): the new one gets the default, not the old limit,
    also across a kill -9 in between; a `convgpu run` job's entry leaves the file when it ends."""
    enf = enforcing(build, *ARGS)
    procs = []
    try:
        lim = cgroups("again")
        p = start_in(lim, build, env5, "alloc", "-n", 1, "-s", 256 * MiB, "--hold")
        ready(p)
        enf.cli("limit", "set", "again", "3GiB")
        job = run_job(enf, env5, "short", "2GiB", "/bin/true")
        assert job.wait(timeout=30) == 0
        p.kill()
        p.wait()
        enf.wait_for("container again exited")
        decisions = lambda: json.load(open(f"{enf.state_dir}/{durable.FILE}"))["decisions"]   # noqa: E731
        cg = str(lim)[len(v2("")):]
        assert decisions()["limits"][cg]["limit"] == 3 * GiB   # its cgroup is still there: kept
        os.rmdir(lim)
        os.mkdir(lim)                                          # the same path, a new cgroup
        enf.p.kill()
        enf.p.wait()
        enf = enforcing(build, *ARGS, run_dir=enf.run_dir)     # reads the file: both entries gone
        assert decisions() == {"runs": {}, "limits": {}, "pods": {}, "claims": {}}
        p = start_in(lim, build, env5, "alloc", "-n", 1, "-s", 256 * MiB, "--hold")
        procs.append(p)
        ready(p)
        assert rows(enf)[cg] == ("again", GiB, "default")
        # and while running: a job's entry goes within the sweep once its cgroup is removed
        job = run_job(enf, env5, "later", "2GiB", "/bin/sleep", "1")
        until(lambda: len(decisions()["runs"]) == 1, 20, "registered")
        assert job.wait(timeout=30) == 0
        until(lambda: decisions()["runs"] == {}, 10, "the entry dropped once its cgroup went")
        enf.wait_for("decisions of containers that are gone dropped: convgpu run /convgpu.run/later-")
    finally:
        end(procs, enf)


@pytest.fixture
def small_dir(tmp_path):
    """mount(kind) -> a directory that is a read-only bind mount ("ro") or a 64 KiB tmpfs
    ("full"); unmounted after the test."""
    mounted = []

    def mount(kind):
        d = tmp_path / kind
        d.mkdir()
        if kind == "ro":
            subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
            mounted.append(d)
            subprocess.run(["mount", "-o", "remount,ro,bind", str(d)], check=True)
        else:
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], check=True)
            mounted.append(d)
        return d
    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize("kind", ["ro", "full"])
def test_a_state_dir_that_refuses_writes_refuses_decisions_and_enforcing_goes_on(cgroups, build, env5, small_dir, kind):
    """A decision the state dir cannot keep is never acknowledged: `limit set` and `convgpu run`
    fail with one line each and change nothing (the waiter over its limit goes on waiting, the
    job never starts and leaves no cgroup), status says why; the enforcer keeps enforcing (a
    stall and its resume). Once the state dir takes writes again, the same commands work."""
    d = small_dir(kind)
    enf = enforcing(build, *ARGS, state_dir=str(d))
    procs = []
    try:
        if kind == "ro":
            with pytest.raises(OSError):
                open(d / "probe", "w").close()
        else:
            fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)   # leaves no room for the file
            try:
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
        over = start_in(cgroups("over"), build, env5, "alloc", "-n", 1, "-s", 1536 * MiB, "--hold")
        procs.append(over)
        enf.wait_for("above its limit 1.0 GiB")
        wait_state(over.pid, "T")
        r = enf.cli("limit", "set", "over", "2GiB", check=False)
        err = "Read-only file system" if kind == "ro" else "No space left on device"
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"the limit of over is not kept: cannot write {d}/{durable.FILE} ({err}); nothing changed" in \
            r.stderr.replace("\n", ""), r.stderr
        job = run_job(enf, env5, "refused", "2GiB", "/bin/sh", "-c", "echo started")
        out, errtext = job.communicate(timeout=30)
        assert job.returncode == 1 and "started" not in out and "is not kept" in errtext, errtext
        assert not os.path.exists(v2(job_cgroup(job, "refused")))
        st = status(enf)
        [c] = st["containers"]
        assert (c["limit"], c["source"], c["gpus"]["0"]["waiting"]) == (GiB, "default", True)
        assert st["decisions"]["write_error"] == err and st["decisions"]["runs"] == 0
        assert "could not be kept" in enf.cli("status").stdout.replace("\n", " ")
        # still enforcing: a stall, and its resume when memory frees
        a = start_in(cgroups("a"), build, env5, "alloc", "-n", 1, "-s", GiB, "--hold")
        procs.append(a)
        ready(a)
        wait_state(over.pid, "T")
        # the state dir takes writes again: the decision is kept, the waiter runs
        if kind == "ro":
            subprocess.run(["mount", "-o", "remount,rw,bind", str(d)], check=True)
        else:
            os.unlink(d / "filler")
        assert enf.cli("limit", "set", "over", "2GiB").stdout.strip() == "limit of over set to 2.0 GiB"
        assert f"allocated 1 {1536 * MiB}" in ready(over)
        assert json.load(open(d / durable.FILE))["decisions"]["limits"]
        assert status(enf)["decisions"]["write_error"] == ""
        assert enf.p.poll() is None
    finally:
        end(procs, enf)


def test_an_unreadable_decisions_file_holds_every_container_until_it_is_repaired(cgroups, build, env5, tmp_path):
    """A decisions file cut short (or from a newer convgpu): the enforcer starts (enforcing the
    card), says so in one line, and keeps the file as it was. Every container is held: a new
    allocation waits, never killed even under --over-limit kill; `limit set` is refused. Moved
    aside and `convgpu reload`: the limits are the rules' again and the waiter runs."""
    state = tmp_path / "state"
    state.mkdir()
    good = decisionfile.encode(decisionfile.Decisions().with_pods({CID: PodLimit(GiB, "pod")}))
    (state / durable.FILE).write_bytes(good[:len(good) // 2])
    before = (state / durable.FILE).read_bytes()
    enf = enforcing(build, *ARGS, "--over-limit", "kill", state_dir=str(state))
    p = None
    try:
        [line] = [x for x in enf.log if "decisions unreadable:" in x]   # said before "enforcing:"
        assert f"{state / durable.FILE}: not JSON" in line and "every container is held" in line
        p = start_in(cgroups("held"), build, env5, "alloc", "-n", 1, "-s", 256 * MiB, "--hold")
        enf.wait_for("held: its limit is unknown: the run-time decisions could not be read")
        wait_state(p.pid, "T")                                  # waits, not killed
        st = status(enf)
        assert st["decisions"]["state"] == "unreadable" and "not JSON" in st["decisions"]["error"]
        [c] = st["containers"]
        assert c["limit"] == 0 and c["source"].startswith("unknown: ")
        r = enf.cli("limit", "set", "held", "2GiB", check=False)
        assert r.returncode == 1 and "could not be read at start" in r.stderr, r.stderr
        time.sleep(0.5)
        assert p.poll() is None and (state / durable.FILE).read_bytes() == before
        os.rename(state / durable.FILE, state / "decisions.json.bad")   # the operator moves it aside
        enf.cli("reload")
        enf.wait_for("decisions read again from")
        assert f"allocated 1 {256 * MiB}" in ready(p)
        assert status(enf)["containers"][0]["source"] == "default"
        assert (state / "decisions.json.bad").read_bytes() == before
    finally:
        end([p], enf)


def test_two_enforcers_on_one_state_dir(build, env5, tmp_path):
    """A second enforcer (another run dir: a test's, a benchmark's) on a state dir one already
    keeps its decisions in starts, reads them, and refuses every decision given to it: each
    would write its own value over the other's."""
    enf = enforcing(build, *ARGS, state_dir=str(tmp_path))
    enf2 = None
    jobs = []
    try:
        # shim only: two enforcers probing one driver stop each other's self-test children
        # and a host lock of its own: one enforcer per host is the rule (enforcer/hostlock.py)
        enf2 = enforcing(build, *ARGS, state_dir=str(tmp_path), no_bpf=True,
                         env=dict(os.environ, CONVGPU_HOST_LOCK=str(tmp_path / "second.lock")))
        assert any(f"another enforcer keeps its decisions in {tmp_path}" in x for x in enf2.log), enf2.log
        jobs.append(run_job(enf2, env5, "second", "1GiB", "/bin/true"))
        out, err = jobs[-1].communicate(timeout=30)
        assert jobs[-1].returncode == 1 and "is not kept: another enforcer keeps its decisions in" in err, err
        assert status(enf2)["decisions"]["state"] == "another enforcer's"
        jobs.append(run_job(enf, env5, "first", "1GiB", "/bin/true"))
        assert jobs[-1].wait(timeout=30) == 0                 # the first keeps its own
    finally:
        end(jobs, enf2, enf)


def test_a_restart_at_once_waits_for_the_old_watchdog(cgroups, build, env5):
    """systemd restarts a killed enforcer at once: the new one can read the state file before
    the old one's watchdog has marked it orphaned (here the watchdog is held stopped for 1 s).
    It waits for it and takes over the accounting, rather than taking the file for stale and
    clearing the pinned maps (the accounting started afresh: a container's bytes unknown)."""
    enf = enforcing(build, *ARGS)
    enf2 = p = None
    try:
        p = start_in(cgroups("x"), build, env5, "alloc", "-n", 1, "-s", GiB, "--hold")
        ready(p)
        wd = json.load(open(f"{enf.run_dir}/held-{enf.p.pid}.json"))["watchdog"]
        os.kill(wd, signal.SIGSTOP)                 # a slow watchdog
        enf.p.kill()
        enf.p.wait()
        threading.Timer(1.0, os.kill, (wd, signal.SIGCONT)).start()
        enf2 = enforcing(build, *ARGS, run_dir=enf.run_dir)
        assert any(f"took over from enforcer {enf.p.pid}: 1 containers" in x for x in enf2.log), enf2.log
        [c] = status(enf2)["containers"]
        assert (c["name"], c["gpus"]["0"]["used"], c["pids"]) == ("x", GiB, [p.pid])
    finally:
        end([p], enf2, enf)


def test_limit_set_finds_a_run_job_before_its_first_cuda_call(build, env5):
    """Issue 39 part 4: `convgpu limit set t1 2GiB` right after `convgpu run --name t1` started,
    before the job's first CUDA call. Before, "no container 't1' is known to the enforcer", and
    the job ran under its 1 GiB. Now `status` lists it as registered, the new limit is kept and
    in force from its first call: 1,536 MiB in two contexts' worth of room run at once."""
    enf = enforcing(build, *ARGS)
    job = None
    try:
        job = run_job(enf, env5, "t1", "1GiB", "/bin/sh", "-c", f'read x; exec {build}/cgcaller alloc -n 1 -s 1536M --hold')
        until(lambda: any(r["name"] == "t1" for r in status(enf).get("registered", [])), 20, "t1 registered")
        r = enf.cli("limit", "set", "t1", "2GiB")
        assert "limit of t1 set to 2.0 GiB" in r.stdout
        st = status(enf)
        assert [(r["name"], r["limit"], r["source"]) for r in st["registered"]] == [("t1", 2 * GiB, "convgpu limit set")]
        assert "registered" in enf.cli("status").stdout
        job.stdin.write("go\n")
        job.stdin.flush()
        assert "allocated 1 1610612736" in ready(job)
        (row,) = [c for c in status(enf)["containers"] if c["name"] == "t1"]
        assert (row["limit"], row["source"], row["gpus"]["0"]["used"]) == (2 * GiB, "convgpu limit set", 1536 * MiB)
        assert status(enf)["registered"] == []
    finally:
        end([job], enf)
