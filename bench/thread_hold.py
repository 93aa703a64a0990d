"""What holding one thread costs (issue 23, part 3; enforcer/failsafe/threadhold.py).

A small C target (compiled here with gcc) runs N threads that each count in a shared page.
The bench plays BPF's part: tgkill(SIGSTOP) to one thread, as bpf_send_signal_thread does, and
lists it as stopped at a call (a fake `held` map). It measures, with the enforcer's ThreadHolder:
  first hold   tgkill -> that thread held and its siblings counting again (a group stop, then
               every thread seized and the rest let go): the price of a process's first stop
  stop         tgkill -> held, on a process already seized (the thread alone stops)
  release      release() -> the thread counts again
and what a process pays while seized: a thread created and joined (the clone event), and a
signal sent to it and handled (its signal-delivery-stop), against the same unseized.
    python -m bench.thread_hold [--threads 8] [--n 300] [--json FILE]"""
import argparse
import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time

from convgpu.enforcer.failsafe.threadhold import ThreadHolder

TARGET = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
static volatile uint64_t *page;
static void *count(void *arg) {
    long i = (long)arg;
    page[64 + i] = syscall(SYS_gettid);
    struct timespec ts = {0, 20000};
    for (;;) { page[i]++; nanosleep(&ts, 0); }
}
static void *nothing(void *arg) { return arg; }
static void on_usr1(int s) { (void)s; page[200]++; }
int main(int argc, char **argv) {
    int fd = open(argv[1], O_RDWR);
    page = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    signal(SIGUSR1, on_usr1);
    int n = atoi(argv[2]);
    pthread_t t;
    for (long i = 0; i < n; i++) pthread_create(&t, 0, count, (void *)i);
    for (;;) {            /* page[300]: clones asked; page[301]: clones done */
        if (page[300] != page[301]) {
            pthread_create(&t, 0, nothing, 0); pthread_join(t, 0); page[301]++;
        } else usleep(50);
    }
}
"""


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(xs):
    return {"p50_us": round(pct(xs, 50) * 1e6, 1), "p99_us": round(pct(xs, 99) * 1e6, 1), "n": len(xs)}


def until(cond, timeout=5.0):
    end = time.perf_counter() + timeout
    while not cond():     # sleeping: the holder's thread is ours, and a spin would keep the GIL
        if time.perf_counter() > end:   # from it for the switch interval (5 ms)
            raise TimeoutError
        time.sleep(0.00002)
    return time.perf_counter()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--json")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="convgpu-hold-")
    exe, page_file = os.path.join(d, "target"), os.path.join(d, "page")
    with open(os.path.join(d, "t.c"), "w") as f:
        f.write(TARGET)
    subprocess.run(["gcc", "-O2", "-pthread", "-o", exe, os.path.join(d, "t.c")], check=True)
    with open(page_file, "wb") as f:
        f.write(b"\0" * 4096)
    fd = os.open(page_file, os.O_RDWR)
    page = (ctypes.c_uint64 * 512).from_buffer(mmap.mmap(fd, 4096))
    p = subprocess.Popen([exe, page_file, str(a.threads)])
    until(lambda: all(page[64 + i] for i in range(a.threads)))
    tids = [page[64 + i] for i in range(a.threads)]
    stopped = {}                             # tid -> stop number: BPF's `held`, played here
    holder = ThreadHolder(lambda pid, tid: stopped.get(tid)).start()
    libc = ctypes.CDLL(None, use_errno=True)

    def others_count(skip):
        before = [page[i] for i in range(a.threads) if i != skip]
        return lambda: all(page[i] != b for i, b in zip([i for i in range(a.threads) if i != skip], before))

    def clones(n):
        t = []
        for _ in range(n):
            t0 = time.perf_counter()
            page[300] += 1
            until(lambda: page[301] == page[300])
            t.append(time.perf_counter() - t0)
        return t

    def signals(n):
        t = []
        for _ in range(n):
            was = page[200]
            t0 = time.perf_counter()
            os.kill(p.pid, signal.SIGUSR1)
            until(lambda: page[200] != was)
            t.append(time.perf_counter() - t0)
        return t

    out = {"threads": a.threads, "machine": os.uname().nodename}
    try:
        out["unseized_clone"] = summary(clones(a.n))
        out["unseized_signal"] = summary(signals(a.n))
        # the first hold: a group stop, then the whole process seized, the siblings let go
        seq = 1
        stopped[tids[0]] = seq
        t0 = time.perf_counter()
        libc.syscall(234, p.pid, tids[0], signal.SIGSTOP)   # tgkill
        holder.hold(p.pid, tids[0])
        until(lambda: p.pid in holder.traced)
        until(others_count(0))
        out["first_hold_us"] = round((time.perf_counter() - t0) * 1e6, 1)
        stop_t, release_t = [], []
        for k in range(a.n):
            i = k % a.threads
            tid = tids[i]
            if k:
                seq += 1
                stopped[tid] = seq
                t0 = time.perf_counter()
                libc.syscall(234, p.pid, tid, signal.SIGSTOP)
                until(lambda: holder._procs.get(p.pid) and holder._procs[p.pid].held.get(tid) == seq)
                stop_t.append(time.perf_counter() - t0)
            else:
                until(lambda: holder._procs[p.pid].held.get(tid) == seq)
            was = page[i]
            t0 = time.perf_counter()
            holder.release(p.pid, tid, seq)
            until(lambda: page[i] != was)
            release_t.append(time.perf_counter() - t0)
            stopped.pop(tid)                     # past its "recheck"
            if k == 0:
                # what a seized process pays (measured now, while it is seized: a stop listed
                # for another thread keeps the holder from detaching meanwhile)
                stopped[tids[-1]] = 1 << 30
                out["seized_clone"] = summary(clones(a.n))
                out["seized_signal"] = summary(signals(a.n))
                assert p.pid in holder.traced
                stopped.pop(tids[-1])
        out["stop"] = summary(stop_t)
        out["release"] = summary(release_t)
    finally:
        holder.close()
        p.kill()
        p.wait()
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
