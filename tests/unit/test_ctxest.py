"""enforcer/ctxest.py: which estimate a device's next context is charged (--ctx-overhead if given,
else the context measured at start, else the table's hint, else the conservative 1 GiB) and the
state file that keeps what was measured. Nothing a tenant's process does moves it (issue 39)."""
import json
import logging

from convgpu.enforcer import ctxest
from convgpu.enforcer.ctxest import Device, MeasuredStore, choose

MiB = 1 << 20
H100 = Device(0, "NVIDIA H100 80GB HBM3", "GPU-5e1d", "580.159.04")


def test_table_hint_where_nothing_is_measured():
    e = choose(H100, why="no NVML")
    assert (e.bytes, e.source) == (550 * MiB, "table-hint")
    assert "580.159.04" in e.detail and "docs/gpu-runs/2026-11-23" in e.detail and "(no NVML)" in e.detail


def test_a_context_measured_at_start_comes_before_the_table():
    # 518 MiB bare (the H100's and the H200's, FACTS.md) + 1/16 = 550.375 MiB: 552 MiB in 2 MiB pages
    e = choose(H100, measured=518 * MiB)
    assert (e.bytes, e.source) == (552 * MiB, "measured-at-start")
    assert e.detail == f"a bare context measured {518 * MiB} bytes on NVIDIA H100 80GB HBM3 driver 580.159.04, + 1/16"


def test_nothing_known_is_the_conservative_gigabyte_never_0():
    h200 = Device(1, "NVIDIA H200", "GPU-h2", "580.159.04")
    e = choose(h200, why="its measurement failed: cuInit returned CUresult 100")
    assert (e.bytes, e.source) == (1024 * MiB, "conservative")
    assert "NVIDIA H200" in e.detail and "cuInit returned CUresult 100" in e.detail and "966 MiB" in e.detail
    assert choose(Device(3)).bytes == 1024 * MiB


def test_the_table_can_be_emptied_for_tests(monkeypatch):
    monkeypatch.setenv(ctxest.TABLE_ENV, "off")
    assert ctxest.arch_default("NVIDIA H100 80GB HBM3", "580.159.04") is None
    assert choose(H100).source == "conservative"


def test_the_table_is_keyed_by_name_and_driver_major():
    assert ctxest.arch_default("NVIDIA H100 80GB HBM3", "580.65.06")[0] == 550 * MiB
    assert ctxest.arch_default("NVIDIA H100 PCIe", "580.1") is not None
    assert ctxest.arch_default("NVIDIA H100 80GB HBM3", "570.86.10") is None   # not measured there
    assert ctxest.arch_default("NVIDIA A100-SXM4-80GB", "580.159.04") is None
    assert ctxest.arch_default("NVIDIA H100 80GB HBM3", "") is None


def test_ctx_overhead_given_is_the_operators_word():
    for dev in (Device(1), Device(0, "NVIDIA A100-SXM4-80GB", "GPU-a", "580.159.04"), H100):
        e = choose(dev, 256 * MiB, measured=518 * MiB)
        assert (e.bytes, e.source) == (256 * MiB, "operator"), dev
    assert choose(Device(1), 0).bytes == 0


def test_device_key_is_the_card_and_its_driver():
    assert H100.key == "GPU-5e1d driver 580.159.04"
    assert Device(2, "NVIDIA H100 80GB HBM3", "", "580.159.04").key == "GPU2 NVIDIA H100 80GB HBM3 driver 580.159.04"
    assert Device(0).key == "GPU0"


def test_figures_learned_from_tenants_in_an_old_file_are_not_used(tmp_path, caplog):
    """Issue 39 part 3: a version-1 file's per-device medians came from tenants' processes (one
    graph node of 2.5 GiB made every context 1.5 GiB); they are read past and written out."""
    path = tmp_path / ctxest.STATE_FILE
    path.write_text(json.dumps({"version": 1, "devices": {H100.key: [518 * MiB, 2566 * MiB]},
                                "measured": {H100.model_key: 518 * MiB}}))
    with caplog.at_level(logging.INFO, logger="convgpu"):
        s = MeasuredStore(str(tmp_path))
    assert s.measured_at_start(H100.model_key) == 518 * MiB and "not used" in caplog.text
    s.save()
    assert json.loads(path.read_text()) == {"version": 2, "measured": {H100.model_key: 518 * MiB}}


def test_a_measurement_at_start_is_kept_per_model_and_driver(tmp_path):
    s = MeasuredStore(str(tmp_path))
    s.set_measured(H100.model_key, 518 * MiB)
    s.save()
    doc = json.loads((tmp_path / ctxest.STATE_FILE).read_text())
    assert doc == {"version": 2, "measured": {"NVIDIA H100 80GB HBM3 driver 580.159.04": 518 * MiB}}
    other_card = Device(5, "NVIDIA H100 80GB HBM3", "GPU-other", "580.159.04")
    assert MeasuredStore(str(tmp_path)).measured_at_start(other_card.model_key) == 518 * MiB
    assert MeasuredStore(str(tmp_path)).measured_at_start(Device(5, "NVIDIA H100 80GB HBM3", "", "590.1").model_key) is None


def test_a_corrupt_or_foreign_file_is_one_warning_and_a_fresh_start(tmp_path, caplog):
    path = tmp_path / ctxest.STATE_FILE
    for text in ("{not json", "[1, 2]", '{"measured": {"H100 driver 580": -5}}',
                 '{"devices": {}, "measured": {"H100 driver 580": "518"}}', '{"devices": {}, "measured": [1]}'):
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            s = MeasuredStore(str(tmp_path))
        assert s.measured == {}
        assert len(caplog.records) == 1 and "context estimates start from defaults" in caplog.text, text
        assert "\n" not in caplog.records[0].getMessage()
    s.set_measured("GPU0", 518 * MiB)
    s.save()                                        # replaced by a good one
    assert MeasuredStore(str(tmp_path)).measured_at_start("GPU0") == 518 * MiB


def test_no_state_dir_keeps_values_in_memory_only(tmp_path):
    s = MeasuredStore(None)
    s.set_measured("GPU0", MiB)
    s.save()
    assert s.measured_at_start("GPU0") == MiB and s.path is None


def test_an_unwritable_state_dir_is_a_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    s = MeasuredStore(str(tmp_path / "file" / "sub"))
    s.set_measured("GPU0", MiB)
    with caplog.at_level(logging.WARNING):
        s.save()
    assert "cannot save context estimates" in caplog.text and s.measured_at_start("GPU0") == MiB
