"""An operator's first day (issue 52), on the stand-in driver with real uprobes and cgroups and
the CLI as a user runs it (subprocesses): a limit no context fits in is refused at once; a
stalled `convgpu run` says what it waits for and when it resumes; a name two jobs share is an
error listing their ids; sizes without a unit and limits below what a container holds are
refused; a second enforcer on the host refuses, naming the first; `convgpu trace` outlives a
restart of the enforcer."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import Enforcing, MiB, lines_until, rest_of, run_dir_for

pytestmark = pytest.mark.system
CTX = "256MiB"   # what the enforcer charges a context (the operator's figure: --ctx-overhead)
ARGS = ("--gpu-memory", "5GiB", "--ctx-overhead", CTX)
START = 120      # s an enforcer may take to start: the session's first compiles its BPF program (35 s seen under load)


def run_job(enf, env, name, limit, *cmd):
    """`convgpu run --limit LIMIT --name NAME -- CMD` under enf, its pipes open."""
    return subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "run", "--limit", limit, "--name", name,
                             "--run-dir", enf.run_dir, "--", *map(str, cmd)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def end(procs, *enforcers):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for e in enforcers:
        if e:
            e.close()


def test_a_limit_no_context_fits_in_is_refused_and_a_stalled_run_says_why(build, env5, root):
    """A context costs 256 MiB here. `--limit tiny=128MiB` is said in the log at start;
    `run --limit 200MiB` is refused at once (before: it ran and its first CUDA call waited for
    good, and only the enforcer's log said why); `limit set` below a context too. A job over
    its limit says so on stderr with the command that frees it, and again when it resumes."""
    enf = Enforcing(build, *ARGS, "--limit", "tiny=128MiB", start_timeout=START)
    jobs = []
    try:
        assert any("--limit tiny (128.0 MiB) is below one CUDA context's charge on GPU0: 256.0 MiB (operator: "
                   "--ctx-overhead" in line for line in enf.log), enf.log
        jobs.append(run_job(enf, env5, "small", "200MiB", "/bin/true"))
        out, err = jobs[-1].communicate(timeout=30)
        assert jobs[-1].returncode == 1 and err.splitlines() == [
            "convgpu: --limit of small (200.0 MiB) is below one CUDA context's charge on GPU0: 256.0 MiB (operator: "
            "--ctx-overhead (the operator's figure on GPU0)): its first CUDA call would wait until the limit is "
            "raised; give at least 256.0 MiB (the context) plus what the job allocates"], err
        p = run_job(enf, env5, "slow", "512MiB", build / "cgcaller", "alloc", "-n", 1, "-s", 512 * MiB)
        jobs.append(p)
        seen = []
        said = lines_until(p.stderr, lambda line: "waits for GPU memory" in line, seen, 20, "convgpu run")
        cgroup = f"/convgpu.run/slow-{p.pid}"
        assert said == (f"convgpu run: slow waits for GPU memory: on GPU0 it needs 768.0 MiB, above its limit "
                        f"512.0 MiB, and waits until the limit is raised: `convgpu limit set {cgroup} SIZE "
                        f"--run-dir {enf.run_dir}`; `convgpu status --run-dir {enf.run_dir}` shows more"), seen
        r = enf.cli("limit", "set", cgroup, "255MiB", check=False)
        assert r.returncode == 1 and "(255.0 MiB) is below one CUDA context's charge on GPU0: 256.0 MiB" in r.stderr
        assert enf.cli("limit", "set", cgroup, "1GiB").stdout.strip() == "limit of slow set to 1.0 GiB"
        resumed = lines_until(p.stderr, lambda line: "resumed" in line, seen, 20, "convgpu run")
        assert resumed.startswith("convgpu run: slow resumed after ") and resumed.endswith("s"), resumed
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0 and f"allocated 1 {512 * MiB}" in out, err
    finally:
        end(jobs, enf)


def test_a_shared_name_is_an_error_listing_the_ids_and_sizes_need_units(build, env5, root):
    """Two `run --name same` jobs: `limit set same` is refused, naming both ids (before: it
    changed the first found, silently); status shows an id column, and an id picks one. A
    bare number is refused (before: `limit set X 4` set 4 bytes), so is a limit below what a
    container holds, unless --force. An empty status says so."""
    enf = Enforcing(build, *ARGS, start_timeout=START)
    jobs = []
    try:
        empty = enf.cli("status").stdout
        assert "no containers: none has made a CUDA call yet" in empty, empty
        for _ in range(2):
            jobs.append(run_job(enf, env5, "same", "1GiB", build / "cgcaller", "alloc", "-n", 1, "-s", 64 * MiB,
                                "--hold"))
            lines_until(jobs[-1].stdout, lambda line: line == "ready", [], 20, "job")
        ids = [f"/convgpu.run/same-{p.pid}" for p in jobs]
        r = enf.cli("limit", "set", "same", "2GiB", check=False)
        assert r.returncode == 1 and r.stderr.strip() == (
            f"convgpu: 'same' names 2 containers: id {ids[0]}, id {ids[1]}; give one of their ids "
            "(`convgpu status` shows them)"), r.stderr
        table = enf.cli("status").stdout
        rows = [[x.strip() for x in line.split("│")[1:-1]] for line in table.splitlines() if " same " in line]
        assert sorted(r[1] for r in rows) == sorted(f"same-{p.pid}" for p in jobs), table
        first = f"same-{jobs[0].pid}"
        r = enf.cli("limit", "set", first, "4", check=False)
        assert r.returncode == 1 and r.stderr.strip() == (
            "convgpu: SIZE '4' has no unit; did you mean 4GiB? write the unit: B for bytes, or K/M/G/T, "
            "KiB/MiB/GiB/TiB, KB/MB/GB/TB"), r.stderr
        r = enf.cli("limit", "set", first, "300MiB", check=False)   # it holds 64 MiB and a 256 MiB context
        assert r.returncode == 1 and r.stderr.strip() == (
            "convgpu: same holds 320.0 MiB on GPU0, more than 300.0 MiB: a lower limit stops it until it frees "
            "the difference; give at least 320.0 MiB, or add --force"), r.stderr
        assert enf.cli("limit", "set", first, "300MiB", "--force").stdout.strip() == "limit of same set to 300.0 MiB"
        st = enf.ctl(cmd="status")["status"]
        assert sorted((c["cgroup"], c["limit"]) for c in st["containers"]) == [(ids[0], 300 * MiB), (ids[1], 1 << 30)]
    finally:
        end(jobs, enf)


def test_one_enforcer_per_host_whatever_the_run_dir(build, root, tmp_path):
    """A second enforcer with a run dir of its own refuses at once, naming the first's pid and
    run dir (before: it started, and the two stalled each other's processes); a client on the
    wrong run dir is told where the enforcer is."""
    enf = Enforcing(build, *ARGS, start_timeout=START)
    second = None
    try:
        other = run_dir_for("second")
        second = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "enforce", "--no-discover", "--lib",
                                   str(build / "standin" / "libcuda.so.1"), "--run-dir", other, "--state-dir",
                                   str(tmp_path), *ARGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = second.communicate(timeout=30)
        lock = os.environ["CONVGPU_HOST_LOCK"]
        assert second.returncode == 1 and err.splitlines() == [
            f"convgpu: another enforcer runs on this host (pid {enf.p.pid}, run dir {enf.run_dir}; it holds {lock}); "
            "stop it first (`systemctl stop convgpu-enforce`, or its pid): one enforcer per host, as two would see "
            "and stall each other's processes"], err
        assert not os.path.exists(os.path.join(other, "control.sock"))
        r = subprocess.run([sys.executable, "-m", "convgpu.cli.main", "status", "--run-dir", other],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and f"one runs with --run-dir {enf.run_dir} (pid {enf.p.pid}); add --run-dir " \
            f"{enf.run_dir}" in r.stderr, r.stderr
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
        enf.close()


def test_trace_outlives_a_restart_of_the_enforcer(build, root):
    """`convgpu trace --json` against an enforcer that stops (a `systemctl restart`) says it is
    gone and goes on; the next enforcer on that run dir is found again (before: trace ended
    with `no enforcer answers ... start one`)."""
    enf = Enforcing(build, *ARGS, start_timeout=START)
    enf2 = tr = None
    try:
        tr = subprocess.Popen([sys.executable, "-m", "convgpu.cli.main", "trace", "--json", "--no-events",
                               "--interval", "0.2", "--run-dir", enf.run_dir], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        seen = []
        lines_until(tr.stdout, lambda line: f'"pid": {enf.p.pid}' in line, seen, 30, "trace")
        run_dir = enf.run_dir
        enf.p.send_signal(signal.SIGTERM)
        assert enf.p.wait(timeout=30) == 0
        gone = json.loads(lines_until(tr.stdout, lambda line: '"state": "gone"' in line, seen, 20, "trace"))
        assert gone["type"] == "enforcer" and "no enforcer answers on" in gone["error"]
        time.sleep(0.5)
        assert tr.poll() is None, rest_of(tr.stderr, 1)
        enf2 = Enforcing(build, *ARGS, run_dir=run_dir, start_timeout=START)
        back = json.loads(lines_until(tr.stdout, lambda line: '"state": "back"' in line, seen, 30, "trace"))
        assert back["pid"] == enf2.p.pid
        snap = json.loads(lines_until(tr.stdout, lambda line: '"type": "snapshot"' in line, seen, 10, "trace"))
        assert snap["enforce"]["pid"] == enf2.p.pid
    finally:
        if tr is not None:
            tr.kill()
            tr.wait()
        for e in (enf2, enf):
            if e:
                e.close()


class Tmux:
    """A terminal of a given size (a tmux server of the test's own): what a user sees."""

    def __init__(self, name: str, cols: int, rows: int, command: str):
        self.sock, self.name = f"convgpu-{os.getpid()}-{name}", name
        # the command's end is said on screen, so a test sees it quit
        self.tmux("new-session", "-d", "-x", str(cols), "-y", str(rows), "-s", name,
                  f"{command}; echo; echo TRACE-EXITED $?; sleep 60")

    def tmux(self, *args) -> str:
        return subprocess.run(["tmux", "-L", self.sock, "-f", "/dev/null", *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout

    def screen(self) -> list[str]:
        return self.tmux("capture-pane", "-p", "-t", self.name).splitlines()

    def until(self, cond, timeout: float, what: str) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            lines = self.screen()
            if cond("\n".join(lines)):
                return lines
            assert time.monotonic() < deadline, f"{what} not on the {self.name} screen: {lines}"
            time.sleep(0.2)

    def close(self):
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, timeout=30)


def test_the_live_view_fits_80x24_and_160x45_says_when_the_enforcer_goes_and_q_quits(build, env5, root):
    """`convgpu trace` against an enforcer, in terminals of 80x24 and 160x45: everything fits
    (header, GPUs, the job in both tables under one name, the enforcer's table, the events, the
    footer), the job has one name and an id, a context is an event named so, the header does
    not claim an NVIDIA driver; when the enforcer stops the view says so and stays; `q` ends it.
    Before: columns were cut at 80, the events pushed off, `q` did nothing, and trace ended."""
    need_tmux = subprocess.run(["tmux", "-V"], capture_output=True).returncode == 0
    assert need_tmux, "tmux is missing: scripts/setup.sh installs it"
    enf = Enforcing(build, *ARGS, start_timeout=START)
    job, terms = None, []
    try:
        job = run_job(enf, env5, "held", "1GiB", build / "cgcaller", "alloc", "-n", 2, "-s", 64 * MiB, "--hold")
        lines_until(job.stdout, lambda line: line == "ready", [], 20, "job")
        cmd = f"{sys.executable} -m convgpu.cli.main trace --interval 0.3 --run-dir {enf.run_dir}"
        terms = [Tmux("narrow", 80, 24, cmd), Tmux("wide", 160, 45, cmd)]
        for t, width in zip(terms, (80, 100)):
            lines = t.until(lambda s: "recent events" in s and "held" in s, 30, "the job and the events")
            screen = "\n".join(lines)
            assert max(map(len, lines)) <= width, screen
            assert lines[0].startswith("convgpu trace  tracing CUDA calls (1 library probed)") and \
                lines[0].rstrip().endswith("q or Ctrl-C to end") and "NVIDIA" not in lines[0], screen
            named = [line for line in lines if line.startswith("held ")]
            assert len(named) == 2 and all(f"held-{job.pid}" in x for x in named), screen
            assert "held-" not in screen.replace(f"held-{job.pid}", ""), screen   # one name; the id beside it
            ours = named[1].split()      # the enforcer's row: limit, (assigned,) used (64 MiB x 2 and a context)
            assert "1.0 GiB" in " ".join(ours) and "384.0 MiB" in " ".join(ours) and "running" in ours, screen
            assert any(" context " in line and "cuDevicePrimaryCtxRetain" in line for line in lines), screen
            assert lines[-1].startswith("probed (1): ") or "probed (1)" in screen, screen
        enf.p.send_signal(signal.SIGTERM)
        assert enf.p.wait(timeout=30) == 0
        for t in terms:
            t.until(lambda s: "enforcer gone" in s and "reconnecting" in s, 20, "enforcer gone")
            t.tmux("send-keys", "-t", t.name, "q")
            t.until(lambda s: "TRACE-EXITED 0" in s, 10, "trace ended by q")
    finally:
        for t in terms:
            t.close()
        end([job] if job else [], enf)


def test_doctor_as_nobody_blames_permissions_and_ends_with_one_verdict(root, short_tmp):
    """Issue 52: as non-root, `doctor` blamed the kernel (tracefs unreadable read as "a kernel
    with CONFIG_FTRACE_SYSCALLS"), split paths in a 100-column table, and had no verdict. As
    nobody, in an 80-column terminal: every path whole on its line, what needs root says so,
    and the last line is the verdict (exit 1: not root)."""
    state = short_tmp / ("a-state-dir-with-a-long-name-" * 3)
    state.mkdir()
    os.chmod(short_tmp, 0o755)
    r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-m",
                        "convgpu.cli.main", "doctor", "--state-dir", str(state)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, COLUMNS="80"))
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 1 and lines[-1] == ("convgpu: verdict: NOT READY: root failed; `convgpu trace` and "
                                               "`convgpu enforce` cannot work here until each is fixed (the fixes "
                                               "are above)"), lines
    assert f"warn decisions         not checked: needs root ({state} is not writable: run-time limits and names " \
        "would be refused)" in lines, lines     # the path whole, on one line
    tp = next(line for line in lines if line.startswith("warn open tracepoints"))
    assert tp.endswith("not checked: needs root (tracefs is root's)") and "CONFIG_FTRACE" not in "\n".join(lines)


def test_a_tenant_sees_its_own_wait_from_inside_and_nothing_of_its_neighbour(build, env5, root):
    """Issue 52 item 13: `convgpu status --mine`, run as nobody inside a job's cgroup, asks the
    shim socket (no root, no control socket) and is told its own container's limit, use and
    wait, and what to ask the operator; a neighbour's name never shows."""
    from convgpu.enforcer.tenants.cgroupfs import cgroup_layout
    enf = Enforcing(build, *ARGS, start_timeout=START)
    jobs = []
    try:
        os.chmod(enf.run_dir, 0o755)    # as /run/convgpu is: the shim socket is for everyone
        jobs.append(run_job(enf, env5, "neighbour", "1GiB", build / "cgcaller", "alloc", "-n", 1, "-s", 64 * MiB,
                            "--hold"))
        lines_until(jobs[-1].stdout, lambda line: line == "ready", [], 20, "neighbour")
        jobs.append(run_job(enf, env5, "waiter", "512MiB", build / "cgcaller", "alloc", "-n", 1, "-s", 512 * MiB))
        lines_until(jobs[-1].stderr, lambda line: "waits for GPU memory" in line, [], 20, "waiter")
        cg = cgroup_layout().v2_root + f"/convgpu.run/waiter-{jobs[-1].pid}"
        r = subprocess.run(["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec setpriv --reuid=nobody '
                            '--regid=nogroup --clear-groups "$0" "$@"', sys.executable, "-m", "convgpu.cli.main",
                            "status", "--mine", "--run-dir", enf.run_dir], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "CONVGPU_SHIM_SOCKET"})
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "container waiter: limit 512.0 MiB (convgpu run --limit)", lines
        assert lines[1].startswith("GPU0: uses 256.0 MiB of its limit 512.0 MiB (a CUDA context counts 256.0 MiB), "
                                   "512.0 MiB assigned; WAITS ") and lines[1].endswith(
            ": it needs 768.0 MiB, above its limit; only a higher limit lets it go on: ask the operator "
            "(`convgpu limit set`)"), lines
        assert "neighbour" not in r.stdout and len(lines) == 2
    finally:
        end(jobs, enf)
