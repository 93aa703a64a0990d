"""`python -m convgpu.bpf`: print the program as bcc compiles it (the top file, its parts pasted in)."""
import sys

from . import source_text

sys.stdout.write(source_text())
