import pytest

from convgpu.errors import SizeError
from convgpu.units import format_size, parse_size


@pytest.mark.parametrize("text,expected", [
    ("1GiB", 1 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29), ("1073741824B", 1073741824),
    ("1g", 1 << 30), ("2 MiB", 2 << 20), ("1GB", 10**9), ("4KB", 4000), ("4K", 4096),
    ("0", 0), ("1T", 1 << 40), (" 64mib ", 64 << 20), (1024, 1024), ("1e3B", 1000),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "-1", "1e40", "", "1GiBB", "1 XB", "nan", "inf", "1.2.3", None, "--1"])
def test_parse_size_rejects_with_value_and_fix(text):
    with pytest.raises(SizeError) as e:
        parse_size(text, "--limit")
    msg = str(e.value)
    assert "--limit" in msg and repr(text) in msg
    assert "\n" not in msg and ("512MiB" in msg or "realistic" in msg)


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                    (128 << 20, "128.0 MiB"), (519 << 20, "519.0 MiB"),
                                    (3 << 29, "1.5 GiB"), (None, "-"), (-(1 << 20), "-1.0 MiB")])
def test_format_size(n, text):
    assert format_size(n) == text


@pytest.mark.parametrize("text,meant", [("4", "4GiB"), ("512", "512MiB"), ("1073741824", "1073741824B (1.0 GiB)")])
def test_a_bare_number_is_an_error_naming_what_was_meant(text, meant):
    """Issue 52: `--gpu-memory 4` started with a capacity of 4 bytes. What an operator types
    needs a unit; the error names the likely one. 0 is 0 in any unit; bare=True (a Kubernetes
    quantity, a container's label) reads bytes."""
    with pytest.raises(SizeError) as e:
        parse_size(text, "--gpu-memory")
    assert str(e.value) == (f"--gpu-memory {text!r} has no unit; did you mean {meant}? write the unit: B for "
                            "bytes, or K/M/G/T, KiB/MiB/GiB/TiB, KB/MB/GB/TB")
    assert parse_size(text, bare=True) == int(text) and parse_size("0") == 0
