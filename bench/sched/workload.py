"""The paper's scheduling workload (ConVGPU IV, Table III): containers arrive one every 5 s, each
allocates a size drawn from Table III and then runs 5-45 s.

One seed gives one sequence: job i is drawn i-th, so the workload of N containers is the first N
of any larger one (N = 4 and N = 38 of a seed share their first four jobs)."""
from __future__ import annotations

import random
from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30
TABLE_III = tuple(m * MiB for m in (128, 256, 512, 1024, 2048, 4096))
CAPACITY = 5 * GiB                    # the paper's Tesla K20m
INTERVAL = 5.0                        # s between arrivals
RUN = (5.0, 45.0)                     # s of running once the memory is granted
OVERHEADS = {"paper": 66 * MiB,       # per-process CUDA context, K20m (the paper)
             "h100": 519 * MiB}       # measured on the H100, driver 580 (FACTS.md)


@dataclass(frozen=True)
class Job:
    index: int
    arrival: float    # s
    size: int         # bytes it allocates, in one call
    duration: float   # s it runs after that allocation succeeded

    @property
    def name(self) -> str:
        # zero-padded: the policies' last tie-break (id) then follows arrival order
        return f"c{self.index:02d}"


def generate(n: int, seed: int, interval: float = INTERVAL, run: tuple = RUN) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        size = rng.choice(TABLE_III)
        duration = rng.uniform(*run)
        jobs.append(Job(i, i * interval, size, duration))
    return jobs
