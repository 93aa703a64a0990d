"""BPF C sources (package data): convgpu.bpf.c and the shared header convgpu.h."""
from pathlib import Path

DIR = Path(__file__).resolve().parent
SOURCE = DIR / "convgpu.bpf.c"
HEADER = DIR / "convgpu.h"
