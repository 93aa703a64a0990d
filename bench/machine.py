"""What a benchmark ran on, stored in its JSON so that every table and plot made from it can say
so (date, kernel, CPUs, GPU and driver). Older runs have it only in the machine.txt that
tests/gpu/env.sh writes beside their JSON; `describe` reads either."""
import datetime
import os
import platform
import subprocess
from pathlib import Path


def machine() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "kernel": platform.release(), "cpus": os.cpu_count(), "gpu": None, "driver": None}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    if out and "," in out[0]:
        info["gpu"], info["driver"] = (x.strip() for x in out[0].split(",")[:2])
    return info


def from_machine_txt(path: Path) -> dict | None:
    """machine.txt: `date -u`, then `nvidia-smi` name, driver, memory; then the kernel."""
    try:
        lines = path.read_text().splitlines()
        when = datetime.datetime.strptime(lines[0].replace(" UTC", ""), "%a %b %d %I:%M:%S %p %Y")
        gpu, driver = (x.strip() for x in lines[1].split(",")[:2])
    except (OSError, IndexError, ValueError):
        return None
    return {"date": when.strftime("%Y-%m-%d %H:%M UTC"), "kernel": lines[2] if len(lines) > 2 else None,
            "gpu": gpu, "driver": driver}


def describe(data: dict, json_path: Path) -> str:
    """One line for a caption: GPU, driver, date (or the stand-in and this machine's CPU)."""
    m = data.get("machine") or from_machine_txt(Path(json_path).parent / "machine.txt") or {}
    if data.get("standin") or not m.get("gpu"):
        where = f"stand-in driver on a {m.get('cpus', '?')}-CPU machine" if data.get("standin") else "unknown machine"
    else:
        where = f"{m['gpu']}, driver {m['driver']}"
    return f"{where}, kernel {m.get('kernel') or '?'}, {m.get('date') or 'date unknown'}"
