"""Issue 18: what a shim process is told of a GPU's memory (enforcer/serving/memview.py) and which
per-context figure that view leaves for a context NVML has not measured (ctxest.ceiling)."""
from convgpu.enforcer import ctxest
from convgpu.enforcer.ctxest import Device, Estimate, ceiling, choose
from convgpu.enforcer.serving.memview import ProcContexts, context_figure, view

MiB, GiB = 1 << 20, 1 << 30
PAGE = 2 * MiB
H100 = Device(0, "NVIDIA H100 80GB HBM3", "GPU-5e1d", "580.159.04")


def test_h100_ceiling_is_the_pytorch_context_plus_an_eighth():
    # nothing measured: estimate 550 MiB (architecture), largest measured 612 MiB (PyTorch with
    # cuBLAS); 612 + 76.5 = 688.5 MiB, rounded up to 2 MiB pages: 690 MiB
    c = ceiling(H100, choose(H100), PAGE)
    assert (c.bytes, c.source) == (690 * MiB, "architecture top")


def test_a_context_measured_at_start_leaves_room_for_pytorch_with_cublas():
    # a model the table lacks (the H200): the bare 518 MiB measured at start is charged 552 MiB,
    # and the ceiling 552 + 69 = 621 MiB (622 in pages) covers PyTorch with cuBLAS (612 MiB on the H100)
    h200 = Device(0, "NVIDIA H200", "GPU-h2", "580.159.04")
    c = ceiling(h200, choose(h200, measured=518 * MiB), PAGE)
    assert (c.bytes, c.source) == (622 * MiB, "estimate") and c.bytes >= 612 * MiB
    # nothing known: the conservative gigabyte + 1/8
    assert ceiling(h200, choose(h200), PAGE).bytes == 1152 * MiB


def test_ctx_overhead_alone_is_taken_as_given():
    est = choose(Device(0), 64 * MiB)
    assert ceiling(Device(0), est, PAGE) == Estimate(64 * MiB, "operator",
                                                     "--ctx-overhead (no margin: the operator's figure)")
    assert ceiling(Device(0), choose(Device(0), 0), PAGE).bytes == 0


def test_ceiling_is_never_below_the_estimate():
    for measured in (None, 300 * MiB, 900 * MiB):
        for dev in (H100, Device(0)):
            est = choose(dev, measured=measured)
            assert ceiling(dev, est, PAGE).bytes >= est.bytes
    assert ctxest.arch_top("NVIDIA A100-SXM4-80GB", "580.159.04") is None


def test_total_is_the_limit_less_the_own_context_free_leaves_room_for_it():
    ceil = 135 * MiB
    # unmeasured: the ceiling; a process with no context yet counts the one it needs
    assert view(GiB, 0, {7: ProcContexts(1)}, 7, ceil) == (GiB - ceil, 0)
    assert view(GiB, 0, {}, 7, ceil) == (GiB - ceil, 0)
    # measured: NVML's figure; the total read before is not larger than the one after
    assert view(GiB, 0, {7: ProcContexts(1, (128 * MiB, 1))}, 7, ceil) == (GiB - 128 * MiB, 0)
    # a second context made after the measurement counts the ceiling
    assert context_figure(ProcContexts(2, (128 * MiB, 1)), ceil) == 128 * MiB + ceil


def test_used_is_the_bytes_and_the_other_processes_contexts():
    ceil = 135 * MiB
    procs = {7: ProcContexts(1, (128 * MiB, 1)), 8: ProcContexts(1), 9: ProcContexts(0)}
    total, used = view(GiB, 600 * MiB, procs, 8, ceil)
    assert (total, used) == (GiB - ceil, 600 * MiB + 128 * MiB)
    # whoever takes all of the free still fits, with its context at up to the ceiling
    assert used + (total - used) + ceil == GiB
    # used never above the total (free is then 0), never below 0
    assert view(GiB, 2 * GiB, procs, 8, ceil) == (GiB - ceil, GiB - ceil)
    assert view(GiB, -5, {}, 8, ceil) == (GiB - ceil, 0)
    assert view(100 * MiB, 0, {}, 8, ceil) == (0, 0)
