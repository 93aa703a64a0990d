"""What an enforcer closed in a running process gives back (a test session or a supervisor
starts many in one process)."""
import os

import pytest

from conftest import GiB, inprocess_enforcer

pytestmark = pytest.mark.system


def test_close_gives_back_the_watchdog_lifeline(root, build):
    """The lifeline to the watchdog is put just under the descriptor limit (watchdog.spawn:
    the kernel releases the highest descriptor first at our death, ahead of the slow uprobe
    detaches). Left open by close(), each enforcer took one of the 17 places there, and the 18th
    start in one process failed with EMFILE (CI: tests/system/test_shim_meminfo.py)."""
    lib = build / "standin" / "libcuda.so.1"
    for i in range(2):
        enf = inprocess_enforcer(lib, f"close{i}", GiB)
        enf.start()
        lifeline = enf.lifeline
        assert os.path.exists(f"/proc/self/fd/{lifeline}")
        enf.close()
        assert not os.path.exists(f"/proc/self/fd/{lifeline}"), f"lifeline {lifeline} still open"
        assert enf.watchdog is None
