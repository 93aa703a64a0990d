"""Issues 14 (part 2) and 31 (part 2): a container's context counts from its first moment. A card
filled to its --gpu-memory by containers that each make a context and then allocate as much as
they can: NVML's per-container memory (the stand-in driver's per-process slots, which count each
context's overhead as the real driver does) never exceeds its assignment by more than 2 MiB,
for each source the per-device estimate can come from. Before issue 14, the context was charged
only once NVML had measured it (a second later); before issue 31, a GPU model missing from the
table (the H200) was charged --ctx-overhead, default 0, until then: 518 MiB over each limit.
In-process enforcer on the stand-in, real uprobes, real cgroups."""
import json
import logging
import os
import subprocess
import threading
import time

import pytest

from conftest import (GiB, MiB, StandinNvml, inprocess_enforcer, run_dir_for, serving, start_in, until,
                      wait_state)
from convgpu.enforcer import ctxest, ctxmeasure

pytestmark = pytest.mark.system
N = 3                   # containers, one process each
LIMIT = 1 * GiB         # each; the card (--gpu-memory) is N x LIMIT: full
CHUNK = 64 * MiB        # each allocates LIMIT in chunks: the one that would not fit stalls
SLACK = 2 * MiB
H200 = ("NVIDIA H200", "580.159.04")    # a model ctxest.ARCH_DEFAULTS lacks

# source -> (the stand-in's real context, NVML name and driver, estimate expected, --ctx-overhead,
#            learned values in the state dir). Each estimate is a little above the real context:
#            the measurement must then replace it (charge goes down to exactly the real one).
CASES = {
    "learned": (300 * MiB, ("", ""), 320 * MiB, None, [310 * MiB, 320 * MiB, 330 * MiB]),
    # nothing known: a bare context measured at start (518 MiB, the H200's) is charged + 1/16,
    # in 2 MiB pages: 550.375 -> 552 MiB. The containers start while it is measured: they wait
    "measured-at-start": (518 * MiB, H200, 552 * MiB, None, None),
    "operator": (200 * MiB, ("", ""), 256 * MiB, 256 * MiB, None),
}


def standin(caller_env, ctx, tag):
    return dict(caller_env, CONVGPU_STANDIN_CAPACITY=str(16 * GiB), CONVGPU_STANDIN_CTX_OVERHEAD=str(ctx),
                CONVGPU_STANDIN_SHM=f"/convgpu-{tag}-{os.getpid()}-{time.monotonic_ns()}")


def child_env(monkeypatch, env):
    """The measuring child inherits the enforcer's environment: here, this process's."""
    for k in ("CONVGPU_STANDIN_CAPACITY", "CONVGPU_STANDIN_CTX_OVERHEAD", "CONVGPU_STANDIN_SHM"):
        monkeypatch.setenv(k, env[k])


def sampled(nvml, pids, stop, peaks):
    """NVML's per-process memory read as fast as it comes, the highest kept per pid."""
    while not stop.is_set():
        for (pid, _), n in nvml.process_memory().items():
            if pid in pids:
                peaks[pid] = max(peaks.get(pid, 0), n)


@pytest.mark.parametrize("source", list(CASES))
def test_a_full_card_of_fresh_contexts_stays_within_each_assignment(root, build, cgroups, caller_env, source,
                                                                      monkeypatch, caplog):
    ctx, (name, driver), estimate, flag, learned = CASES[source]
    lib = build / "standin" / "libcuda.so.1"
    env = standin(caller_env, ctx, "ctx")
    child_env(monkeypatch, env)
    monkeypatch.setattr(ctxmeasure, "READ_EVERY", 0.3)   # a measurement of ~1 s: the containers come meanwhile
    usage_tool = [str(build / "standin" / "standin-usage"), "--json"]
    procs = []
    try:
        nvml = StandinNvml(env["CONVGPU_STANDIN_SHM"], name, driver)
        state = run_dir_for("ctx-state")
        if learned:     # what earlier processes on this device measured, kept by an earlier enforcer
            with open(os.path.join(state, ctxest.STATE_FILE), "w") as f:
                json.dump({"version": 1, "devices": {ctxest.Device(0).key: learned}}, f)
        enf = inprocess_enforcer(lib, f"ctx-{source}", LIMIT, capacity={0: N * LIMIT}, ctx_overhead=flag,
                                 nvml=nvml, state_dir=state)
        peaks, stop = {}, threading.Event()
        with caplog.at_level(logging.INFO, logger="convgpu"), serving(enf):
            measuring = enf.status()["gpus"]["0"]["ctx_measuring"]
            assert measuring == (source == "measured-at-start")
            procs = [start_in(cgroups(f"c{i}"), build, env, "alloc", "-n", LIMIT // CHUNK, "-s", CHUNK, "--hold")
                     for i in range(N)]
            pids = {p.pid for p in procs}
            t = threading.Thread(target=sampled, args=(nvml, pids, stop, peaks), daemon=True)
            t.start()
            fits = (LIMIT - estimate) // CHUNK     # chunks admitted next to the estimate

            def ours(st):   # another session's stand-in processes may be placed too: not ours to check
                return [c for c in st["containers"] if c["name"] in {"c0", "c1", "c2"}]

            def gpu0():
                return [c["gpus"]["0"] for c in ours(enf.status()) if "0" in c["gpus"]]
            # each stops at the chunk that would take it past its assignment (not only at its
            # first context, where it waits to be placed)
            try:
                until(lambda: len(gpu0()) == N and all(g["waiting"] and g["used"] == fits * CHUNK for g in gpu0()),
                      20, "the containers did not all stall at their assignment")
            except AssertionError:
                raise AssertionError(f"not all stalled at {fits} chunks: {ours(enf.status())}") from None
            gpu = enf.status()["gpus"]["0"]["ctx_estimate"]
            assert (gpu["source"], gpu["bytes"]) == (source, estimate), gpu
            for p in procs:
                wait_state(p.pid, "T")
            # every context measured: its real size replaced the estimate, and nothing more fits
            until(lambda: all(g["context_source"] == "measured" for g in gpu0()), 5,
                  "NVML never measured every context")
            time.sleep(0.3)
            stop.set()
            t.join()
            st = enf.status()
            rows = {c["pids"][0]: c["gpus"]["0"] for c in ours(st)}
            assert sorted(rows) == sorted(pids)
            final = {pid: n for (pid, _), n in nvml.process_memory().items() if pid in pids}
            for pid, g in rows.items():
                assert g["assigned"] == LIMIT and g["context_overhead"] == ctx, g
                assert g["used"] == fits * CHUNK, (g, source)
                assert peaks[pid] == final[pid] == fits * CHUNK + ctx, (peaks, final)
            over = {pid: (peaks[pid] - LIMIT) / MiB for pid in pids if peaks[pid] > LIMIT + SLACK}
            assert not over, f"MiB above the assignment: {over}"
        held = {r.getMessage().split()[1] for r in caplog.records if "until a context is measured" in r.getMessage()}
        if source == "measured-at-start":   # each newcomer waited for the measurement
            assert held == {str(p) for p in pids}, caplog.text
            kept = json.load(open(os.path.join(state, ctxest.STATE_FILE)))["measured"]
            assert kept == {"NVIDIA H200 driver 580.159.04": ctx}
        else:
            assert not held and "measuring what a context costs" not in caplog.text
    finally:
        for p in procs:
            p.kill()
            p.wait()
        subprocess.run(usage_tool[:1] + ["--unlink"], env=env, capture_output=True)
