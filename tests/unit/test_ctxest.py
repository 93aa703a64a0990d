"""enforcer/ctxest.py: which estimate a device's next context is charged (learned median, else
--ctx-overhead if given, else the context measured at start, else the table's hint, else the
conservative 1 GiB) and the state file that keeps what was learned and measured."""
import json
import logging

from convgpu.enforcer import ctxest
from convgpu.enforcer.ctxest import Device, LearnedStore, choose

MiB = 1 << 20
H100 = Device(0, "NVIDIA H100 80GB HBM3", "GPU-5e1d", "580.159.04")


def test_learned_median_comes_first():
    e = choose([530 * MiB, 518 * MiB, 612 * MiB], H100, 0)
    assert (e.bytes, e.source) == (530 * MiB, "learned")
    assert e.detail == "median of 3 measured on GPU-5e1d driver 580.159.04"
    assert choose([518 * MiB, 550 * MiB], H100, 0).bytes == 534 * MiB   # even count: the middle


def test_table_hint_where_nothing_is_measured():
    e = choose([], H100, why="no NVML")
    assert (e.bytes, e.source) == (550 * MiB, "table-hint")
    assert "580.159.04" in e.detail and "FACTS.md" in e.detail and "(no NVML)" in e.detail


def test_a_context_measured_at_start_comes_before_the_table():
    # 518 MiB bare (the H100's and the H200's, FACTS.md) + 1/16 = 550.375 MiB: 552 MiB in 2 MiB pages
    e = choose([], H100, measured=518 * MiB)
    assert (e.bytes, e.source) == (552 * MiB, "measured-at-start")
    assert e.detail == f"a bare context measured {518 * MiB} bytes on NVIDIA H100 80GB HBM3 driver 580.159.04, + 1/16"
    assert choose([530 * MiB], H100, measured=518 * MiB).source == "learned"


def test_nothing_known_is_the_conservative_gigabyte_never_0():
    h200 = Device(1, "NVIDIA H200", "GPU-h2", "580.159.04")
    e = choose([], h200, why="its measurement failed: cuInit returned CUresult 100")
    assert (e.bytes, e.source) == (1024 * MiB, "conservative")
    assert "NVIDIA H200" in e.detail and "cuInit returned CUresult 100" in e.detail and "966 MiB" in e.detail
    assert choose([], Device(3)).bytes == 1024 * MiB


def test_the_table_can_be_emptied_for_tests(monkeypatch):
    monkeypatch.setenv(ctxest.TABLE_ENV, "off")
    assert ctxest.arch_default("NVIDIA H100 80GB HBM3", "580.159.04") is None
    assert choose([], H100).source == "conservative"


def test_the_table_is_keyed_by_name_and_driver_major():
    assert ctxest.arch_default("NVIDIA H100 80GB HBM3", "580.65.06")[0] == 550 * MiB
    assert ctxest.arch_default("NVIDIA H100 PCIe", "580.1") is not None
    assert ctxest.arch_default("NVIDIA H100 80GB HBM3", "570.86.10") is None   # not measured there
    assert ctxest.arch_default("NVIDIA A100-SXM4-80GB", "580.159.04") is None
    assert ctxest.arch_default("NVIDIA H100 80GB HBM3", "") is None


def test_ctx_overhead_given_is_the_operators_word_after_what_was_learned():
    for dev in (Device(1), Device(0, "NVIDIA A100-SXM4-80GB", "GPU-a", "580.159.04"), H100):
        e = choose([], dev, 256 * MiB, measured=518 * MiB)
        assert (e.bytes, e.source) == (256 * MiB, "operator"), dev
    assert choose([], Device(1), 0).bytes == 0
    assert choose([300 * MiB], Device(1), 0).source == "learned"


def test_device_key_is_the_card_and_its_driver():
    assert H100.key == "GPU-5e1d driver 580.159.04"
    assert Device(2, "NVIDIA H100 80GB HBM3", "", "580.159.04").key == "GPU2 NVIDIA H100 80GB HBM3 driver 580.159.04"
    assert Device(0).key == "GPU0"


def test_store_round_trip_keeps_the_last_32(tmp_path):
    s = LearnedStore(str(tmp_path / "state"))      # made at the first save
    for i in range(40):
        s.add(H100.key, (500 + i) * MiB)
    s.save()
    doc = json.loads((tmp_path / "state" / ctxest.STATE_FILE).read_text())
    assert doc["version"] == 1 and len(doc["devices"][H100.key]) == ctxest.KEEP
    again = LearnedStore(str(tmp_path / "state"))
    assert again.get(H100.key) == [(508 + i) * MiB for i in range(32)]
    assert again.get("GPU9") == [] and not again.dirty
    assert choose(again.get(H100.key), H100, 0).bytes == int((523.5) * MiB)


def test_a_measurement_at_start_is_kept_per_model_and_driver(tmp_path):
    s = LearnedStore(str(tmp_path))
    s.set_measured(H100.model_key, 518 * MiB)
    s.save()
    doc = json.loads((tmp_path / ctxest.STATE_FILE).read_text())
    assert doc["measured"] == {"NVIDIA H100 80GB HBM3 driver 580.159.04": 518 * MiB} and doc["devices"] == {}
    other_card = Device(5, "NVIDIA H100 80GB HBM3", "GPU-other", "580.159.04")
    assert LearnedStore(str(tmp_path)).measured_at_start(other_card.model_key) == 518 * MiB
    assert LearnedStore(str(tmp_path)).measured_at_start(Device(5, "NVIDIA H100 80GB HBM3", "", "590.1").model_key) is None


def test_a_corrupt_or_foreign_file_is_one_warning_and_a_fresh_start(tmp_path, caplog):
    path = tmp_path / ctxest.STATE_FILE
    for text in ("{not json", '{"devices": {"GPU0": ["x"]}}', "[1, 2]", '{"devices": {"GPU0": [-5]}}',
                 '{"devices": {}, "measured": {"H100 driver 580": "518"}}', '{"devices": {}, "measured": [1]}'):
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            s = LearnedStore(str(tmp_path))
        assert s.values == {}
        assert len(caplog.records) == 1 and "context estimates start from defaults" in caplog.text, text
        assert "\n" not in caplog.records[0].getMessage()
    s.add("GPU0", 518 * MiB)
    s.save()                                        # replaced by a good one
    assert LearnedStore(str(tmp_path)).get("GPU0") == [518 * MiB]


def test_no_state_dir_keeps_values_in_memory_only(tmp_path):
    s = LearnedStore(None)
    s.add("GPU0", MiB)
    s.save()
    assert s.get("GPU0") == [MiB] and s.path is None


def test_an_unwritable_state_dir_is_a_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    s = LearnedStore(str(tmp_path / "file" / "sub"))
    s.add("GPU0", MiB)
    with caplog.at_level(logging.WARNING):
        s.save()
    assert "cannot save context estimates" in caplog.text and s.get("GPU0") == [MiB]
