"""Human-readable sizes and times for tables and messages."""

from __future__ import annotations

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units with 3 significant digits: 1536 -> '1.50 KiB'."""
    value = float(nbytes)
    for unit in _BYTE_UNITS:
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_ms(milliseconds: float) -> str:
    """Milliseconds with 3 significant digits (at least 2 decimals below 10 ms)."""
    return f"{milliseconds:.2f}" if milliseconds < 10 else f"{milliseconds:.1f}"
