"""Issue 47 finding 6: a process named `\\x1b]0;PWNED\\x07\\x1b[8m` (PR_SET_NAME) put raw terminal
escapes into `convgpu trace`. Every string a tenant chooses goes through printable() wherever it
is shown: the live view, `status`, `recommend`, `doctor`, an error line and the log lines; JSON
escapes them by its own rules."""
import dataclasses
import io
import json
import logging

from rich.console import Console

from convgpu.cli import common
from convgpu.cli.status import table
from convgpu.cli.view import render, text
from convgpu.printable import printable
from test_view import snapshot

MiB, GiB = 1 << 20, 1 << 30
NAME = "\x1b]0;PWNED\x07\x1b[8m"           # sets the title, then hides what follows
SHOWN = "\\x1b]0;PWNED\\x07\\x1b[8m"
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def shown(renderable, width=200) -> str:
    """What a terminal is sent (colours on: the view's own escapes are there, a name's must not be)."""
    f = io.StringIO()
    Console(file=f, width=width, force_terminal=True, color_system="standard").print(renderable)
    return f.getvalue()


def plain(renderable, width=200) -> str:
    c = Console(width=width, record=True, color_system=None)
    c.print(renderable)
    return c.export_text()


def test_printable_escapes_controls_and_keeps_the_rest():
    assert printable(NAME) == SHOWN
    assert printable("a\nb\rc\td\x7f\x9bé[/x]\\") == "a\\x0ab\\x0dc\\x09d\\x7f\\x9bé[/x]\\"
    assert printable("evil\u202eexe.txt\u2066") == "evil\\u202eexe.txt\\u2066"
    assert printable("ml/Deployment/web-7d9f/app") == "ml/Deployment/web-7d9f/app"
    assert printable(42) == "42"


def test_the_live_view_shows_names_escaped():
    s = snapshot()
    a = dataclasses.replace(s.containers[0], name="c" + NAME,
                            processes=tuple(dataclasses.replace(p, comm=NAME) for p in s.containers[0].processes))
    ev = s.events[0]._replace(comm=NAME) if hasattr(s.events[0], "_replace") else dataclasses.replace(s.events[0], comm=NAME)
    enforce = {"pid": 1, "policy": "bf", "stall": "signal", "gpus": {"0": {"assigned": 0, "capacity": 1}},
               "containers": [{"name": "e" + NAME, "limit": MiB, "stalled_s": 0.0, "stalls": 0,
                               "gpus": {"0": {"assigned": MiB, "used": 0, "context_overhead": 0,
                                              "over_limit": False, "waiting": False, "waiting_s": 0}}}],
               "registered": [{"name": "r" + NAME, "limit": GiB, "what": "pod"}]}
    snap = dataclasses.replace(s, containers=(a,), events=(ev,), enforce=enforce, libraries=("/x" + NAME,),
                               notes=("n" + NAME,))
    out = shown(render(snap), 100)
    for raw in ("\x1b]", "\x07", "\x1b[8m"):      # the title's and the concealing escapes, raw
        assert raw not in out, repr(out)
    words = plain(render(snap), 100)
    assert words.count("PWNED") >= 6 and "\\x1b]0;PWNED\\x07" in words


def test_status_shows_names_and_notes_escaped():
    st = {"pid": 1, "policy": "bf", "stall": "signal", "gpus": {"0": {"assigned": 0, "capacity": 1}},
          "containers": [{"name": NAME, "limit": MiB, "stalled_s": 0.0, "stalls": 0,
                          "gpus": {"0": {"assigned": MiB, "used": 0, "context_overhead": 0, "over_limit": False,
                                         "waiting": False, "waiting_s": 0}}}],
          "registered": [{"name": "job" + NAME, "limit": GiB, "what": "registered"}],
          "unmapped_charge": "all", "gpu_mappings": [{"pid": 7, "certain": False, "also": [0], "how": "h" + NAME}],
          "unchecked_calls": 1}
    out = shown(table(st))
    assert "\x1b]" not in out and "\x07" not in out and "\x1b[8m" not in out, repr(out)
    words = plain(table(st))
    assert words.count(SHOWN) == 3, words
    # the caption's notes stay one a line
    notes = [x.strip() for x in words.splitlines()[-2:]]
    assert notes == ["1 allocations ran unchecked while the enforcer's heartbeat had lapsed (see its log)",
                     f"pid 7: its CUDA devices are not established as host GPUs (h{SHOWN}): charged to GPU [0]"]
    assert json.loads(json.dumps(st))["containers"][0]["name"] == NAME   # --json: escaped by JSON
    assert "\x1b" not in json.dumps(st)


def test_a_cell_made_elsewhere_is_escaped_too():
    from rich.text import Text
    assert text(Text(NAME, style="bold")).plain == "\\x1b]0;PWNED\\x1b[8m"   # (rich's Text drops a BEL itself)
    assert text(Text("ok", style="green")).style == "green"


def test_log_lines_and_error_lines_are_printable(capsys):
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(common.PrintableFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("convgpu.test-printable")
    log.addHandler(h)
    try:
        log.warning("container %s over", NAME + "\n2026-12-06 WARNING forged line")
        try:
            raise ValueError("a\nb")
        except ValueError:
            log.exception("failed for %s", NAME)
    finally:
        log.removeHandler(h)
    lines = buf.getvalue().splitlines()
    assert lines[0] == f"WARNING container {SHOWN}\\x0a2026-12-06 WARNING forged line over"
    assert lines[1] == f"ERROR failed for {SHOWN}" and lines[2] == "Traceback (most recent call last):"
    assert "\x1b" not in buf.getvalue()
    common.fail(f"no container named {NAME}")
    err = capsys.readouterr().err
    assert SHOWN in err and "\x1b]" not in err, repr(err)
