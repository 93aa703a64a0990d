"""enforcer.heartbeat.Heartbeat without a kernel: the loop beats while it runs and the thread
stays out of its way; a slow loop is beaten for by the thread; a loop that has not run for
`hung` seconds is not (said once), until its next pass."""
import logging
import threading
import time

from convgpu.enforcer.failsafe.heartbeat import Heartbeat


def test_the_thread_beats_only_for_a_slow_loop_and_stops_for_a_hung_one(caplog):
    beats, comms = [], set()

    def beat():
        beats.append(threading.current_thread().name)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:   # the kernel's name too
            comms.add(f.read().strip())
    hb = Heartbeat(beat, every=0.05, hung=0.6).start()
    try:
        for _ in range(15):                     # a loop that runs: it beats, the thread does not
            hb.loop_ran()
            hb.beat_if_due()
            time.sleep(0.01)
        assert beats and set(beats) == {"MainThread"}
        del beats[:]
        time.sleep(0.4)                         # a slow loop: the thread beats for it
        assert len(beats) >= 3 and set(beats) == {"convgpu-beat"} and "convgpu-beat" in comms
        time.sleep(0.4)                         # no pass for 0.8 s > hung: no beat at all
        stopped = len(beats)
        time.sleep(0.2)
        assert len(beats) == stopped
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
            "the enforcer's loop has not run for 0.6 s: its heartbeat stops, and BPF admits every "
            "call, unchecked, 2 s later (stalled work must not wait on a hung enforcer)"]
        assert hb.loop_ran() >= 1.0             # the gap since the last pass
        time.sleep(0.25)
        assert len(beats) > stopped             # beating again
    finally:
        hb.stop()
    after = len(beats)
    time.sleep(0.1)
    assert len(beats) == after                  # stopped for good
