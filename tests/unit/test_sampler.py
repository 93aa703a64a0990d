"""probes.nvml.Sampler: each process's memory beyond what the probes track, with NVML and the
probes read around each sample, and the transients that read high (an allocation the driver
shows before it returns, a free settled at its entry but still in the driver) filtered out. No NVML, no thread: the
sample() the thread runs, on scripted reads."""
from convgpu.probes.nvml import Sampler

MiB = 1 << 20
K = (100, 0)


class Script:
    """nvml.process_memory() and tracked() answering from lists, one read each call."""
    def __init__(self, nvml, tracked):
        self.nvml, self.tracked = list(nvml), list(tracked)

    def process_memory(self):
        return self.nvml.pop(0)

    def track(self):
        return self.tracked.pop(0)


def sampler(nvml, tracked, busy=None, contexts=False):
    s = Script(nvml, tracked)
    busy = list(busy or [])
    return Sampler(s, 1.0, s.track, lambda: busy.pop(0) if busy else set(), contexts=contexts)


def test_excess_is_nvml_less_tracked_read_together():
    s = sampler([{K: 4600 * MiB}], [{K: 4096 * MiB}, {K: 4096 * MiB}])
    assert s.sample() == {K: 504 * MiB}


def test_a_free_still_in_the_driver_reads_high_once_and_is_filtered():
    # sample 1: steady (context 519 MiB); sample 2: the probes settled a 4 GiB free at its
    # entry, the driver still holds it; sample 3: steady again
    s = sampler([{K: 4615 * MiB}, {K: 4615 * MiB}, {K: 519 * MiB}],
                [{K: 4096 * MiB}] * 2 + [{K: 0}] * 4)
    assert s.sample() == {K: 519 * MiB}
    assert s.sample() == {K: 519 * MiB}          # min(4615, 519): not 4.5 GiB of "context"
    assert s.sample() == {K: 519 * MiB}


def test_a_real_rise_shows_one_sample_later():
    s = sampler([{K: 519 * MiB}, {K: 1031 * MiB}, {K: 1031 * MiB}], [{K: 0}] * 6)
    assert [s.sample()[K] for _ in range(3)] == [519 * MiB, 519 * MiB, 1031 * MiB]


def test_a_process_whose_bytes_moved_during_the_sample_keeps_its_last_value():
    s = sampler([{K: 519 * MiB}, {K: 2567 * MiB}, {K: 2567 * MiB}],
                [{K: 0}, {K: 0}, {K: 0}, {K: 2048 * MiB}, {K: 2048 * MiB}, {K: 2048 * MiB}])
    assert s.sample() == {K: 519 * MiB}
    assert s.sample() == {K: 519 * MiB}          # an allocation returned during it: not 2567
    assert s.sample() == {K: 519 * MiB}


def test_moving_with_nothing_before_is_left_out_and_gone_processes_are_forgotten():
    s = sampler([{K: 600 * MiB}, {}, {K: 700 * MiB}], [{K: 0}, {K: MiB}, {}, {}, {K: 0}, {K: 0}])
    assert s.sample() == {}
    assert s.sample() == {}
    assert s.sample() == {K: 700 * MiB}          # no memory of before it left NVML's list


def test_a_call_in_flight_keeps_the_last_value_even_with_no_bytes_moved():
    # a new process's first sample lands inside its 3 GiB allocation: NVML shows it, the
    # probes settle it at the return: left out, not 3.5 GiB of context
    s = sampler([{K: 3591 * MiB}, {K: 3591 * MiB}], [{K: 0}] * 2 + [{K: 3072 * MiB}] * 2,
                busy=[{100}, set(), set(), set()])
    assert s.sample() == {}
    assert s.sample() == {K: 519 * MiB}


def test_moving_after_a_transient_gives_out_the_filtered_value():
    s = sampler([{K: 519 * MiB}, {K: 4615 * MiB}, {K: 4615 * MiB}],
                [{K: 0}, {K: 0}, {K: 0}, {K: 0}, {K: 0}, {K: 4096 * MiB}])
    assert s.sample() == {K: 519 * MiB}
    assert s.sample() == {K: 519 * MiB}          # the free still in the driver: filtered
    assert s.sample() == {K: 519 * MiB}          # moving: what was given out, not the raw 4615


def test_a_value_read_high_twice_is_undone_by_the_next_steady_read():
    # two samples in a row catch frees the driver still counts (a periodic job, idle only right
    # after its frees): 3.5 GiB goes out; the next steady read takes it back at once. A waiter
    # the enforcer holds at a call's entry is read like this too (not "in flight"), so such a
    # value cannot keep it stalled.
    s = sampler([{K: 3600 * MiB}, {K: 3600 * MiB}, {K: 519 * MiB}], [{K: 0}] * 6)
    assert s.sample() == {K: 3600 * MiB}
    assert s.sample() == {K: 3600 * MiB}
    assert s.sample() == {K: 519 * MiB}


def test_with_contexts_each_value_says_how_many_contexts_it_measured():
    """tracked() as (bytes, contexts): the excess over the bytes, with the contexts it covers."""
    s = sampler([{K: 4600 * MiB, (7, 0): 500 * MiB}, {K: 4610 * MiB}], [{K: (4096 * MiB, 1)}] * 4, contexts=True)
    assert s.sample() == {K: (504 * MiB, 1), (7, 0): (500 * MiB, 0)}   # 7: never seen by the probes
    assert s.sample() == {K: (504 * MiB, 1)}       # the smaller of two: a rise shows next time


def test_with_contexts_a_new_context_moves_and_then_is_not_mixed_with_the_old_reading():
    s = sampler([{K: 600 * MiB}, {K: 1100 * MiB}, {K: 1100 * MiB}],
                [{K: (0, 1)}, {K: (0, 1)}, {K: (0, 1)}, {K: (0, 2)}, {K: (0, 2)}, {K: (0, 2)}], contexts=True)
    assert s.sample() == {K: (600 * MiB, 1)}
    assert s.sample() == {K: (600 * MiB, 1)}       # contexts changed during the sample: kept
    assert s.sample() == {K: (1100 * MiB, 2)}      # not min(600, 1100): 600 was one context


# ---- Nvml.process_memory: NVML's lists as one figure a process and GPU (issue 47) ----

class Lists:
    """The part of pynvml that process_memory reads: per GPU, its compute and graphics rows
    (pid, bytes); graphics None: NotSupported, as on datacenter cards."""
    class NVMLError(Exception):
        pass

    def __init__(self, gpus):
        self.gpus = gpus

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        from types import SimpleNamespace
        return SimpleNamespace(total=80 << 30, used=0)

    def _rows(self, rows):
        from types import SimpleNamespace
        return [SimpleNamespace(pid=pid, usedGpuMemory=n) for pid, n in rows]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._rows(self.gpus[h][0])

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        if self.gpus[h][1] is None:
            raise self.NVMLError("Not Supported")
        return self._rows(self.gpus[h][1])


def nvml_over(gpus):
    from convgpu.probes.nvml import Nvml
    nv = Nvml.__new__(Nvml)
    nv.ok, nv.error, nv._n, nv.driver, nv.compute = True, "", Lists(gpus), "580.159.04", set()
    return nv


def test_two_compute_rows_of_one_process_are_summed():
    """Two copies of the driver in one process are two clients of it, listed apart: 200 + 200
    MiB is 400 MiB (max() made it 200, and the backstop let 400 MiB pass a 300 MiB limit)."""
    nv = nvml_over([([(7, 200 * MiB), (7, 200 * MiB), (8, 64 * MiB)], None),
                    ([(7, 5 * MiB), (9, 1 << 63)], None)])          # N/A: left out
    assert nv.process_memory() == {(7, 0): 400 * MiB, (8, 0): 64 * MiB, (7, 1): 5 * MiB}
    assert nv.compute == {7, 8, 9}


def test_graphics_rows_count_beside_compute_rows_never_on_top_of_them():
    """A process in both lists is one process: the larger of its compute sum and its graphics
    sum. One only in the graphics list counts its graphics rows (summed too)."""
    nv = nvml_over([([(7, 100 * MiB), (7, 50 * MiB), (8, 300 * MiB)],
                     [(7, 120 * MiB), (8, 300 * MiB), (9, 70 * MiB), (9, 5 * MiB)])])
    assert nv.process_memory() == {(7, 0): 150 * MiB, (8, 0): 300 * MiB, (9, 0): 75 * MiB}
    assert nv.compute == {7, 8}
    nv = nvml_over([([(7, 100 * MiB)], [(7, 60 * MiB), (7, 60 * MiB)])])
    assert nv.process_memory() == {(7, 0): 120 * MiB}
