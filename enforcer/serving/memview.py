"""What a process under the preload shim is told of a GPU's memory (issue 18): one rule for
cuMemGetInfo_v2 / cudaMemGetInfo and NVML's memory queries (shim/shim.c asks `meminfo`).

The limit is what the container may hold on the card, its contexts included. A framework
sizes itself from the total or the free it reads (JAX preallocates 75 % of the total, vLLM
a share of it, TensorFlow most of the free) and its context comes on top of that. So

    total = limit - this process's context          (its own context is not for it to fill)
    used  = what the container holds without that context: every byte it allocated, asked
            for or was granted, and the contexts of its other processes
    free  = total - used (never below 0)

and a process that takes any fraction of the total, or all of the free, still fits, context
and all: limit >= used + its context + free.

A context is counted as NVML measured it (per process, every second), and until then at the
device's *ceiling* (enforcer/ctxest.py), not at the estimate admission charges: a framework
reads the total once, early, before any measurement, so the figure it gets must already
leave room for a context larger than the median (PyTorch with cuBLAS, 612 MiB on the H100
against a 518-550 MiB median). Once measured the total grows to limit - measured: a total read
early is never larger than one read later, unless a context outgrows the ceiling.

A process with no context on the device yet (nvidia-smi, pynvml before CUDA starts) is counted
one context at the ceiling: the one it needs to use the card. So its total does not shrink
when it makes that context, and NVML read before CUDA starts agrees with cuMemGetInfo after.
Pure functions; enforcer/serving/broker.py gathers the inputs."""
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcContexts:
    """One process's contexts on the device: how many now, and NVML's last measurement of
    them (bytes beyond its tracked allocations, for that many contexts), if any."""
    contexts: int
    measured: tuple[int, int] | None = None     # (bytes, contexts then)


def context_figure(p: ProcContexts, ceiling: int, asking: bool = False) -> int:
    """A process's contexts as the view counts them: measured where NVML measured them, the
    ceiling each for the rest; the asking process counts at least the one it needs."""
    if p.measured is not None:
        over, n = p.measured
        return max(0, over) + max(0, p.contexts - n) * ceiling
    return max(p.contexts, 1 if asking else 0) * ceiling


def view(limit: int, allocated: int, procs: dict[int, ProcContexts], pid: int, ceiling: int) -> tuple[int, int]:
    """(total, used) for process pid of a container whose limit on this device is `limit`
    (min(limit, the card's)), which holds `allocated` bytes besides its contexts (allocations,
    grants not yet allocated, requests waiting), with its processes' contexts in `procs`."""
    own = context_figure(procs.get(pid, ProcContexts(0)), ceiling, asking=True)
    others = sum(context_figure(p, ceiling) for q, p in procs.items() if q != pid)
    total = max(0, limit - own)
    return total, min(total, max(0, allocated) + others)
