"""Human-readable sizes and times for tables and messages."""

from __future__ import annotations

import math

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units with 3 significant digits, never in exponent notation: 1536 -> '1.5 KiB',
    1023.9 KiB -> '1 MiB' (what rounds to 1024 of a unit is the next unit), 1000.2 KiB -> '1000 KiB'."""
    value = float(nbytes)
    for unit in _BYTE_UNITS:
        last = unit == _BYTE_UNITS[-1]
        if unit == "B" and abs(value) < 1024:
            return f"{int(value)} B"
        if unit != "B" and (round(abs(value)) < 1024 or last):
            return f"{significant(value)} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def significant(value: float, digits: int = 3) -> str:
    """`digits` significant digits without exponent notation: at 3, 0.123, 12.3, 999, and whole numbers from
    999.5 on (1000, 1023, 52000); at 4, 12345.6 -> '12346'; below 1e-4, positional ('0.0000123')."""
    if round(abs(value)) >= 10**digits:
        return f"{value:.0f}"
    if value and abs(value) < 1e-4:
        return _positional(value, digits)
    return f"{value:.{digits}g}"


def _positional(value: float, digits: int) -> str:
    """`value` (below 1e-4) with `digits` significant digits in positional notation, trailing zeros dropped."""
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".")


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """'1 GPU', '2 GPUs': `count` and its noun; `nouns` where the plural is not noun + 's' ('processes')."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def format_ms(milliseconds: float) -> str:
    """Milliseconds, readable at every scale: 0.0123, 1.23, 12.3, 1234.5."""
    if milliseconds == 0:
        return "0"
    if milliseconds < 0.1:
        return significant(milliseconds)
    return f"{milliseconds:.2f}" if milliseconds < 10 else f"{milliseconds:.1f}"


_SIZE_FACTORS = {
    "": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BIT_FACTORS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def _split_number(text: str) -> tuple[float, str]:
    """'300GB/s' -> (300.0, 'GB/s'); ValueError if it does not start with a number."""
    stripped = text.strip()
    end = 0
    while end < len(stripped) and (stripped[end].isdigit() or stripped[end] in ".eE+-"):
        end += 1
    # a trailing 'e', 'E', '+' or '-' is not part of the number
    while end > 0 and stripped[end - 1] in "eE+-":
        end -= 1
    number = float(stripped[:end])  # raises ValueError when there is no number
    return number, stripped[end:].strip()


def parse_bytes(text: str) -> int:
    """A size such as '80GB' (10^9), '80GiB' (2^30), '512MB' or plain '1000' bytes, as int bytes.

    ValueError (with the accepted forms) if it cannot be read or is not positive.
    """
    try:
        number, unit = _split_number(text)
        factor = _SIZE_FACTORS[unit.lower()]
    except (ValueError, KeyError):
        raise ValueError(f"cannot read size {text!r}; use e.g. 80GB, 40GiB, 512MB or a number of bytes") from None
    if not number > 0 or number == float("inf"):
        raise ValueError(f"size {text!r} must be positive")
    if number * factor < 1:
        raise ValueError(f"size {text!r} is less than one byte")
    return int(number * factor)


def parse_bandwidth(text: str) -> float:
    """A bandwidth such as '300GB/s', '25Gbit/s', '100Gb/s' (bits) or plain '1e9' bytes/s, in bytes/s.

    Byte units: B/s, KB/s, MB/s, GB/s, TB/s (powers of 10), KiB/s ... TiB/s and GBps; bit units:
    bit/s, Kbit/s ... Tbit/s, Kb/s ... Tb/s (lower-case b) and Gbps, divided by 8.
    """
    try:
        number, unit = _split_number(text)
        if unit.lower().endswith("/s"):
            unit = unit[:-2]
        elif unit.endswith("bps"):  # Gbps = Gbit/s
            unit = unit[:-3] + "bit"
        elif unit.endswith("Bps"):  # GBps = GB/s
            unit = unit[:-2]
        bits = unit.lower().endswith("bit") or (unit.endswith("b") and unit not in ("", "b"))
        if bits:
            factor = _BIT_FACTORS[unit.lower()] / 8
        else:
            factor = _SIZE_FACTORS[unit.lower()]
    except (ValueError, KeyError):
        raise ValueError(
            f"cannot read bandwidth {text!r}; use e.g. 300GB/s, 25Gbit/s, 100Gb/s or a number of bytes/s"
        ) from None
    if not number > 0 or number == float("inf"):
        raise ValueError(f"bandwidth {text!r} must be positive")
    return number * factor


_TIME_FACTORS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_seconds(text: str) -> float:
    """A duration such as '20us', '0.5ms', '1e-5s' or plain '1e-5' (seconds), in seconds; 0 allowed.

    ValueError (with the accepted forms) if it cannot be read or is negative.
    """
    try:
        number, unit = _split_number(text)
        factor = _TIME_FACTORS[unit.lower()]
    except (ValueError, KeyError):
        raise ValueError(f"cannot read duration {text!r}; use e.g. 20us, 0.5ms or a number of seconds") from None
    if not number >= 0 or number == float("inf"):
        raise ValueError(f"duration {text!r} must be 0 or more")
    return number * factor


def name_range(first: str, last: str) -> str:
    """A range of layers by name: 'h.0 .. h.7', or just 'h.0' for a range of one."""
    return first if first == last else f"{first} .. {last}"
