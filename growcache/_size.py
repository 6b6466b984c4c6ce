"""Byte sizes written the way people write them: ``"500GB"``, ``"64MiB"``, ``4096``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_MAX_BYTES = 2**63 - 1
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Return ``value`` in bytes. ``"1GB"`` is 10**9 bytes, ``"1GiB"`` is 2**30.

    Raises:
        ValueError: ``value`` is not a positive size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a string like '64MiB', got {value!r}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size: write a byte count or a number with a unit "
                "such as '500GB', '64MiB' or '256MB'"
            )
        number = match.group(1)
        # Whole numbers stay exact integers: through float, "9007199254740993" loses its last digit.
        try:
            nbytes = int(number) * _UNITS[unit] if number.isdigit() else int(float(number) * _UNITS[unit])
        except (OverflowError, ValueError):  # a decimal too large for a float: "1e400" written out
            nbytes = _MAX_BYTES + 1
    else:
        raise ValueError(f"{name} must be an int or a string like '64MiB', got {type(value).__name__}")
    if nbytes <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if nbytes > _MAX_BYTES:  # no file or disk is larger; the cache stores sizes as 64-bit integers
        raise ValueError(f"{name}={value!r} is more than 2**63 - 1 bytes, larger than any disk: check the unit")
    return nbytes


def format_size(nbytes: float) -> str:
    """Return ``nbytes`` as a short human string with decimal units (``"1.5 GB"``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")
