"""The ways a workload runs in the benchmarks, one at a time: bare; probed (the tracer's
probes attached, as `convgpu trace`); enforced (`convgpu enforce` with room for everything, so
its cost and not its stalls is measured); shim (the preload shim under that enforcer);
shim-only (the shim under `convgpu enforce --no-probes`: the shim's own cost, no probes).

`probed@base` and `enforced@base` are the same with the tracer or enforcer run, as a child
process, from another install of the package (`baseline`: a folder made with `pip install
--target`, put first on its PYTHONPATH): before and after a change, taking turns in one run."""
import contextlib
import os
import subprocess
import sys
import tempfile
import time

from convgpu.probes import detach
from convgpu.probes.tracer import Tracer

MODES = ("bare", "probed", "enforced", "shim", "shim-only")
BASE = "@base"
BASE_MODES = ("probed" + BASE, "enforced" + BASE)

# The tracer as a child process: probed@base (the older package's Tracer) and, beside it, probed.
_TRACER = """import sys
from convgpu.probes.tracer import Tracer
t = Tracer(libraries=tuple(sys.argv[2:]), discover=sys.argv[1] == "1", selftest=False).start()
print("tracing", flush=True)
sys.stdin.read()
t.close()
"""


def baseline_env(baseline: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([baseline, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def package_of(baseline: str | None) -> str:
    """Where the package that a child process imports comes from (the check that the baseline's
    modes really run the older code: an editable install must not win over it)."""
    return subprocess.run([sys.executable, "-P", "-c", "import convgpu; print(convgpu.__file__)"],
                          env=baseline_env(baseline) if baseline else None, capture_output=True, text=True,
                          check=True).stdout.strip()


@contextlib.contextmanager
def running(mode: str, libs: tuple = (), standin: bool = False, times: dict | None = None,
            baseline: str | None = None, pids: list | None = None):
    """Yields (environment additions, tracer or None). `libs` are probed besides what discovery
    finds (only they, with `standin`): a runtime the workload will load is attached before it
    runs, not by a rescan in the middle of the measurement. `times` gets the enforcer's start-up:
    seconds from its exec to probes attached and self-tested ("enforcing:"). `baseline`: the
    install the @base modes run from. `pids` gets the process that holds the mode's programs."""
    tracer = enf = child = None
    env: dict = {}
    if mode.endswith(BASE) and (mode not in BASE_MODES or not baseline):
        raise SystemExit(f"mode {mode!r} needs --baseline-pythonpath and one of {', '.join(BASE_MODES)}")
    try:
        if mode == "probed" and not baseline:
            tracer = Tracer(libraries=libs, discover=not standin, selftest=False).start()
            if pids is not None:
                pids.append(os.getpid())
        elif mode in ("probed", "probed" + BASE):
            # With a baseline both run as a child, the same way: in the benchmark's own process
            # the probed mode measured about 1 us more than the same code as a child (stand-in,
            # 2026-11-25), which would pass for a difference between the two versions.
            child = subprocess.Popen([sys.executable, "-P", "-c", _TRACER, "0" if standin else "1", *libs],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=baseline_env(baseline) if mode.endswith(BASE) else None)
            if child.stdout.readline().strip() != "tracing":
                raise SystemExit(f"the baseline's tracer did not start (exit {child.wait()})")
            if pids is not None:
                pids.append(child.pid)
        elif mode in ("enforced", "shim", "shim-only", "enforced" + BASE):
            t0 = time.monotonic()
            enf, run_dir = start_enforcer(libs, standin, probes=mode != "shim-only",
                                          baseline=baseline if mode.endswith(BASE) else None)
            if pids is not None:
                pids.append(enf.pid)
            if times is not None:
                times.setdefault("enforcer_start_s", []).append(time.monotonic() - t0)
            if mode.startswith("shim"):
                from convgpu.cli.shim import shim_env
                env = shim_env(run_dir)
        elif mode != "bare":
            raise SystemExit(f"unknown mode {mode!r}: use {', '.join(MODES)}")
        yield env, tracer
    finally:
        if tracer:
            tracer.close()
        if child:
            child.stdin.close()
            child.wait(timeout=120)
        if enf:
            enf.terminate()
            enf.wait(timeout=120)
        # the next mode must find none of these probes, bare least of all (perf events are
        # detached by a child for seconds: the @base modes, or a kernel before 6.6)
        if not detach.wait_all(timeout=300):
            raise SystemExit("probes of the last mode still detaching after 300 s")


def start_enforcer(libs, standin: bool, probes: bool = True, baseline: str | None = None):
    run_dir = tempfile.mkdtemp(prefix="convgpu-bench-")
    argv = [sys.executable, "-P", "-m", "convgpu.cli.main", "enforce", "--gpu-memory", "64GiB", "--default-limit",
            "60GiB", "--run-dir", run_dir, "--state-dir", run_dir] + (["--no-discover"] if standin else []) + [f"--lib={x}" for x in libs] + ([] if probes else ["--no-probes"])
    enf = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=baseline_env(baseline) if baseline else None)
    for line in enf.stderr:
        if "enforcing:" in line:
            break
    else:
        raise SystemExit(f"the enforcer did not start (exit {enf.wait()})")
    subprocess.Popen(["cat"], stdin=enf.stderr, stdout=subprocess.DEVNULL)   # keep its pipe drained
    time.sleep(0.2)
    return enf, run_dir
