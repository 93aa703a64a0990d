"""Experiment 1's results (bench/probe_latency.py): from what alloc_bench printed per mode and
round to cells, a table and the JSON that bench/plots.py draws.

JSON (version 2): the run's parameters, `machine`, and `cells`: one per (api, size, op), op
"alloc", "free" or "call" (info APIs, size 0), each with `n` (calls timed per round), `bytes`
(asked of the driver per call) and per mode `median_us` / `p99_us` (medians over rounds of the
per-call median and p99), `added_us`, `ratio` / `p99_ratio` (to bare's) and `rounds` (the
per-round [median, p99] in us). Where alloc_bench timed its reference work beside each cell
(`ref_ns`), every mode also has `scaled_median_us` / `scaled_p99_us` (each round's times times
bare's reference over the mode's, same round: the cell at bare's CPU speed), `scaled_added_us`,
`scaled_ratio`, `scaled_p99_ratio` and `speed` (the median of those factors). With --bpf-stats, `bpf_stats`: per mode, per round, per BPF
program (names cut to 15 characters by the kernel) its `runs` and `ns_per_run` during the
round's measurement. Version 1 (the runs of 2026-11-22 and -23): `rows` of cuMemAlloc_v2 /
cuMemFree_v2 only, without p99 at first; `cells_of` reads both."""
import json
import statistics

from convgpu.units import format_size

VERSION = 2
OPS = ("alloc", "free", "call")


def summarize(meta: dict, raw: dict) -> dict:
    """raw: {mode: [round: [cell dict as alloc_bench printed it]]}, every mode (bare among them)
    with the same rounds so far and the same cells in the same order."""
    modes = meta["modes"]
    first = raw[modes[0]][0]
    cells = []
    for i, c in enumerate(first):
        for op in OPS:
            if f"{op}_ns" not in c:
                continue
            per_mode = {}
            refs = {m: [r[i].get("ref_ns") for r in raw[m]] for m in modes}
            scaled = all(x for m in modes for x in refs[m])
            for m in modes:
                rounds = [[r[i][f"{op}_ns"] / 1000, r[i][f"{op}_p99_ns"] / 1000] for r in raw[m]]
                per_mode[m] = {"median_us": statistics.median(x[0] for x in rounds),
                               "p99_us": statistics.median(x[1] for x in rounds), "rounds": rounds}
                if scaled:
                    k = [b / x for b, x in zip(refs["bare"], refs[m])]
                    per_mode[m].update(speed=statistics.median(k),
                                       scaled_median_us=statistics.median(x[0] * f for x, f in zip(rounds, k)),
                                       scaled_p99_us=statistics.median(x[1] * f for x, f in zip(rounds, k)))
            base = per_mode["bare"]
            for v in per_mode.values():
                v["added_us"] = v["median_us"] - base["median_us"]
                v["ratio"] = v["median_us"] / base["median_us"]
                v["p99_ratio"] = v["p99_us"] / base["p99_us"]
                if scaled:
                    v["scaled_added_us"] = v["scaled_median_us"] - base["scaled_median_us"]
                    v["scaled_ratio"] = v["scaled_median_us"] / base["scaled_median_us"]
                    v["scaled_p99_ratio"] = v["scaled_p99_us"] / base["scaled_p99_us"]
            cells.append({"api": c["api"], "size": c["size"], "bytes": c["bytes"], "op": op, "n": c["n"],
                          "modes": per_mode})
    return {"version": VERSION, **meta, "rounds_done": len(raw[modes[0]]), "cells": cells}


def write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def cells_of(data: dict) -> list[dict]:
    """Version 2 cells, also from a version 1 file (cuMemAlloc_v2 / cuMemFree_v2 rows)."""
    if data.get("version", 1) >= 2:
        return data["cells"]
    return [{"api": "cuMemAlloc_v2", "size": row["size"], "bytes": row["size"], "op": op, "n": data["iters"],
             "modes": {m: {"median_us": v["us"], "p99_us": v.get("p99_us"), "added_us": v["added_us"],
                           "ratio": v["ratio"],
                           "p99_ratio": v["p99_us"] / row[op]["bare"]["p99_us"] if "p99_us" in v else None}
                       for m, v in row[op].items()}}
            for row in data["rows"] for op in ("alloc", "free")]


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(result: dict) -> str:
    """Markdown: bare's median and p99 in us, then each mode's ratios to them."""
    modes = ["bare"] + [m for m in result["modes"] if m != "bare"]
    head = ["api", "size", "op", "bare us", "p99 us"] + [f"{m} {s}" for m in modes[1:] for s in ("x", "p99 x")]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | --- |" + " ---: |" * (len(head) - 3)]
    for c in cells_of(result):
        v = c["modes"]
        size = "-" if c["op"] == "call" else format_size(c["size"])
        row = [c["api"], size, c["op"], _f(v["bare"]["median_us"]), _f(v["bare"]["p99_us"])]
        row += [_f(v[m][k]) for m in modes[1:] for k in ("ratio", "p99_ratio")]
        lines.append("| " + " | ".join(row) + " |")
    unavailable = result.get("unavailable") or {}
    lines += [f"{api}: unavailable ({why})" for api, why in unavailable.items()]
    return "\n".join(lines)


def scaled_table(result: dict) -> str:
    """Markdown, where the cells carry their reference work: per mode the us added to bare and the
    p99 ratio, as measured and at bare's CPU speed, and the speed factor. Empty without it."""
    modes = [m for m in result["modes"] if m != "bare"]
    cells = [c for c in result["cells"] if "speed" in c["modes"]["bare"]]
    if not cells:
        return ""
    head = ["api", "size", "op"] + [f"{m} {s}" for m in modes for s in ("+us", "+us scaled", "p99 x scaled", "speed")]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | --- |" + " ---: |" * (len(head) - 3)]
    for c in cells:
        v = c["modes"]
        row = [c["api"], "-" if c["op"] == "call" else format_size(c["size"]), c["op"]]
        row += [_f(v[m][k]) for m in modes for k in ("added_us", "scaled_added_us", "scaled_p99_ratio", "speed")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def bpf_table(result: dict) -> str:
    """Markdown: per mode and BPF program, runs per round and mean ns per run (medians over rounds)."""
    lines = ["| mode | program | runs | ns/run |", "| --- | --- | ---: | ---: |"]
    for mode, rounds in result.get("bpf_stats", {}).items():
        for name in sorted({n for r in rounds for n in r}):
            got = [r[name] for r in rounds if name in r]
            lines.append(f"| {mode} | {name} | {statistics.median(x['runs'] for x in got):.0f} | "
                         f"{statistics.median(x['ns_per_run'] for x in got):.0f} |")
    return "\n".join(lines)
