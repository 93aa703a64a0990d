"""enforcer.heartbeat.Heartbeat without a kernel: it beats while the loop runs, stops once the
loop has not run for `hung` seconds (saying so once), and beats again after the next pass."""
import logging
import time

from convgpu.enforcer.heartbeat import Heartbeat


def test_beats_stop_when_the_loop_hangs_and_come_back_with_it(caplog):
    beats = []
    hb = Heartbeat(lambda: beats.append(time.monotonic()), every=0.01, hung=0.3).start()
    try:
        time.sleep(0.2)
        assert len(beats) >= 5                  # the loop "ran" at construction: beating
        time.sleep(0.4)                         # no pass for 0.6 s > hung
        stopped = len(beats)
        time.sleep(0.3)
        assert len(beats) == stopped            # no beat while hung
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
            "the enforcer's loop has not run for 0.3 s: its heartbeat stops, and BPF admits every "
            "call, unchecked, 2 s later (stalled work must not wait on a hung enforcer)"]
        assert hb.loop_ran() >= 0.9             # the gap since the last pass
        time.sleep(0.1)
        assert len(beats) > stopped             # beating again
    finally:
        hb.stop()
    after = len(beats)
    time.sleep(0.05)
    assert len(beats) == after                  # stopped for good
