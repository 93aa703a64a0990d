"""Experiments 2 and 3 of the evaluation issue (the paper's Figs. 5 and 6), on the GPU machine:
a PyTorch CNN on synthetic MNIST-shaped data (nothing downloaded) for a fixed number of steps,
run bare, probed, enforced and under the shim, the modes interleaved in every repetition.

    python -m bench.e2e [--reps 5] [--steps 1000] [--batch 256] [--modes bare,probed,enforced,shim]
                        [--json FILE]

Per run: *start-up*, from just before the process is started to its first allocation returned
(`torch.empty` on the GPU, after importing PyTorch: what a container's job sees); *training*,
the timed steps between two synchronizations, after 50 warm-up steps; the loss, which must be
the same in every mode (same seed, same work). Also the enforcer's own start, exec to probes
attached and self-tested. Cells are medians over repetitions, with ratios to bare."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WARMUP = 50


def worker(steps: int, batch: int) -> None:
    import torch
    from torch import nn
    first = torch.empty(1, device="cuda")   # the first allocation: context, then memory
    torch.cuda.synchronize()
    start_done = time.monotonic()
    torch.manual_seed(0)
    x = torch.randn(8 * batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (8 * batch,), device="cuda")
    model = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(i):
        j = i % 8
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[j * batch:(j + 1) * batch]), y[j * batch:(j + 1) * batch])
        loss.backward()
        opt.step()
        return loss

    for i in range(WARMUP):
        step(i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(steps):
        loss = step(WARMUP + i)
    torch.cuda.synchronize()
    train = time.perf_counter() - t
    del first
    print(json.dumps({"first_alloc_mono": start_done, "train_s": train, "loss": round(float(loss), 4)}))


def run_once(steps: int, batch: int, env: dict) -> dict:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-P", "-m", "bench.e2e", "--worker", "--steps", str(steps),
                          "--batch", str(batch)], env=env, capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    r["startup_s"] = r.pop("first_alloc_mono") - t0
    r["wall_s"] = time.monotonic() - t0
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--modes", default="bare,probed,enforced,shim")
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.steps, a.batch)
        return 0
    from bench.modes import running   # not in the worker: it imports bcc
    from bench.machine import machine
    modes = a.modes.split(",")
    runs: dict = {m: [] for m in modes}
    times: dict = {}
    for r in range(a.reps):
        for mode in modes:
            with running(mode, times=times) as (extra, _tracer):
                runs[mode].append(run_once(a.steps, a.batch, {**os.environ, **extra}))
            print(f"{r + 1} {mode} {json.dumps(runs[mode][-1])}", flush=True)   # kept if cut short
        print(f"repetition {r + 1}/{a.reps} done", file=sys.stderr)
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in ("startup_s", "train_s")} for m in modes}
    losses = {m: sorted({x["loss"] for x in runs[m]}) for m in modes}
    print(f"{'mode':>9} {'start-up s':>11} {'x':>6} {'train s':>9} {'x':>7} {'slowdown %':>10}  loss")
    for m in modes:
        s, t = med[m]["startup_s"], med[m]["train_s"]
        print(f"{m:>9} {s:>11.3f} {s / med['bare']['startup_s']:>6.3f} {t:>9.3f} {t / med['bare']['train_s']:>7.4f}"
              f" {100 * (t / med['bare']['train_s'] - 1):>10.2f}  {losses[m]}")
    if times:
        print(f"enforcer start (exec to probes attached): median {statistics.median(times['enforcer_start_s']):.2f} s"
              f" over {len(times['enforcer_start_s'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"reps": a.reps, "steps": a.steps, "batch": a.batch, "runs": runs, "medians": med,
                       "enforcer_start_s": times.get("enforcer_start_s", []), "machine": machine()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
