"""The suite runs on two xdist workers (README's test command): discovery stops and probes every
process on the host that opens a driver file, the other worker's too, so every test module that
turns it on must be marked `exclusive` (tests/conftest.py host_turn)."""
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# an enforcer or trace with --discover, a Tracer(discover=True), discovery enabled by hand
DISCOVERY = re.compile(r'"--discover"|discover=True|\.enable_discovery\(')


def test_every_module_that_turns_discovery_on_is_exclusive():
    unmarked = [str(p.relative_to(TESTS)) for p in sorted(TESTS.glob("*/test_*.py"))
                if p.parent.name != "gpu" and DISCOVERY.search(text := p.read_text())
                and "pytest.mark.exclusive" not in text]
    assert unmarked == [], f"mark these modules pytest.mark.exclusive: {unmarked}"
