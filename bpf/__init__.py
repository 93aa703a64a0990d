"""BPF C sources (package data): convgpu.bpf.c, the parts it includes (*.bpf.c) and the shared
header convgpu.h."""
import re
from pathlib import Path

DIR = Path(__file__).resolve().parent
SOURCE = DIR / "convgpu.bpf.c"
HEADER = DIR / "convgpu.h"
_PART = re.compile(r'^#include "([\w.-]+\.bpf\.c)"[ \t]*$', re.M)


def source_text(src: Path | str = SOURCE) -> str:
    """src as bcc compiles it: each `#include "x.bpf.c"` of a file beside it replaced by that
    file. bcc 0.26 rewrites map calls (threads.lookup()) and finds the programs only in the main
    source it is given: a part left to the preprocessor compiles to calls of nothing. `#line`
    keeps clang's messages at the part's own file and line. Headers (.h) stay includes."""
    src = Path(src)
    text = src.read_text()
    out, at = [], 0
    for m in _PART.finditer(text):
        part = src.parent / m.group(1)
        line = text.count("\n", 0, m.end()) + 2      # the line after the include
        body = source_text(part)
        out += [text[at:m.start()], f'#line 1 "{part.name}"\n', body, "" if body.endswith("\n") else "\n",
                f'#line {line} "{src.name}"']
        at = m.end()
    return "".join(out + [text[at:]])
