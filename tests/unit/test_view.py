"""render(snapshot) from a hand-made snapshot: exact figures appear, nothing exceeds 100
columns, and the demo/waiting modes say so."""
import time

from rich.console import Console

from convgpu.cli.view import render
from convgpu.enforcer.model import ContainerRow, GpuRow, ProcessRow, Snapshot
from convgpu.probes.events import Event

MiB, GiB = 1 << 20, 1 << 30


def proc(pid, live, overhead, src="nvml", gpu=0):
    return ProcessRow(pid=pid, comm="python3", gpu=gpu, live=live, peak=live + 128 * MiB, overhead=overhead,
                      overhead_source=src, contexts=1, allocs=10, frees=4, failed=1, rate=2.5,
                      last_event_age=1.25)


def snapshot(mode="driver"):
    a = ContainerRow(id="a" * 64, name="trainer-with-a-very-long-container-name-indeed", kind="podman",
                     cgroup="/libpod_parent/libpod-" + "a" * 64,
                     processes=(proc(101, 256 * MiB, 519 * MiB), proc(102, 128 * MiB, 519 * MiB)), peak=512 * MiB)
    b = ContainerRow(id="/convgpu-demo/beta", name="beta", kind="cgroup", cgroup="/convgpu-demo/beta",
                     processes=(proc(201, 0, 64 * MiB, "estimate"),), peak=0)
    ev = Event(ts_ns=time.monotonic_ns(), pid=101, tid=101, comm="python3", cgroup_id=1, op="alloc",
               api="cuMemAlloc_v2", rt_api="cudaMalloc", dev=0, addr=0x1000, size=128 * MiB,
               live=256 * MiB, result=0, flags=0)
    return Snapshot(ts=time.time(), mode=mode,
                    gpus=(GpuRow(0, "NVIDIA H100 80GB HBM3", 80 * 1024 * MiB, 2000 * MiB, 1495 * MiB),),
                    containers=(a, b), events=(ev,), events_total=7, drops=0, libraries=("/lib/libcuda.so.1",))


def text_of(s, width=100):
    """A snapshot rendered for a terminal of `width` (or a renderable as it is)."""
    c = Console(width=width, record=True, color_system=None)
    c.print(render(s, width=min(width, 100)) if isinstance(s, Snapshot) else s)
    return c.export_text()


def test_render_figures_and_width():
    out = text_of(snapshot())
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "NVIDIA H100 80GB HBM3" in out and "80.0 GiB" in out and "1.5 GiB" in out  # 1495 MiB tracked
    row = next(line for line in lines if "trainer" in line)
    # container: live 384 MiB, overhead 2 x 519 MiB = 1038 MiB, total 1422 MiB, peak 512 MiB
    assert "384.0 MiB" in row and "1.0 GiB" in row and "1.4 GiB" in row and "512.0 MiB" in row
    assert row.startswith("trainer-with-a-very") and "5.0" in row  # 2 x 2.5 allocs/s
    assert "beta" in out and " 101 python3" in out and " 102 python3" in out
    est = next(line for line in lines if " 201 " in line)
    assert "64.0 MiB ~" in est
    ev = next(line for line in lines if "cuMemAlloc_v2 (cudaMalloc)" in line)
    assert "128.0 MiB" in ev and "256.0 MiB" in ev
    assert "q or Ctrl-C to end" in out and "events 7" in out and "dropped 0" in out


def test_render_modes():
    assert "DEMO (no NVIDIA driver here)" in text_of(snapshot("demo"))
    empty = Snapshot(ts=time.time(), mode="waiting", gpus=(), containers=())
    out = text_of(empty)
    assert "waiting for a CUDA driver" in out and "no CUDA process yet" in out


def test_render_narrow_terminal_does_not_crash():
    assert "trainer" in text_of(snapshot(), width=60)


def test_snapshot_json_totals():
    j = snapshot().to_json()
    a = j["containers"][0]
    assert (a["live"], a["overhead"], a["total"], a["peak"]) == (384 * MiB, 1038 * MiB, 1422 * MiB, 512 * MiB)
    assert [p["total"] for p in a["processes"]] == [775 * MiB, 647 * MiB]
    assert j["type"] == "snapshot" and j["schema"] == 1 and j["gpus"][0]["tracked"] == 1495 * MiB


ENFORCE = {"pid": 4242, "policy": "bf", "stall": "signal", "over_limit": "stall", "ctx_overhead": 0,
           "default_limit": 1 << 30, "started": 0.0,
           "gpus": {"0": {"capacity": 5 << 30, "assigned": 3 << 30, "unassigned": 2 << 30}},
           "containers": [{"id": "a" * 64, "name": "trainer", "kind": "podman", "cgroup": "/x", "limit": 2 << 30,
                           "source": "default", "pids": [101], "stalled_s": 3.25, "stalls": 2, "grants": 1,
                           "over_limit_events": 0, "restalls": 0,
                           "gpus": {"0": {"assigned": 1 << 30, "used": 768 * MiB, "context_overhead": 64 * MiB,
                                          "reserved": 512 * MiB, "contexts": 1, "waiting": True,
                                          "over_limit": False, "waiting_s": 1.5, "waiting_pids": [101]}}}]}


def test_snapshot_json_round_trip_and_enforce_table():
    """What an enforcer sends (to_json) is what `convgpu trace` rebuilds and shows."""
    s = snapshot()
    s = Snapshot(**{**s.__dict__, "enforce": ENFORCE})
    back = Snapshot.from_json(s.to_json(), s.events)
    assert back == s
    text = text_of(back)
    assert "enforcer (pid 4242): policy bf, stall signal; assigned GPU0 3.0 GiB of 5.0 GiB" in text
    row = next(line for line in text.splitlines() if line.lstrip().startswith("trainer "))
    assert row.split() == ["trainer", "aaaaaaaaaaaa", "0", "2.0", "GiB", "1.0", "GiB", "832.0", "MiB", "waiting",
                           "1.5s", "3.2s", "2"]
    assert max(len(line) for line in text.splitlines()) <= 100


def test_names_from_processes_and_containers_are_text_never_markup():
    """Issue 39 attack 2: a process named `[/x]` (PR_SET_NAME) ended `convgpu trace` with rich's
    MarkupError, and `[bold]` in a container's name restyled the view. Every such string is text."""
    import dataclasses
    from convgpu.cli.status import table
    s = snapshot()
    a = dataclasses.replace(s.containers[0], name="[/x]",
                            processes=tuple(dataclasses.replace(p, comm="[/x]") for p in s.containers[0].processes))
    ev = dataclasses.replace(s.events[0], comm="[/x]") if dataclasses.is_dataclass(s.events[0]) \
        else s.events[0]._replace(comm="[/x]")
    enforce = {"pid": 1, "policy": "bf", "stall": "signal", "gpus": {"0": {"assigned": 0, "capacity": 1}},
               "containers": [{"name": "[bold red]ab[/]", "limit": MiB, "stalled_s": 0.0, "stalls": 0,
                               "gpus": {"0": {"assigned": MiB, "used": 0, "context_overhead": 0,
                                              "over_limit": False, "waiting": False, "waiting_s": 0}}}]}
    out = text_of(dataclasses.replace(s, containers=(a,), events=(ev,), enforce=enforce,
                                      notes=("lib [/y] not probed",)))
    assert out.count("[/x]") >= 4 and "[bold red]ab[/]" in out and "[/y]" in out
    pending = [{"name": "ml/Job/[/p]/main", "limit": GiB, "what": "pod"}, {"name": "ml/[/c]", "limit": GiB, "what": "claim"},
               {"name": "trainer", "limit": GiB, "what": "registered"}]
    st = dict(enforce, containers=enforce["containers"], unmapped_charge="all", gpu_mappings=[
        {"pid": 7, "certain": False, "also": [0], "how": "[/z]"}], registered=pending)
    c = Console(width=200, record=True, color_system=None)
    c.print(table(st))
    out = c.export_text()
    assert "[bold red]ab[/]" in out and "[/z]" in out
    # pods and claims with a limit and no CUDA call yet: listed, as text, with what they are
    cells = [[x.strip() for x in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    lines = {c[0]: " ".join(c) for c in cells}
    assert "pod, no call yet" in lines["ml/Job/[/p]/main"] and "claim, no call" in lines["ml/[/c]"]
    assert "registered" in lines["trainer"] and "1.0 GiB" in lines["ml/[/c]"]
    out = text_of(dataclasses.replace(s, enforce=dict(enforce, registered=pending)))
    assert "ml/Job/[/p]/main" in out and "claim, no call" in out


def test_one_vocabulary_in_trace_and_status():
    """Issue 52: `used` was 704 MiB in trace's enforcer table and 640 MiB in `status` (one added
    the contexts, the other did not); the same container was `trainA-1073` in one table and
    `trainA` in the other; a context retain read as event `unknown`; three hours read
    `10800.0s`; the header claimed an NVIDIA driver on the stand-in; "no CUDA process yet"
    stood beside a stalled job. One name (the enforcer's) and an id, `used` = allocated +
    contexts everywhere, events in words, durations as people read them."""
    import dataclasses
    from convgpu.cli.status import table
    cg = "/convgpu.run/trainA-1073"
    tr = ContainerRow(id=cg, name="trainA-1073", kind="cgroup", cgroup=cg,
                      processes=(proc(1074, 640 * MiB, 64 * MiB),), peak=640 * MiB)
    g = {"assigned": GiB, "used": 640 * MiB, "context_overhead": 64 * MiB, "context_source": "operator",
         "over_limit": False, "waiting": True, "waiting_s": 10800.0}
    enforce = dict(ENFORCE, containers=[dict(ENFORCE["containers"][0], id=cg, name="trainA", kind="cgroup",
                                             cgroup=cg, stalled_s=10800.0, gpus={"0": g})])
    evs = tuple(dataclasses.replace(snapshot().events[0], op=op, api="cuDevicePrimaryCtxRetain", rt_api=None, size=0)
                if dataclasses.is_dataclass(snapshot().events[0]) else
                snapshot().events[0]._replace(op=op, api="cuDevicePrimaryCtxRetain", rt_api=None, size=0)
                for op in ("unknown", "ctx_create"))
    s = dataclasses.replace(snapshot(), containers=(tr,), enforce=enforce, events=evs)
    for width in (80, 100):
        out = text_of(s, width)
        rows = [line.split() for line in out.splitlines() if line.startswith("trainA")]
        assert len(rows) == 2 and all(r[:2] == ["trainA", "trainA-1073"] for r in rows), out
        assert "704.0 MiB" in " ".join(rows[0]) and "704.0 MiB" in " ".join(rows[1]), out   # used, both tables
        assert "waiting 3h00m" in out and "10800" not in out and "NVIDIA driver" not in out.splitlines()[0]
        assert [line.split()[3:5] for line in out.splitlines() if "cuDevicePrimaryCtxRetain" in line] == \
            [["first", "call"], ["context", "cuDevicePrimaryCtxRetain"]], out
    c = Console(width=200, record=True, color_system=None)
    c.print(table(dict(enforce, stall="signal", registered=[])))
    cells = [[x.strip() for x in line.split("│")[1:-1]] for line in c.export_text().splitlines() if "trainA" in line]
    assert cells == [["trainA", "trainA-1073", "0", "2.0 GiB", "1.0 GiB", "704.0 MiB", "64.0 MiB", "operator",
                      "waiting 3h00m", "3h00m", "2"]]
    waiting = text_of(dataclasses.replace(s, containers=()), 80)
    assert "no CUDA process yet" not in waiting and "no allocation yet; 1 waiting (below)" in waiting


def test_the_view_fits_the_terminal_processes_and_events_giving_way_first():
    """At 80x24 the whole view fits: process rows go first (their containers stay), then events
    down to three; at 160x45 everything shows. Before, at 80x24 columns were cut and the
    events table was pushed off the screen."""
    from convgpu.cli.view import lines
    s = snapshot()
    s = Snapshot(**{**s.__dict__, "enforce": ENFORCE, "events": s.events * 8, "notes": ("a note",)})
    small = render(s, width=80, height=23)
    assert lines(small, 80) <= 23
    out = text_of(small, 80)
    assert "recent events" in out and "trainer-with-a" in out
    assert not any(line.startswith("  101 python3") for line in out.splitlines()), out
    assert max(len(line) for line in out.splitlines()) <= 80
    big = text_of(render(s, width=100, height=44), 160)
    assert any(line.startswith("  101 python3") for line in big.splitlines()) and big.count("cuMemAlloc_v2 (cudaMalloc)") == 8 and "a note" in big
