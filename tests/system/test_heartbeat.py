"""The enforcer's heartbeat (BPF admits everything, unchecked, once it is 2 s old): a loop held
for over a second is said in the log, so an operator can tell why something ran unchecked.
In-process enforcer on the stand-in driver, stepped by hand."""
import logging
import re
import time

import pytest

from conftest import GiB, run_dir_for

pytestmark = pytest.mark.system


def test_a_held_loop_is_said_in_the_log(root, build, caplog):
    from convgpu.enforcer.daemon import Enforcer
    from convgpu.enforcer.limits import LimitRules
    from convgpu.probes.tracer import Tracer
    caplog.set_level(logging.WARNING, logger="convgpu.enforcer.daemon")
    enf = Enforcer(Tracer(libraries=(str(build / "standin" / "libcuda.so.1"),), discover=False), "fifo",
                   {0: 4 * GiB}, LimitRules({}, 3 * GiB), run_dir=run_dir_for("beat"))
    enf.start()
    try:
        for _ in range(4):                  # beats 0.3 s apart: nothing to say
            enf.step()
            time.sleep(0.3)
        enf.step()
        assert not [r for r in caplog.records if "heartbeat" in r.getMessage()]
        time.sleep(1.4)                      # the loop held
        enf.step()
        late = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
        assert len(late) == 1 and re.match(r"heartbeat 1\.[4-9]\d s late \(the loop was held\): BPF admits "
                                           r"everything, unchecked, after 2 s without one$", late[0]), late
    finally:
        enf.close()
