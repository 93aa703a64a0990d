"""Draws the Grafana dashboard (deploy/grafana/convgpu.json) from a real Prometheus's answers to
its queries: Grafana itself cannot be installed here (no network but PyPI and Debian's packages,
and Debian has no grafana), so this lays the panels out as their gridPos says and draws each
query's result (time series as lines, stats as their last value, tables as rows). It is a
rendering of the dashboard's queries over real data, not Grafana's own screenshot.

The data comes from the system test's scenario on the stand-in driver:
  CONVGPU_DASHBOARD_DUMP=/tmp/dash.json CONVGPU_DASHBOARD_SECONDS=40 CONVGPU_REQUIRE_SYSTEM=1 \\
      .venv/bin/python -m pytest tests/system/test_prometheus_scrape.py
  .venv/bin/python bench/dashboard_render.py /tmp/dash.json docs/img/dashboard.png
(the plot extra: matplotlib)."""
import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "convgpu.json"
BG, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a"]
UNIT_H = 0.36   # inches per grid row (Grafana: 30 px a row, 24 columns across)


def size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt(value: float, unit: str) -> str:
    if unit == "bytes":
        return size(value)
    if unit == "s":
        return f"{value:.3g} s" if value < 120 else f"{value / 60:.3g} min"
    if unit == "percentunit":
        return f"{100 * value:.1f} %"
    if unit == "bool_on_off":
        return "On" if value else "Off"
    if unit == "bool_yes_no":
        return "Yes" if value else "No"
    if unit == "ops":
        return f"{value:.3g}/s"
    return f"{value:.4g}"


def legend(fmt_: str, metric: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt_) or str(metric)


def draw_timeseries(ax, panel, results, unit):
    import matplotlib.dates as mdates
    import matplotlib.ticker as ticker
    lines = []
    for t in panel["targets"]:
        for series in results.get(t["refId"], {}).get("result", ()):
            xs = [datetime.fromtimestamp(float(v[0])) for v in series["values"]]
            ys = [float(v[1]) for v in series["values"]]
            lines.append((xs, ys, "limit" in t.get("legendFormat", ""), legend(t.get("legendFormat", ""), series["metric"])))
    top = max((max(ys) for _, ys, _, _ in lines if ys), default=0)
    scale, suffix = (1, "")
    if unit == "bytes":   # ticks at round binary sizes: the values drawn in the unit they are read in
        scale, suffix = next(((n, u) for n, u in ((1 << 30, " GiB"), (1 << 20, " MiB"), (1 << 10, " KiB"))
                              if top >= n), (1, " B"))
    for i, (xs, ys, dashed, name) in enumerate(lines):
        ax.plot(xs, [y / scale for y in ys], color=COLORS[i % len(COLORS)], lw=1.4, ls="--" if dashed else "-",
                label=name)
    if unit == "bytes":
        ax.yaxis.set_major_locator(ticker.MaxNLocator(nbins=5, steps=[1, 2, 2.5, 4, 5, 8, 10]))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    else:
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: fmt(v, unit)))
    ax.set_ylim(bottom=0, top=max(1.0, top / scale) * 1.12)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.tick_params(colors=TEXT, labelsize=7)
    ax.grid(color=GRID, lw=0.5)
    for s in ax.spines.values():
        s.set_color(GRID)
    if lines:
        ax.legend(fontsize=6.5, loc="upper left", facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, ncol=2)


def draw_stat(ax, panel, results, unit):
    ax.axis("off")
    rows = []
    for t in panel["targets"]:
        for series in results.get(t["refId"], {}).get("result", ()):
            value = float((series.get("values") or [series.get("value")])[-1][1])
            rows.append((legend(t.get("legendFormat", ""), series["metric"]), value))
    for k, (name, value) in enumerate(rows[:4]):
        y = 0.72 - k * 0.5 / max(1, len(rows[:4]))
        color = "#f2495c" if unit in ("bool_on_off", "bool_yes_no") and not value else "#73bf69"
        ax.text(0.5, y, fmt(value, unit), ha="center", va="center", fontsize=16 if len(rows) == 1 else 11,
                color=color, weight="bold", transform=ax.transAxes)
        ax.text(0.5, y - 0.17, name, ha="center", va="center", fontsize=6.5, color=TEXT, transform=ax.transAxes)


def draw_table(ax, panel, results):
    ax.axis("off")
    names = {"A": "limit", "B": "used", "C": "waiting (s)", "D": "over limit by", "E": "swapped"}
    units = {"A": "bytes", "B": "bytes", "C": "s", "D": "bytes", "E": "bytes"}
    if len(panel["targets"]) > 1:     # "Containers now": the queries merged by their labels
        rows: dict = {}
        for t in panel["targets"]:
            for series in results.get(t["refId"], {}).get("result", ()):
                m = series["metric"]
                key = (m.get("container", ""), m.get("gpu", ""))
                rows.setdefault(key, {})[t["refId"]] = float(series["value"][1])
        header = ["container", "GPU"] + [names[t["refId"]] for t in panel["targets"]]
        body = [[c, g] + [fmt(v.get(t["refId"], 0), units[t["refId"]]) for t in panel["targets"]]
                for (c, g), v in sorted(rows.items())]
    else:                              # firing alerts
        header = ["alert", "about", "severity"]
        body = [[s["metric"]["alertname"], s["metric"].get("container") or ("GPU " + s["metric"]["gpu"] if "gpu" in
                 s["metric"] else s["metric"].get("instance", "")), s["metric"].get("severity", "")]
                for t in panel["targets"] for s in results.get(t["refId"], {}).get("result", ())]
    if not body:
        return
    tab = ax.table(cellText=body, colLabels=header, loc="upper center", cellLoc="left", colLoc="left")
    tab.auto_set_font_size(False)
    tab.set_fontsize(7.5)
    for (r, _), cell in tab.get_celld().items():
        cell.set_facecolor(PANEL if r else "#22252b")
        cell.set_edgecolor(GRID)
        cell.get_text().set_color(TEXT)


def render(dump: dict, out: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    width, height = 18.0, rows * UNIT_H + 0.7
    fig = plt.figure(figsize=(width, height), facecolor=BG)
    fig.text(0.01, 1 - 0.25 / height, f"{dash['title']}: a rendering of deploy/grafana/convgpu.json's queries over "
             f"real data from the stand-in driver (not Grafana's own screenshot), "
             f"{datetime.fromtimestamp(dump['start']):%Y-%m-%d %H:%M:%S} to {datetime.fromtimestamp(dump['end']):%H:%M:%S}",
             color=TEXT, fontsize=10, va="center")
    top = 0.5 / height
    for p in panels:
        g = p["gridPos"]
        x0, w = g["x"] / 24, g["w"] / 24
        y0 = 1 - top - (g["y"] + g["h"]) * UNIT_H / height
        h = g["h"] * UNIT_H / height
        if p["type"] == "row":
            fig.text(x0 + 0.005, y0 + h / 2, p["title"], color=TEXT, fontsize=11, weight="bold", va="center")
            continue
        frame = fig.add_axes([x0 + 0.003, y0 + 0.003, w - 0.006, h - 0.006], facecolor=PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for s in frame.spines.values():
            s.set_color(GRID)
        frame.text(0.01, 1 - 0.12 / (h * height), p["title"], color=TEXT, fontsize=8.5, weight="bold",
                   va="center", transform=frame.transAxes)
        inner = [x0 + 0.04 if p["type"] == "timeseries" else x0 + 0.006, y0 + (0.35 if p["type"] == "timeseries"
                 else 0.05) / height, w - (0.05 if p["type"] == "timeseries" else 0.012),
                 h - (0.65 if p["type"] == "timeseries" else 0.35) / height]
        ax = fig.add_axes(inner, facecolor=PANEL)
        results = dump["panels"].get(str(p["id"]), {})
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "none")
        if p["type"] == "timeseries":
            draw_timeseries(ax, p, results, unit)
        elif p["type"] == "stat":
            draw_stat(ax, p, results, unit)
        else:
            draw_table(ax, p, results)
    fig.savefig(out, dpi=110, facecolor=BG)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", help="the system test's CONVGPU_DASHBOARD_DUMP file")
    ap.add_argument("out", help="the PNG to write")
    args = ap.parse_args(argv)
    render(json.loads(Path(args.dump).read_text()), args.out)
    print(args.out)


if __name__ == "__main__":
    sys.exit(main())
