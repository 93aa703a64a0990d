"""What the enforcer's Prometheus metrics are: metric families built from one published
snapshot (Reporter.status(), the probes' per-process rows, NVML's measured excess, NVML's GPUs).
The server, its threads and TLS are enforcer/metrics.py's.

Names follow Prometheus's conventions: the unit in the name (`_bytes`, `_seconds`), `_total` on
counters (the library adds it on the wire), a 0/1 gauge for a state. Every label value a tenant
chooses (a container's name, a cgroup path as its id) is bounded, in length and in number:
- a value longer than MAX_LABEL characters is cut and ends in a hash of the whole (label()):
  the same name always gives the same value, two long names that share a start stay apart, and
  no name can make a scrape fail at Prometheus's `label_value_length_limit`;
- per container and GPU at most PROCESS_SERIES processes get series of their own (those waiting
  first, then those holding most); the others are summed under `pid="other"`. A container may
  have 1,024 processes (--max-processes): without this it would make 3,072 series a scrape, and
  one tenant could push the node's scrape past Prometheus's `sample_limit`, which fails it whole;
- containers are bounded by the enforcer itself: BPF's `cgstate` map holds 4,096 (container,
  GPU) entries; jobs by the history's MAX_JOBS (256).
docs/OPERATOR.md ("Metrics") lists every family; its runbook, the alerts built on them."""
import hashlib
import time

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from ..probes.nvml import GpuInfo

MAX_LABEL = 64        # characters of a tenant-chosen label value (an engine's 64-hex id fits whole)
PROCESS_SERIES = 8    # processes with series of their own, per container and GPU
C_LABELS = ("container", "id", "gpu")   # a container's row on one GPU
P_LABELS = ("pid", "container", "id", "gpu")   # a process on one GPU (id: names need not be unique)
NO_GPU = GpuInfo(index=0, name="", total=0, used=0)   # describe(): a row, so NVML's families are named
EMPTY = {"containers": [], "gpus": {}}

GAUGES = (   # name, help, field of a container's per-GPU row
    ("convgpu_container_limit_bytes", "L_c: the container's GPU-memory limit", "limit"),
    ("convgpu_container_assigned_bytes", "A_c: memory assigned to the container", "assigned"),
    ("convgpu_container_used_bytes", "live device allocations of the container's processes", "used"),
    ("convgpu_container_context_overhead_bytes", "CUDA context overhead charged to the container",
     "context_overhead"),
    ("convgpu_container_waiting", "1 while the container has a request stalled on the GPU", "waiting"),
    ("convgpu_container_waiting_seconds", "how long the container's current wait on the GPU has lasted "
     "(0: none)", "waiting_s"),
    ("convgpu_container_over_limit_bytes", "how far the driver's count (NVML) of the container's processes is "
     "above its limit (0: within it)", "over_by"),
    ("convgpu_container_over_limit_seconds", "how long the driver's count has been above its limit", "over_s"),
)
DEFAULTS = {"swapped": 0}    # fields a status may not have yet: 0, not absent
COUNTERS = (   # per container; the family's name gets `_total` on the wire
    ("convgpu_stalls", "times the container was stalled", "stalls"),
    ("convgpu_grants", "grants the policy gave the container", "grants"),
    ("convgpu_over_limit", "requests above the container's limit", "over_limit_events"),
    ("convgpu_container_stalled_seconds", "time the container has spent stalled", "stalled_s"),
)
GPU_GAUGES = (   # name, help, field of a GPU's row (absent field: no sample), default
    ("convgpu_gpu_capacity_bytes", "memory shared on the GPU", "capacity", None),
    ("convgpu_gpu_assigned_bytes", "memory assigned to containers on the GPU", "assigned", None),
    ("convgpu_gpu_committed_bytes", "what containers hold or may take on the GPU: each its assignment, or what "
     "the driver counts for it where that is more", "committed", None),
    ("convgpu_gpu_unattributed_bytes", "memory NVML counts on the GPU that no container is charged with", "unattributed", 0),
    ("convgpu_gpu_tearing_down_bytes", "memory of exited processes the driver has not freed yet", "tearing_down", None),
)


def label(value) -> str:
    """A tenant-chosen value as a label value: itself up to MAX_LABEL characters, else its start
    and `~` and 12 hex digits of its SHA-256 (MAX_LABEL in all)."""
    text = str(value)
    if len(text) <= MAX_LABEL:
        return text
    return text[:MAX_LABEL - 13] + "~" + hashlib.sha256(text.encode()).hexdigest()[:12]


def _gauge(name, text, labels=()):
    return GaugeMetricFamily(name, text, labels=labels)


def container_families(status: dict) -> list:
    out = []
    rows = [(c, label(c["name"]), label(c["id"])) for c in status["containers"]]
    for name, text, key in GAUGES + (("convgpu_container_swapped_bytes", "memory of the container checkpointed "
                                      "to host memory (swapped out of the GPU)", "swapped"),):
        g = _gauge(name, text, C_LABELS)
        for c, cname, cid in rows:
            for dev, row in c["gpus"].items():
                value = row.get(key, c.get(key, DEFAULTS.get(key)))
                if value is not None:   # a field the status lacks gives no sample, not a wrong one
                    g.add_metric([cname, cid, dev], value)
        out.append(g)
    for name, text, key in COUNTERS:
        m = CounterMetricFamily(name, text, labels=("container", "id"))
        for c, cname, cid in rows:
            if key in c:
                m.add_metric([cname, cid], c[key])
        out.append(m)
    return out


def process_families(status: dict, usage=(), excess=None) -> list:
    """Per process: the probes' rows, placed in their container by the status's pid lists; at
    most PROCESS_SERIES of a container on a GPU by pid, the rest summed as pid "other"."""
    excess = excess or {}
    owner = {pid: c for c in status["containers"] for pid in c.get("pids", ())}
    rows: dict[tuple, list] = {}   # (container, id, gpu) -> [(waiting, bytes, pid, used, ctx)]
    seen = set()
    for u in usage:
        c = owner.get(u.pid)
        dev = str(u.dev)
        est = status["gpus"].get(dev, {}).get("ctx_estimate", {}).get("bytes", 0)   # the device's charge per context
        over, n = excess.get((u.pid, u.dev), (0, 0))   # NVML's bytes beyond its allocations, for n contexts
        ctx = max(0, max(u.contexts, 0) * est + over - n * est)   # the books' charge (Books.ctx_held)
        stalled = int(bool(c) and u.pid in c["gpus"].get(dev, {}).get("waiting_pids", ()))
        key = (label(c["name"]), label(c["id"]), dev) if c else ("", "", dev)
        rows.setdefault(key, []).append((stalled, u.live + ctx, u.pid, u.live, ctx))
        seen.add((u.pid, dev))
    for c in status["containers"]:   # stopped before the probes had a row for it (its first call)
        for dev, row in c["gpus"].items():
            for pid in row.get("waiting_pids", ()):
                if (pid, dev) not in seen:
                    rows.setdefault((label(c["name"]), label(c["id"]), dev), []).append((1, 0, pid, None, 0))
    used = _gauge("convgpu_process_memory_used_bytes", "live device allocations of the process", P_LABELS)
    ctx = _gauge("convgpu_process_context_overhead_bytes", "CUDA context overhead of the process: the per-context "
                 "charge plus what NVML measured beyond it", P_LABELS)
    waiting = _gauge("convgpu_process_waiting", "1 while the process is stalled on the GPU (pid \"other\": how many "
                     "of the container's processes without series of their own are)", P_LABELS)
    for (cname, cid, dev), procs in rows.items():
        procs.sort(key=lambda p: (-p[0], -p[1], p[2]))
        for stalled, _, pid, live, charge in procs[:PROCESS_SERIES]:
            lab = [str(pid), cname, cid, dev]
            if live is not None:   # None: no row of the probes' yet (only its wait is known)
                used.add_metric(lab, live)
                ctx.add_metric(lab, charge)
            waiting.add_metric(lab, stalled)
        rest = procs[PROCESS_SERIES:]
        if rest:
            lab = ["other", cname, cid, dev]
            used.add_metric(lab, sum(p[3] or 0 for p in rest))
            ctx.add_metric(lab, sum(p[4] for p in rest))
            waiting.add_metric(lab, sum(p[0] for p in rest))
    return [used, ctx, waiting]


def gpu_families(status: dict, gpus=()) -> list:
    """Per GPU: convgpu's books, the backstop, then the card as NVML sees it (dcgm-exporter's FB
    used/total), read at scrape time."""
    out = []
    for name, text, key, default in GPU_GAUGES:
        g = _gauge(name, text, ("gpu",))
        for dev, row in status["gpus"].items():
            value = row.get(key, default)
            if value is not None:
                g.add_metric([dev], value)
        out.append(g)
    on = _gauge("convgpu_gpu_backstop_enabled", "1 while the backstop checks the GPU's processes against the "
                "driver's count (NVML); 0: off (convgpu status says why)", ("gpu",))
    for dev, row in status["gpus"].items():
        if "backstop" in row:
            on.add_metric([dev], int(row["backstop"] == "on"))
    out.append(on)
    if gpus:
        total = _gauge("convgpu_gpu_memory_total_bytes", "the GPU's memory (NVML)", ("gpu",))
        nv_used = _gauge("convgpu_gpu_memory_used_bytes", "the GPU's memory in use, by anyone (NVML)", ("gpu",))
        info = InfoMetricFamily("convgpu_gpu", "the GPU's model and UUID (NVML), to join with dcgm-exporter",
                                labels=("gpu",))
        for g in gpus:
            total.add_metric([str(g.index)], g.total)
            nv_used.add_metric([str(g.index)], g.used)
            info.add_metric([str(g.index)], {"uuid": g.uuid, "name": g.name})
        out += [total, nv_used, info]
    return out


def enforcer_families(status: dict, published: float | None = None) -> list:
    """The enforcer's own health: when it started, how old the snapshot is (a loop that stopped
    publishing), its probes, what ran unchecked. published: time.time() of the snapshot."""
    out = []
    if "started" in status:
        out.append(GaugeMetricFamily("convgpu_enforcer_start_time_seconds", "when the enforcer started "
                                     "(Unix time)", value=status["started"]))
    if published is not None:
        out.append(GaugeMetricFamily("convgpu_status_age_seconds", "how old the enforcer's last published "
                                     "state is (its loop publishes it every second)",
                                     value=max(0.0, time.time() - published)))
    if "policy" in status:
        info = InfoMetricFamily("convgpu_enforcer", "the enforcer's policy, stall mode and over-limit action")
        info.add_metric([], {"policy": str(status["policy"]), "stall": str(status.get("stall", "")),
                             "over_limit": str(status.get("over_limit", ""))})
        out.append(info)
    if "probes" in status:   # absent with --no-probes
        out.append(GaugeMetricFamily("convgpu_probed_libraries", "driver files (libcuda copies) whose uprobes "
                                     "are attached", value=status["probes"]["attached"]))
    if "unprobed" in status:
        g = _gauge("convgpu_unprobed_processes", "processes that opened a driver file convgpu could not probe, by "
                   "what was done (stall, kill, allow: runs unchecked)", ("action",))
        for action in ("stall", "kill", "allow"):
            g.add_metric([action], sum(u.get("action") == action for u in status["unprobed"]))
        out.append(g)
    if "unchecked_calls" in status:
        out.append(CounterMetricFamily("convgpu_unchecked_calls", "allocations and contexts BPF let through "
                                       "unchecked while the enforcer's heartbeat had lapsed",
                                       value=status["unchecked_calls"]))
    return out


def families(status: dict, usage=(), excess=None, gpus=(), published: float | None = None) -> list:
    """The metric families of one snapshot. status: Reporter.status(); usage: the probes' rows
    (pid, dev, live, contexts); excess: Charges.excess, (pid, dev) -> (NVML's bytes beyond the
    process's live allocations, the contexts it had then); gpus: probes.nvml.GpuInfo rows;
    published: when the snapshot was published (time.time())."""
    return (container_families(status) + process_families(status, usage, excess) + gpu_families(status, gpus)
            + enforcer_families(status, published))


def every_family() -> list:
    """Every family's name and type, NVML's and the optional ones too, without reading anything
    (describe(): the registry serves `?name[]=` from these and refuses a clash of names)."""
    full = {"containers": [], "gpus": {}, "unchecked_calls": 0, "started": 0.0, "policy": "", "probes": {"attached": 0},
            "unprobed": []}
    return families(full, gpus=(NO_GPU,), published=0.0)


def job_families(recs) -> list:
    """Each job's recent peak and recommended limit (enforcer/history/recommend.py): recs is the
    recorder's summary. A job's label is its key, percent-encoded by enforcer/history/jobs.py
    and escaped again by the library; at most MAX_JOBS (256) jobs, so at most as many series."""
    peak = _gauge("convgpu_job_peak_bytes", "the most the job held on the GPU in its recent runs "
                  "(allocations and context charge)", ("job", "gpu"))
    rec = _gauge("convgpu_job_recommended_limit_bytes", "the limit `convgpu recommend` gives the job "
                 "(docs/RECOMMEND.md)", ("job",))
    asked = _gauge("convgpu_job_asked_bytes", "the limit of the job's newest run", ("job",))
    flag = _gauge("convgpu_job_misasked", "1 where the job asks over twice what it needs (way=over) "
                  "or was held at its limit (way=under)", ("job", "way"))
    for r in recs:
        for gpu, n in r.peaks.items():
            peak.add_metric([r.job, str(gpu)], n)
        rec.add_metric([r.job], r.limit)
        if r.asked is not None:
            asked.add_metric([r.job], r.asked)
        flag.add_metric([r.job, "over"], int(r.over_asking))
        flag.add_metric([r.job, "under"], int(r.under_asking))
    return [peak, rec, asked, flag]
