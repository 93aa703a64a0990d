"""Experiment 1's reporting (bench/latency_report.py), the runtime it finds (bench/probe_latency.py),
captions (bench/machine.py) and the plots (bench/plots.py), from made-up and from recorded runs:
no root, no kernel, no GPU. The measurement itself is smoke-tested in
tests/system/test_bench_sched.py."""
import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

from conftest import need

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))   # bench/ lives at the repo root
from bench import latency_report, machine, probe_latency  # noqa: E402

RUN = REPO / "docs" / "gpu-runs" / "2026-11-23"   # an H100 run in the older format (the start-up and e2e plots come from it)


def cell(api, size, **ns):
    """A line of alloc_bench, parsed."""
    return probe_latency.parse_cell(["cell", api, str(size), "bytes", str(size), "n", "10",
                                     *(x for k, v in ns.items() for x in (k, str(v)))])


def made_up_run() -> dict:
    """Two modes, three rounds, one allocating API at one size and one info API."""
    raw = {m: [[cell("cudaMalloc", 4096, alloc_ns=a, alloc_p99_ns=2 * a, free_ns=f, free_p99_ns=3 * f),
                cell("cudaMemGetInfo", 0, call_ns=c, call_p99_ns=c + 100)]
               for a, f, c in rounds]
           for m, rounds in {"bare": [(1000, 500, 300), (3000, 700, 100), (2000, 600, 200)],
                             "shim": [(9000, 900, 800), (7000, 1100, 400), (8000, 1000, 600)]}.items()}
    meta = {"iters": 10, "rounds": 3, "standin": True, "modes": ["bare", "shim"],
            "apis": ["cudaMalloc", "cudaMemGetInfo"], "sizes": [4096], "cudart": None, "unavailable": {}, "argv": [],
            "machine": {"date": "2026-11-24 09:00 UTC", "kernel": "6.18", "cpus": 2, "gpu": None, "driver": None}}
    return latency_report.summarize(meta, raw)


def test_cells_are_medians_over_rounds_and_ratios_to_bare():
    res = made_up_run()
    assert [(c["api"], c["op"], c["n"]) for c in res["cells"]] == [
        ("cudaMalloc", "alloc", 10), ("cudaMalloc", "free", 10), ("cudaMemGetInfo", "call", 10)]
    alloc, free, call = res["cells"]
    assert alloc["modes"]["bare"] == {"median_us": 2.0, "p99_us": 4.0, "rounds": [[1.0, 2.0], [3.0, 6.0], [2.0, 4.0]],
                                      "added_us": 0.0, "ratio": 1.0, "p99_ratio": 1.0}
    shim = alloc["modes"]["shim"]
    assert (shim["median_us"], shim["p99_us"], shim["added_us"]) == (8.0, 16.0, 6.0)
    assert (shim["ratio"], shim["p99_ratio"]) == (4.0, 4.0)
    assert free["modes"]["shim"]["ratio"] == pytest.approx(1.0 / 0.6)
    assert call["size"] == 0 and call["modes"]["shim"]["median_us"] == 0.6 and call["modes"]["shim"]["p99_us"] == 0.7
    table = latency_report.table(res).splitlines()
    assert len(table) == 2 + 3 and table[2].startswith("| cudaMalloc | 4.0 KiB | alloc | 2.00 | 4.00 | 4.00 | 4.00 |")
    assert table[4].startswith("| cudaMemGetInfo | - | call |")


def test_version_1_runs_read_as_cells():
    """The 2026-11-23 H100 run (cuMemAlloc_v2 only, no p99 yet) reads as version 2 cells."""
    data = json.loads((RUN / "latency.json").read_text())
    cells = latency_report.cells_of(data)
    assert [(c["size"], c["op"]) for c in cells] == [(s, op) for s in (4096, 65536, 1 << 20, 16 << 20)
                                                     for op in ("alloc", "free")]
    first = cells[0]["modes"]
    assert first["bare"]["median_us"] == 1.653 and first["shim"]["ratio"] == pytest.approx(42.40, abs=0.01)
    assert first["shim"]["p99_ratio"] is None


def test_captions_name_machine_driver_and_date():
    data = json.loads((RUN / "latency.json").read_text())
    assert machine.describe(data, RUN / "latency.json") == (
        "NVIDIA H100 80GB HBM3, driver 580.159.04, kernel 6.18.44-fc-v657-gpu, 2026-11-23 02:49 UTC")
    assert machine.describe(made_up_run(), Path("/nowhere/x.json")) == (
        "stand-in driver on a 2-CPU machine, kernel 6.18, 2026-11-24 09:00 UTC")


def test_find_cudart_takes_the_newest_wheel_runtime(tmp_path, monkeypatch):
    for sub, name in (("cuda_runtime", "libcudart.so.12"), ("cu13", "libcudart.so.13"),
                      ("cu13", "libcudart.so.13.0.9")):
        (tmp_path / "nvidia" / sub / "lib").mkdir(parents=True, exist_ok=True)
        (tmp_path / "nvidia" / sub / "lib" / name).write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    importlib.invalidate_caches()
    assert probe_latency.find_cudart() == str(tmp_path / "nvidia" / "cu13" / "lib" / "libcudart.so.13.0.9")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])   # IHDR: width, height


def test_plots_make_pngs(tmp_path):
    need(importlib.util.find_spec("matplotlib") is not None, "matplotlib not installed: pip install -e '.[bench]'")
    from bench import plots
    made = tmp_path / "made-up.json"
    latency_report.write(str(made), made_up_run())
    assert plots.main(["--latency", str(made), "--out", str(tmp_path / "a")]) == 0
    w, h = png_size(tmp_path / "a" / "latency.png")
    assert w >= 800 and h >= 300   # three panels: cudaMalloc, cudaFree, cudaMemGetInfo
    assert plots.main(["--latency", str(RUN / "latency.json"), "--e2e", str(RUN / "e2e" / "e2e.json"),
                       "--out", str(tmp_path / "b")]) == 0
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["e2e.png", "latency.png", "startup.png"]
    for p in (tmp_path / "b").iterdir():
        assert min(png_size(p)) >= 300, p


def made_up_toggle(label: str, gpu: str | None) -> dict:
    """bench.e2e_toggle's shape: bare blocks around probed, enforced and delay blocks."""
    from bench import e2e_stats
    seq = [("bare", 100), ("probed", 101), ("bare", 100), ("enforced", 102), ("bare", 99), ("delay", 101),
           ("bare", 100), ("enforced", 101), ("bare", 100), ("probed", 100), ("bare", 101)]
    blocks = [{"mode": m, "median_ns": v * 1000, "steps": 50} for m, v in seq]
    modes = e2e_stats.summarize(blocks)
    modes["delay"].update(truth_ratio=1.01, truth_added_us=1.0)
    modes["probed"]["alloc_rate"] = 1234.0
    return {"label": label, "block_s": 5, "settle_s": 1, "blocks": blocks, "modes": modes, "standin": gpu is None,
            "machine": {"date": "2026-11-25 09:00 UTC", "kernel": "6.18", "cpus": 16, "gpu": gpu, "driver": "580.159.04"}}


def test_toggle_plot_has_a_panel_per_workload(tmp_path):
    need(importlib.util.find_spec("matplotlib") is not None, "matplotlib not installed: pip install -e '.[bench]'")
    from bench import plots
    files = []
    for i, (label, gpu) in enumerate((("torch", "NVIDIA H100 80GB HBM3"), ("jax", "NVIDIA H100 80GB HBM3"),
                                      ("standin", None))):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(made_up_toggle(label, gpu)))
    assert plots.main(["--toggle", *map(str, files[:1]), "--out", str(tmp_path / "one")]) == 0
    assert plots.main(["--toggle", *map(str, files[:3]), "--out", str(tmp_path / "three")]) == 0
    cut = made_up_toggle("cut short", None)   # a run its time limit ended: blocks, no summary
    del cut["modes"]
    for b in cut["blocks"]:
        b["delay_ns"] = 1000 if b["mode"] == "delay" else None
    files.append(tmp_path / "cut.json")
    files[-1].write_text(json.dumps(cut))
    assert plots.main(["--toggle", str(files[-1]), "--out", str(tmp_path / "cut")]) == 0
    w1, h1 = png_size(tmp_path / "one" / "e2e_toggle.png")
    w3, h3 = png_size(tmp_path / "three" / "e2e_toggle.png")
    assert w3 > 2 * w1 * 0.9 and h3 == h1 and h1 >= 300   # three panels side by side


def test_bpf_table_takes_medians_over_rounds_per_mode_and_program():
    res = {"bpf_stats": {"enforced": [{"recheck": {"runs": 41, "ns_per_run": 100.0},
                                       "exit_alloc": {"runs": 41, "ns_per_run": 900.0}},
                                      {"recheck": {"runs": 43, "ns_per_run": 300.0}},
                                      {"recheck": {"runs": 42, "ns_per_run": 200.0},
                                       "exit_alloc": {"runs": 41, "ns_per_run": 700.0}}]}}
    assert latency_report.bpf_table(res).splitlines() == [
        "| mode | program | runs | ns/run |", "| --- | --- | ---: | ---: |",
        "| enforced | exit_alloc | 41 | 800 |", "| enforced | recheck | 42 | 200 |"]


def test_cells_are_put_at_bare_s_cpu_speed_by_their_reference_work():
    """Round 2 of the shim ran while the host had slowed the CPU to half speed (its reference
    work took 200 us, bare's 100): its times count at half. Scaled, the shim adds 1 us in every
    round; as measured, the slow round moves the median."""
    raw = {"bare": [[cell("cuMemAlloc_v2", 4096, alloc_ns=2000, alloc_p99_ns=4000, free_ns=1000, free_p99_ns=2000,
                          ref_ns=100000)] for _ in range(3)],
           "shim": [[cell("cuMemAlloc_v2", 4096, alloc_ns=a, alloc_p99_ns=2 * a, free_ns=1000 * s, free_p99_ns=2000 * s,
                          ref_ns=100000 * s)] for a, s in ((3000, 1), (6000, 2), (3000, 1))]}
    meta = {"modes": ["bare", "shim"]}
    res = latency_report.summarize(meta, raw)
    alloc = res["cells"][0]["modes"]["shim"]
    assert alloc["rounds"] == [[3.0, 6.0], [6.0, 12.0], [3.0, 6.0]] and alloc["speed"] == 1.0
    assert (alloc["scaled_median_us"], alloc["scaled_added_us"], alloc["scaled_ratio"]) == (3.0, 1.0, 1.5)
    assert alloc["scaled_p99_ratio"] == 1.5
    raw["shim"][1][0]["alloc_ns"] = 9000     # a slow round that is slower still: the median is the others'
    assert latency_report.summarize(meta, raw)["cells"][0]["modes"]["shim"]["scaled_added_us"] == 1.0
    table = latency_report.scaled_table(res).splitlines()
    assert table[2] == "| cuMemAlloc_v2 | 4.0 KiB | alloc | 1.00 | 1.00 | 1.50 | 1.00 |"
    assert table[3] == "| cuMemAlloc_v2 | 4.0 KiB | free | 0.00 | 0.00 | 1.00 | 1.00 |"
    # without the reference work (runs before it), nothing is scaled
    old = made_up_run()
    assert "scaled_ratio" not in old["cells"][0]["modes"]["shim"] and latency_report.scaled_table(old) == ""
