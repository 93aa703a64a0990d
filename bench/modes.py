"""The ways a workload runs in the benchmarks, one at a time: bare; probed (the tracer's
probes attached, as `convgpu trace`); enforced (`convgpu enforce` with room for everything, so
its cost and not its stalls is measured); shim (the preload shim under that enforcer);
shim-only (the shim under `convgpu enforce --no-probes`: the shim's own cost, no probes)."""
import contextlib
import subprocess
import sys
import tempfile
import time

from convgpu.probes.tracer import Tracer

MODES = ("bare", "probed", "enforced", "shim", "shim-only")


@contextlib.contextmanager
def running(mode: str, libs: tuple = (), standin: bool = False, times: dict | None = None):
    """Yields (environment additions, tracer or None). `libs` are probed besides what discovery
    finds (only they, with `standin`): a runtime the workload will load is attached before it
    runs, not by a rescan in the middle of the measurement. `times` gets the enforcer's start-up:
    seconds from its exec to probes attached and self-tested ("enforcing:")."""
    tracer = enf = None
    env: dict = {}
    try:
        if mode == "probed":
            tracer = Tracer(libraries=libs, discover=not standin, selftest=False).start()
        elif mode in ("enforced", "shim", "shim-only"):
            t0 = time.monotonic()
            enf, run_dir = start_enforcer(libs, standin, probes=mode != "shim-only")
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
        if enf:
            enf.terminate()
            enf.wait(timeout=120)


def start_enforcer(libs, standin: bool, probes: bool = True):
    run_dir = tempfile.mkdtemp(prefix="convgpu-bench-")
    argv = [sys.executable, "-P", "-m", "convgpu.cli.main", "enforce", "--gpu-memory", "64GiB", "--default-limit",
            "60GiB", "--run-dir", run_dir] + (["--no-discover"] if standin else []) + [f"--lib={x}" for x in libs] + ([] if probes else ["--no-probes"])
    enf = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    for line in enf.stderr:
        if "enforcing:" in line:
            break
    else:
        raise SystemExit(f"the enforcer did not start (exit {enf.wait()})")
    subprocess.Popen(["cat"], stdin=enf.stderr, stdout=subprocess.DEVNULL)   # keep its pipe drained
    time.sleep(0.2)
    return enf, run_dir
