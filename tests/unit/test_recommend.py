"""`convgpu recommend` without a kernel: the method of docs/RECOMMEND.md on worked examples, the
over- and under-asking flags, the forms to paste, the CLI (typer's CliRunner), the picture
(a PNG of the documented size) and the per-job metrics."""
import builtins
import json
import struct

import pytest
from typer.testing import CliRunner

from conftest import prom_samples
from convgpu.cli.main import app
from convgpu.enforcer.history import recommend as rc
from convgpu.enforcer.history.jobs import Job
from convgpu.enforcer.history.store import GpuRun, History, HistoryFile, Run, Series, add

MiB, GiB = 1 << 20, 1 << 30
runner = CliRunner()


def run(rid, peak, limit=4 * GiB, ended=10.0, gpus=1, series=None, **kw):
    return Run(rid, ended - 5, ended, "abc", limit, "convgpu run --limit",
               {d: GpuRun(peak if d == 0 else peak // 2, peak - 64 * MiB, 64 * MiB, 1, limit) for d in range(gpus)},
               series=series, **kw)


def three(limit=4 * GiB):
    return tuple(run(f"r{i}", p * MiB, limit, ended=10.0 + i) for i, p in enumerate((1000, 1500, 1200)))


def test_the_documented_method_on_a_worked_example():
    """docs/RECOMMEND.md: peaks 1000, 1500 and 1200 MiB. The largest, 1500 MiB, + 10 % is
    1650 MiB, rounded up to 256 MiB: 1792 MiB (7 units), covering 3 of 3 runs."""
    r = rc.recommend("run:train", three())
    assert (r.runs, r.peak, r.limit, r.units, r.covers, r.asked) == (3, 1500 * MiB, 1792 * MiB, 7, 3, 4 * GiB)
    assert r.over_asking and not r.under_asking          # 4 GiB >= 2 x 1792 MiB, and a unit more
    m = rc.Method(percentile=50)                         # the median run: 1200 -> 1320 -> 1536 MiB, covers 3
    assert (rc.recommend("j", three(), m).limit, rc.recommend("j", three(), m).covers) == (1536 * MiB, 3)
    m = rc.Method(percentile=50, margin_pct=0, unit=MiB)  # 1200 MiB as it is: covers 2 of 3
    assert (rc.recommend("j", three(), m).limit, rc.recommend("j", three(), m).covers) == (1200 * MiB, 2)
    assert rc.recommend("j", three(), rc.Method(margin_pct=0, margin_bytes=512 * MiB)).limit == 2048 * MiB
    assert rc.recommend("j", three(), rc.Method(margin_pct=0)).limit == 1536 * MiB
    assert rc.recommend("j", three(), rc.Method(unit=GiB)).limit == 2 * GiB
    assert rc.recommend("j", three(), rc.Method(runs=1)).peak == 1200 * MiB      # the newest only
    assert rc.recommend("j", ()) is None
    assert rc.Method().text() == "the largest peak of the newest 10 runs + 10 %, rounded up to 256MiB"


def test_the_margin_is_exact_in_bytes_and_the_limit_at_least_a_unit():
    assert rc.with_margin(1000, rc.Method(unit=1)) == 1100
    assert rc.with_margin(1001, rc.Method(unit=1)) == 1102          # 100.1 rounded up to a byte
    assert rc.with_margin(0, rc.Method()) == 256 * MiB
    assert [rc.nearest_rank(list(range(1, 11)), p) for p in (1, 10, 50, 90, 91, 100)] == [1, 1, 5, 9, 10, 10]


def test_over_asking_at_its_boundary():
    r = rc.recommend("j", three(limit=3584 * MiB))       # exactly 2 x 1792 MiB
    assert r.over_asking and "asks 3584MiB, 2.0 x what it needs" in r.notes
    assert not rc.recommend("j", three(limit=3584 * MiB - 1)).over_asking
    one = (run("a", 100 * MiB, limit=320 * MiB),)                                      # 256 MiB recommended
    assert not rc.recommend("j", one, rc.Method(over=1.2)).over_asking                  # 1.25 x, not a unit more
    assert rc.recommend("j", (run("a", 100 * MiB, limit=512 * MiB),), rc.Method(over=1.2)).over_asking
    assert not rc.recommend("j", (run("a", 100 * MiB, limit=None),)).over_asking        # asked nothing (trace)


@pytest.mark.parametrize("kw, under", [
    ({"over_limits": 1}, True),                                  # a call above its limit
    ({"at_limit_s": 0.5}, True),                                 # waited with its whole limit assigned
    ({"stalls": 1, "limit": 1536 * MiB}, True),                  # stalled, and 1500 MiB + 10 % > 1536 MiB
    ({"stalls": 1, "limit": 2 * GiB}, False),                    # stalled with room in its limit: the card's wait
    ({}, False),
])
def test_under_asking(kw, under):
    limit = kw.pop("limit", 4 * GiB)
    r = rc.recommend("j", (run("a", 1500 * MiB, limit, **kw),))
    assert r.under_asking is under
    assert any("the limit is a floor" in n for n in r.notes) is under
    assert "few runs (1): a first run says less than ten" in r.notes


def test_the_forms_to_paste():
    r = rc.recommend("run:train", three())
    f = rc.forms(r, rc.Method())
    assert f["run"] == "convgpu run --limit 1792MiB --name train -- COMMAND"
    assert f["units"] == ("resources:\n  limits:\n    convgpu.io/gpu-memory: 7   # x 256MiB "
                          "(convgpu kube --unit 256MiB)")
    assert f["dra"] == """apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: train-gpu-memory
spec:
  spec:
    devices:
      requests:
      - name: gpu-memory
        exactly:
          deviceClassName: gpu-memory.convgpu.io
          capacity:
            requests:
              memory: 1792Mi"""
    k8s = rc.recommend("k8s:ml/Deployment/Web%20App/main", three())
    assert rc.forms(k8s, rc.Method())["run"].endswith("--name NAME -- COMMAND")
    assert rc.dns_name("k8s:ml/Deployment/Web%20App/main") == "ml-deployment-web-20app-main-gpu-memory"
    assert rc.dns_name("podman:%5B%5D") == "5b-5d-gpu-memory" and rc.dns_name("run:%2D") == "2d-gpu-memory"
    assert [rc.size_text(n) for n in (3 * GiB, 2560 * MiB, 1536, 1001, None)] == ["3GiB", "2560MiB", "1536B", "1001B", "-"]
    assert rc.quantity(2560 * MiB) == "2560Mi" and rc.quantity(3 * GiB) == "3Gi"


# ---- the command ----

@pytest.fixture
def state(tmp_path):
    series = Series((0.0, 1.0, 2.0, 3.0), {0: (600, 1500, 1400, 700), 1: (100, 700, 750, 100)},
                    {0: (500, 520, 520, 520), 1: (0, 520, 520, 520)}, {0: (4096,) * 4, 1: (4096,) * 4},
                    ((1.0, 2.5, 0),))
    runs = list(three())
    runs[-1] = run("r2", 1200 * MiB, ended=12.0, gpus=2, series=series, stalls=1, stalled_s=1.5)
    HistoryFile(str(tmp_path)).append([(Job("run", "train"), r) for r in runs] +
                                      [(Job("podman", "web"), run("w", 300 * MiB, limit=512 * MiB, over_limits=1))])
    return str(tmp_path)


def test_the_table_the_flags_and_the_forms_of_one_job(state):
    r = runner.invoke(app, ["recommend", "--state-dir", state], terminal_width=100)
    assert r.exit_code == 0, r.output
    head = next(line for line in r.output.splitlines() if line.count("┃") == 8)
    assert [c.strip() for c in head.split("┃")[1:-1]] == ["job", "runs", "peak", "recommend", "covers", "asks", ""]
    rows = [line.split("│")[1:-1] for line in r.output.splitlines() if line.count("│") == 8]
    assert [[c.strip() for c in row] for row in rows] == [
        ["podman:web", "1", "300.0 MiB", "512MiB", "1/1", "512MiB", "under-asking"],
        ["run:train", "3", "1.5 GiB", "1792MiB", "3/3", "4GiB", "over-asking"]]
    assert "podman:web: held at its limit in 1 of 1 runs" in r.output and "--form run|units|dra" in r.output
    one = runner.invoke(app, ["recommend", "--state-dir", state, "train"], terminal_width=100)
    assert one.exit_code == 0 and "convgpu run --limit 1792MiB --name train -- COMMAND" in one.output
    assert "# run:train, units (its runs used 2 GPUs: one GPU's limit)" in one.output
    assert "memory: 1792Mi" in one.output and "convgpu.io/gpu-memory: 7" in one.output


def test_json(state):
    r = runner.invoke(app, ["recommend", "--state-dir", state, "--json", "--margin", "512MiB", "--unit", "1GiB"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["method"]["text"] == "the largest peak of the newest 10 runs + 512MiB, rounded up to 1GiB"
    train = next(j for j in doc["jobs"] if j["job"] == "run:train")
    assert {k: train[k] for k in ("peak", "peaks", "limit", "units", "covers", "gpus", "stalls", "stalled_s")} == \
        {"peak": 1500 * MiB, "peaks": {"0": 1500 * MiB, "1": 600 * MiB}, "limit": 2 * GiB, "units": 2, "covers": 3,
         "gpus": 2, "stalls": 1, "stalled_s": 1.5}     # 1500 + 512 MiB, rounded up to 1 GiB
    assert train["forms"]["run"] == "convgpu run --limit 2GiB --name train -- COMMAND"


@pytest.mark.parametrize("args, line", [
    (["nosuch"], "convgpu: no job 'nosuch' in the history; see `convgpu recommend` for the jobs it holds"),
    (["--margin", "ten%"], "convgpu: invalid --margin 'ten%'; give a whole percentage (10%) or a size (512MiB)"),
    (["--unit", "1KiB"], "convgpu: --unit 1KiB is below 1 MiB; give a unit like 256MiB (the device plugin's)"),
    (["--plot", "train", "--run", "-4"], "convgpu: run:train has 3 runs: no run -4; give --run -1 .. -3"),
    (["--plot", "train", "--run", "-2"], "convgpu: run r1 of run:train keeps no time series (only the newest 3 runs "
                                         "of a job keep theirs); plot one of its newest runs (--run -1, -2, ...)"),
])
def test_mistakes_are_one_line(state, args, line):
    r = runner.invoke(app, ["recommend", "--state-dir", state, *args], terminal_width=200)
    assert r.exit_code == 1 and r.output.strip() == line


def test_no_history_and_an_unreadable_one_are_one_line(tmp_path):
    r = runner.invoke(app, ["recommend", "--state-dir", str(tmp_path)], terminal_width=300)
    assert r.exit_code == 1 and r.output.strip() == (
        f"convgpu: no job history in {tmp_path}/history.jsonl yet; run jobs under `convgpu enforce` (or `convgpu "
        "trace` where none runs); a run is kept when it ends")
    (tmp_path / "history.jsonl").write_text("{}")
    r = runner.invoke(app, ["recommend", "--state-dir", str(tmp_path)], terminal_width=300)
    assert r.exit_code == 1 and r.output.strip() == (
        f"convgpu: cannot read the job history {tmp_path}/history.jsonl: not a convgpu-history file; repair it or "
        "move it aside (the enforcer keeps new runs in memory until then)")


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_the_plot_is_a_png_of_the_documented_size(state, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra: scripts/setup.sh installs it")
    out = tmp_path / "train.png"
    r = runner.invoke(app, ["recommend", "--state-dir", state, "--plot", "train", "--out", str(out)])
    assert r.exit_code == 0 and r.output.strip() == f"wrote {out} (1200 x 600)", r.output
    assert png_size(out) == (1200, 600) and out.stat().st_size > 20_000   # two panels of lines, not a blank


def test_without_matplotlib_the_plot_is_one_line(state, tmp_path, monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    r = runner.invoke(app, ["recommend", "--state-dir", state, "--plot", "train", "--out", str(tmp_path / "x.png")],
                      terminal_width=200)
    assert r.exit_code == 1 and r.output.strip() == (
        "convgpu: plotting needs matplotlib, which is not installed; pip install 'convgpu[plot]' (or matplotlib)")


# ---- metrics ----

def test_job_metrics_and_a_hostile_name():
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from convgpu.enforcer.history.jobs import identify
    from convgpu.enforcer.metrics import JobCollector
    nasty = identify("docker", "x", "/c", 'a"b\nc} x{="1"')
    h = add(add(History(), nasty, three()), Job("run", "tight"), (run("t", 300 * MiB, limit=256 * MiB, over_limits=1),))

    class Rec:
        summary = rc.summarize(h)
    reg = CollectorRegistry(auto_describe=True)   # describe() names every family
    reg.register(JobCollector(Rec()))
    got = prom_samples(generate_latest(reg).decode())
    k = nasty.key
    assert k == "docker:a%22b%0Ac%7D%20x%7B%3D%221%22"
    assert got == {("convgpu_job_peak_bytes", (("gpu", "0"), ("job", k)), 1500 * MiB),
                   ("convgpu_job_peak_bytes", (("gpu", "0"), ("job", "run:tight")), 300 * MiB),
                   ("convgpu_job_recommended_limit_bytes", (("job", k),), 1792 * MiB),
                   ("convgpu_job_recommended_limit_bytes", (("job", "run:tight"),), 512 * MiB),
                   ("convgpu_job_asked_bytes", (("job", k),), 4 * GiB),
                   ("convgpu_job_asked_bytes", (("job", "run:tight"),), 256 * MiB),
                   ("convgpu_job_misasked", (("job", k), ("way", "over")), 1),
                   ("convgpu_job_misasked", (("job", k), ("way", "under")), 0),
                   ("convgpu_job_misasked", (("job", "run:tight"), ("way", "over")), 0),
                   ("convgpu_job_misasked", (("job", "run:tight"), ("way", "under")), 1)}


def test_waits_that_follow_each_other_are_shaded_once():
    """Issue 52: the plot drew each wait as its own translucent span, and where waits followed
    each other their shades added up into a solid block. Overlapping and touching waits are
    joined, and each span is drawn once at the one shade."""
    pytest.importorskip("matplotlib", reason="the plot extra: scripts/setup.sh installs it")
    from convgpu.enforcer.history.plot import figure, spans
    waits = tuple((1.0 + i * 0.1, 1.15 + i * 0.1, 0) for i in range(50)) + ((8.0, 8.05, 0), (2.0, 3.0, 1))
    assert [pytest.approx(x) for x in spans(waits, 0)] == [(1.0, 6.1), (8.0, 8.2)] and spans(waits, 1) == [(2.0, 3.0)]
    series = Series(tuple(float(t) for t in range(10)), {0: (100,) * 10}, {0: (64,) * 10}, {0: (1024,) * 10}, waits)
    fig = figure("run:train", run("r", 100 * MiB, limit=GiB, ended=20.0, series=series), GiB)
    orange = [p for p in fig.axes[0].patches if p.get_facecolor()[:3] == pytest.approx((1.0, 0.498, 0.055), abs=0.01)]
    assert len(orange) == 2 and {round(p.get_alpha(), 2) for p in orange} == {0.3}
