"""Human-readable sizes, counts and layer ranges for tables and messages."""

from __future__ import annotations

import pytest

from planner.units import format_bytes, format_ms, name_range, plural, significant


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (int(12.34 * 1024), "12.3 KiB"),
    (int(999.4 * 1024), "999 KiB"), (int(999.6 * 1024), "1000 KiB"), (int(1000.2 * 1024), "1000 KiB"),
    (int(1023.4 * 1024), "1023 KiB"), (int(1023.9 * 1024), "1 MiB"), (1024**2, "1 MiB"),
    (int(1023.9 * 1024**3), "1 TiB"), (5000 * 1024**4, "5000 TiB"), (-2048, "-2 KiB"),
])
def test_format_bytes_never_prints_an_exponent(nbytes: int, text: str) -> None:
    """(A profile table printed "1e+03 KiB" for 1023.9 KiB.)"""
    assert format_bytes(nbytes) == text


def test_format_bytes_has_no_exponent_anywhere_on_a_fine_grid() -> None:
    for exponent in range(0, 50):
        for factor in (0.9995, 0.99999, 1.0, 1.00001):
            assert "e" not in format_bytes(factor * 2.0**exponent * 1000 / 1024)
            assert "e" not in format_bytes(factor * 2.0**exponent)


def test_significant_rounds_to_whole_numbers_from_999_5() -> None:
    assert [significant(v) for v in (0.1234, 12.34, 999.4, 999.5, 1023.9, 52000.0)] == \
        ["0.123", "12.3", "999", "1000", "1024", "52000"]


def test_significant_never_prints_an_exponent_at_any_scale() -> None:
    # an iteration of 12.3 s read "1.235e+04 ms" in the plan table; a PipeDream layer of 20 ns "2e-05"
    assert [significant(v, 4) for v in (12345.6, 1234.56, 0.5, -98765.4)] == ["12346", "1235", "0.5", "-98765"]
    assert [significant(v) for v in (0.0000123, 0.00005, 2.5e-9)] == ["0.0000123", "0.00005", "0.0000000025"]
    assert format_ms(0.00002) == "0.00002" and format_ms(12345.6) == "12345.6"


def test_plural_says_one_in_the_singular() -> None:
    assert (plural(1, "GPU"), plural(2, "GPU"), plural(0, "GPU")) == ("1 GPU", "2 GPUs", "0 GPUs")
    assert (plural(1, "process", "processes"), plural(3, "process", "processes")) == ("1 process", "3 processes")


def test_a_range_of_one_layer_is_its_name() -> None:
    assert name_range("m.layers.0", "m.layers.0") == "m.layers.0"
    assert name_range("m.layers.0", "m.layers.3") == "m.layers.0 .. m.layers.3"
