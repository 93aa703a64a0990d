"""The preload shim (libconvgpu.so) against the real enforcer on the stand-in driver, probes
active: a request above the limit gets a real out-of-memory error, memory queries report the
limit, a request above the assignment waits in the calling thread (never SIGSTOP) until the
policy grants it, no enforcer means pass-through (or failure with fail-closed), and bad input
on the shim socket never hurts anyone else."""
import json
import socket
import subprocess
import sys
import time

import pytest

from conftest import Enforcing, GiB, MiB, cuda_prelude, proc_state, read_until, shim_env, start_in, stop_all

pytestmark = pytest.mark.system


def test_deny_meminfo_and_wait_in_the_thread(cgroups, build, env5):
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--limit", "big=3GiB", "--limit", "shimmed=2GiB")
    a = b = None
    try:
        # above its 2 GiB limit: CUDA_ERROR_OUT_OF_MEMORY from the call itself
        r = subprocess.run(["/bin/sh", "-c", f'echo $$ > {cgroups("shimmed")}/cgroup.procs && exec "$0" "$@"',
                            str(build / "cgcaller"), "alloc", "-n", "1", "-s", str(3 * GiB)],
                           env=shim_env(env5, enf), capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "error cuMemAlloc_v2 2" in r.stderr, r.stderr
        assert "denied" in r.stderr and "[convgpu " in r.stderr     # the shim's own log line
        enf.wait_for("deny shimmed pid")
        # cuMemGetInfo_v2 reports the limit, and what is used of it
        code = cuda_prelude(str(build / "standin" / "libcuda.so.1")) + (
            "f=ctypes.c_size_t(); t=ctypes.c_size_t(); p=ctypes.c_ulonglong()\n"
            "cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)); print(f.value, t.value)\n"
            f"assert cu.cuMemAlloc_v2(ctypes.byref(p), {256 * MiB}) == 0\n"
            "cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)); print(f.value, t.value)\n")
        r = subprocess.run(["/bin/sh", "-c", f'echo $$ > {cgroups("shimmed")}/cgroup.procs && exec "$0" "$@"',
                            sys.executable, "-c", code], env=shim_env(env5, enf), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[:2] == [f"{2 * GiB} {2 * GiB}", f"{2 * GiB - 256 * MiB} {2 * GiB}"]
        # `big` (no shim) takes 3 GiB; shimmed gets the 1 GiB left and asks for 2: it waits in
        # its thread (state S, not T) until big exits, then its allocation runs
        a = start_in(cgroups("big"), build, env5, "alloc", "-n", 1, "-s", 3 * GiB, "--hold")
        read_until(a, "ready")
        b = start_in(cgroups("shimmed"), build, shim_env(env5, enf), "alloc", "-n", 1, "-s", 2 * GiB, "--hold")
        enf.wait_for(f"stall shimmed pid {b.pid} on GPU0 (shim, waits in its thread)")
        time.sleep(0.3)
        assert proc_state(b.pid) == "S"
        a.stdin.write("\n")
        a.stdin.flush()
        assert f"allocated 1 {2 * GiB} pid={b.pid}" in read_until(b, "ready")
        # it said hello when it made its context: never placed by a stop, never stopped
        said = [x for x in enf.log if f"pid {b.pid}" in x]
        assert "uses the shim" in said[0] and all("(shim, waits in its thread)" in x for x in said if "stall" in x), said
        st = enf.ctl(cmd="status")["status"]
        row = next(c for c in st["containers"] if c["name"] == "shimmed")
        assert row["gpus"]["0"]["used"] == 2 * GiB and row["stalls"] >= 1      # counted once, by BPF
    finally:
        stop_all((a, b), enf)


def test_credit_spares_the_asking_and_comes_back_for_a_sibling(cgroups, build, env5):
    """Credit (enforcer/serving/credit.py): after its first grant a process allocates without asking,
    and is charged exactly; a sibling's request takes the unspent credit back before it is
    decided; a forked child asks on its own connection, with a page of its own."""
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--limit", "pair=1GiB", "--ctx-overhead", "64MiB")
    a = b = None
    try:
        a = start_in(cgroups("pair"), build, shim_env(env5, enf), "alloc", "-n", 100, "-s", MiB, "--hold")
        read_until(a, "ready")
        st = enf.ctl(cmd="status")["status"]
        g = next(c for c in st["containers"] if c["name"] == "pair")["gpus"]["0"]
        assert st["shim_asks"] == 1                      # the first of 100 allocations asked
        assert (g["used"], g["context_overhead"]) == (100 * MiB, 64 * MiB)   # all charged, once
        first = (GiB - 64 * MiB - MiB) // 2              # half of what was left after the first grant
        assert g["shim_credit"] == first - 99 * MiB
        # 64 + 100 (a) + 64 (b's context) + 700 MiB fits 1 GiB only once a's credit is back
        b = start_in(cgroups("pair"), build, shim_env(env5, enf), "alloc", "-n", 1, "-s", 700 * MiB, "--hold")
        assert f"allocated 1 {700 * MiB} pid={b.pid}" in read_until(b, "ready")
        st = enf.ctl(cmd="status")["status"]
        g = next(c for c in st["containers"] if c["name"] == "pair")["gpus"]["0"]
        assert st["shim_asks"] == 2 and g["used"] == 800 * MiB
        assert g["shim_credit"] == (GiB - 2 * 64 * MiB - 800 * MiB) // 2   # b's, after its grant
        assert not [x for x in enf.log if "stall pair" in x or "deny pair" in x], enf.log
        for p in (a, b):
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=30)
        # a child forked after the parent's grant: its own hello, its own charge
        code = cuda_prelude(str(build / "standin" / "libcuda.so.1")) + (
            "p=ctypes.c_ulonglong()\n"
            f"assert cu.cuMemAlloc_v2(ctypes.byref(p), {MiB}) == 0\n"
            "k=os.fork()\n"
            f"if k == 0: os._exit(cu.cuMemAlloc_v2(ctypes.byref(p), {3 * MiB}))\n"
            "print(k, os.waitpid(k, 0)[1], flush=True); sys.stdin.readline()\n")
        c = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {cgroups("forks")}/cgroup.procs && exec "$0" "$@"',
                              sys.executable, "-c", code], env=shim_env(env5, enf), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        child, status = map(int, c.stdout.readline().split())
        assert status == 0
        enf.wait_for(f"pid {child} of forks uses the shim")
        assert enf.ctl(cmd="status")["status"]["shim_asks"] == 4   # parent's first, child's first
        c.communicate("\n", timeout=30)
    finally:
        for p in (a, b):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        enf.close()


def test_nvml_memory_queries_show_the_limit(cgroups, build, env5):
    """pynvml (as nvidia-smi) under the shim, on the stand-in NVML: total is the container's
    limit, used its own 256 MiB, free the rest, for both versions of the query."""
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--limit", "smi=2GiB")
    try:
        code = cuda_prelude(str(build / "standin" / "libcuda.so.1")) + (
            "import pynvml; p=ctypes.c_ulonglong()\n"
            f"assert cu.cuMemAlloc_v2(ctypes.byref(p), {256 * MiB}) == 0\n"
            "pynvml.nvmlInit(); h=pynvml.nvmlDeviceGetHandleByIndex(0)\n"
            "m=pynvml.nvmlDeviceGetMemoryInfo(h); v=pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)\n"
            "print(m.total, m.used, m.free, v.total, v.used, v.free, v.reserved)\n")
        env = shim_env(env5, enf, LD_LIBRARY_PATH=f"{build}/standin-nvml:{env5['LD_LIBRARY_PATH']}")
        r = subprocess.run(["/bin/sh", "-c", f'echo $$ > {cgroups("smi")}/cgroup.procs && exec "$0" "$@"',
                            sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        view = [2 * GiB, 256 * MiB, 2 * GiB - 256 * MiB]
        assert list(map(int, r.stdout.split())) == view + view + [0]
        # without the shim the stand-in says what the whole GPU has
        bare = subprocess.run([sys.executable, "-c", "import pynvml; pynvml.nvmlInit(); "
                               "m=pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)); "
                               "print(m.total, m.used)"], env=dict(env5, LD_LIBRARY_PATH=f"{build}/standin-nvml"),
                              capture_output=True, text=True, timeout=60)
        assert bare.stdout.split() == [str(5 * GiB), "0"], bare.stderr
    finally:
        enf.close()


@pytest.mark.parametrize("closed", [False, True])
def test_no_enforcer_fail_open_or_closed(build, caller_env, closed):
    env = shim_env(caller_env, **({"CONVGPU_SHIM_FAIL_CLOSED": "1"} if closed else {}))
    r = subprocess.run([str(build / "cgcaller"), "alloc", "-n", "2", "-s", str(4 * MiB)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.stderr.count("no enforcer on /nonexistent/shim/shim.sock") == 1, r.stderr   # warned once
    if closed:
        assert r.returncode == 2 and "error cuMemAlloc_v2 2" in r.stderr
    else:
        assert r.returncode == 0 and f"allocated 2 {8 * MiB}" in r.stdout


def test_bad_input_on_the_shim_socket(cgroups, build, env5):
    """Malformed, out-of-order, huge and lying messages get errors; a client vanishing in the
    middle of a wait is cleaned up; the enforcer keeps serving a well-behaved shim."""
    enf = Enforcing(build, "--gpu-memory", "4GiB", "--default-limit", "1GiB")
    try:
        path = f"{enf.run_dir}/shim/shim.sock"

        def talk(*lines):
            """A new connection; one reply per line."""
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            out = []
            f = s.makefile("r")
            for line in lines:
                s.sendall(line if isinstance(line, bytes) else (line + "\n").encode())
                out.append(json.loads(f.readline()))
            return s, out

        s, out = talk('{"op":"ask","dev":0,"size":1}', "not json", "[1,2]", '{"op":"hello","pid":1}',
                      '{"op":"ask","dev":0,"size":-5}', '{"op":"ask","dev":0,"size":1e30}',
                      '{"op":"ask","dev":99,"size":1}', '{"op":"launch"}')
        assert out[0] == {"ok": False, "error": "say hello first"}
        assert out[1]["ok"] is False and "malformed request" in out[1]["error"]
        assert out[2]["ok"] is False and "not a JSON object" in out[2]["error"]
        assert out[3]["ok"] is True and out[3]["limit"] == GiB     # the caller's own container
        assert "size must be an integer" in out[4]["error"] and "size must be an integer" in out[5]["error"]
        assert "dev must be an integer" in out[6]["error"]
        assert out[7] == {"ok": False, "error": "unknown op 'launch'"}
        s.sendall(b"x" * (70 << 10))                               # no newline, over 64 KiB
        assert "longer than" in json.loads(s.makefile("r").readline())["error"]
        s.close()
        # a waiter that disconnects: its wait is dropped
        w, out = talk('{"op":"hello"}')
        w.sendall(b'{"op":"ask","dev":0,"size":900000000000}\n')   # above its limit: denied at once
        assert "above its limit" in json.loads(w.makefile("r").readline())["deny"]
        w.close()
        # everyone else is still served
        r = subprocess.run(["/bin/sh", "-c", f'echo $$ > {cgroups("ok")}/cgroup.procs && exec "$0" "$@"',
                            str(build / "cgcaller"), "alloc", "-n", "2", "-s", str(64 * MiB)],
                           env=shim_env(env5, enf), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and f"allocated 2 {128 * MiB}" in r.stdout, r.stderr
        assert enf.p.poll() is None
    finally:
        enf.close()
