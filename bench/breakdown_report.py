"""bench.breakdown's report: from the rounds it measured (per mode, bench/breakdown.py measure)
to each layer's step, the model of traps and BPF run time, the remainder, and the table. How
the numbers are taken and combined: bench/breakdown.py's docstring."""
import statistics

MODES = ("bare", "traps", "drv-entry", "drv-ret", "runtime", "enforced")   # each adds one layer


def layer_of(prog: str) -> str:
    """Which layer a program's runs are traps of (program names are cut at 15 characters)."""
    if prog.startswith("enter_cuda") or prog == "exit_runtime":
        return "runtime"
    if prog == "recheck":
        return "recheck"
    if prog == "empty":
        return "empty"
    if prog.startswith(("enter_", "sess_")):   # a free's session: its entry, its return skipped
        return "driver entry"                    # where that cannot matter (bpf free_session)
    if prog.startswith("exit_"):
        return "driver return"
    return "tracepoints"


def summarize(meta: dict, rounds: list[dict]) -> dict:
    med = statistics.median
    steps = []
    for m in MODES:
        prev = PREV.get(m)
        row = {"mode": m, "pair_ns": med(r[m]["pair_ns"] for r in rounds),
               "cpu_ns": med(r[m]["cpu_ns"] for r in rounds)}
        if prev:
            row["step_ns"] = med(r[m]["pair_ns"] - r[prev]["pair_ns"] for r in rounds)
        last = rounds[-1][m]
        traps: dict = {}
        bpf_ns = 0.0
        for prog, v in last["programs"].items():
            traps[layer_of(prog)] = traps.get(layer_of(prog), 0) + v["runs_per_pair"]
            if layer_of(prog) != "tracepoints":   # their runs are every process's syscalls, not the pair's
                bpf_ns += v["runs_per_pair"] * v["ns_per_run"]
        row.update(traps_per_pair=traps, bpf_ns_per_pair=bpf_ns, programs=last["programs"])
        for k in ("ring_records_per_pair", "wakeups_per_pair", "events_per_pair", "enforcer"):
            if k in last:
                row[k] = last[k]
        row["openat_ns"] = med(r[m]["openat_ns"] for r in rounds)
        row["fork_exit_ns"] = med(r[m]["fork_exit_ns"] for r in rounds)
        if prev:
            row["openat_step_ns"] = med(r[m]["openat_ns"] - r["bare"]["openat_ns"] for r in rounds)
            row["fork_exit_step_ns"] = med(r[m]["fork_exit_ns"] - r["bare"]["fork_exit_ns"] for r in rounds)
        steps.append(row)
    total = med(r["enforced"]["pair_ns"] - r["bare"]["pair_ns"] for r in rounds)
    added = sum(s.get("step_ns", 0) for s in steps if s["mode"] != "traps")
    # the model: every trap of the enforced pair at the cost of an empty program's trap, plus
    # the run time of the enforcer's programs; what it leaves is the remainder
    by = {s["mode"]: s for s in steps}
    empty = by["traps"]["traps_per_pair"].get("empty", 0)
    per_trap = by["traps"]["step_ns"] / empty if empty else 0.0
    traps = sum(v for k, v in by["enforced"]["traps_per_pair"].items() if k != "tracepoints")
    # an empty program's run (and the statistics' clock reads) is inside the trap's cost already
    empty_run = by["traps"]["programs"].get("empty", {}).get("ns_per_run", 0.0)
    model = {"traps_per_pair": traps, "ns_per_trap": per_trap, "traps_ns": traps * per_trap,
             "bpf_ns": by["enforced"]["bpf_ns_per_pair"] - traps * empty_run}
    tp = [v for k, v in by["enforced"]["programs"].items() if layer_of(k) == "tracepoints"]
    runs = sum(v["runs_per_pair"] for v in tp)
    model["tracepoint_ns_per_run"] = sum(v["runs_per_pair"] * v["ns_per_run"] for v in tp) / runs if runs else 0.0
    model["predicted_ns"] = model["traps_ns"] + model["bpf_ns"]
    return {**meta, "steps": steps, "total_ns": total, "sum_of_steps_ns": added, "model": model,
            "remainder_ns": total - model["predicted_ns"], "rounds_raw": rounds}


PREV = {"traps": "bare", "drv-entry": "bare", "drv-ret": "drv-entry", "runtime": "drv-ret", "enforced": "runtime"}
NEW = {"traps": ("empty",), "drv-entry": ("driver entry",), "drv-ret": ("driver return",), "runtime": ("runtime",),
       "enforced": ("recheck",)}


def table(res: dict) -> str:
    us = lambda ns: f"{ns / 1000:.2f}"
    lines = [f"{res['workload']} workload, {res['pairs']} pairs x {res['rounds']} rounds"
             f"{' (stand-in)' if res['standin'] else ''}; us per allocation+free pair",
             f"{'mode':10} {'pair':>7} {'step':>7} {'new traps/pair':>22} {'us/trap':>8} {'BPF us':>7} "
             f"{'ring rec':>8} {'wakeups':>8} {'openat+':>8} {'fork+':>7}"]
    by = {s["mode"]: s for s in res["steps"]}
    for s in res["steps"]:
        prev_traps = by[PREV[s["mode"]]]["traps_per_pair"] if s["mode"] in PREV else {}
        new = {k: v - prev_traps.get(k, 0) for k, v in s["traps_per_pair"].items() if k in NEW.get(s["mode"], ())}
        n = sum(v for k, v in new.items() if k != "tracepoints")
        per = us(s["step_ns"] / n) if n >= 0.5 and "step_ns" in s else "-"
        desc = ", ".join(f"{k.split()[-1]} {v:.2f}" for k, v in new.items() if k != "tracepoints") or "-"
        lines.append(f"{s['mode']:10} {us(s['pair_ns']):>7} {us(s['step_ns']) if 'step_ns' in s else '-':>7} "
                     f"{desc:>22} {per:>8} {us(s['bpf_ns_per_pair']):>7} "
                     f"{s.get('ring_records_per_pair', 0):>8.2f} {s.get('wakeups_per_pair', 0):>8.3f} "
                     f"{us(s.get('openat_step_ns', 0)):>8} {us(s.get('fork_exit_step_ns', 0)):>7}")
    e = res["steps"][-1].get("enforcer")
    if e:
        lines.append(f"enforcer: {us(e['cpu_ns_per_pair'])} us CPU and {e['switches_per_pair']:.3f} wake-ups "
                     f"(voluntary switches) per pair, on CPU {e['cpus']} (workload on {e['workload_cpu']})")
        top = sorted(e.get("threads", {}).items(), key=lambda kv: -kv[1]["switches_per_pair"])[:4]
        lines.append("  by thread: " + ", ".join(f"{k} {us(v['cpu_ns_per_pair'])} us / {v['switches_per_pair']:.3f}"
                                                for k, v in top))
    t, m = res["total_ns"], res["model"]
    lines.append(f"total enforced - bare {us(t)} us/pair (the layers' steps: {us(res['sum_of_steps_ns'])})")
    lines.append(f"model: {m['traps_per_pair']:.2f} traps x {us(m['ns_per_trap'])} us (an empty program's trap) "
                 f"= {us(m['traps_ns'])} + BPF programs beyond an empty one {us(m['bpf_ns'])} = {us(m['predicted_ns'])} us; "
                 f"remainder {us(res['remainder_ns'])} ({100 * res['remainder_ns'] / t if t else 0:+.0f} % of the total)")
    lines.append("openat+/fork+: what an unrelated process pays per openat+close / fork+exit over bare "
                 f"(the tracepoints: every process on the host; their programs {m['tracepoint_ns_per_run']:.0f} ns a run)")
    return "\n".join(lines)
