"""Byte sizes as people write them ("512MiB", "1.5GB", "8g") and as the panels print them.

Pure Python so the CLI can validate `--memory-budget` before torch is imported.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string like "512MiB", "1.5GB" or "8g" (a bare letter is binary).

    Raises ValueError with a message fit for a one-line CLI error.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"a size must be positive, got {value!r}")
        return int(value)
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {value!r} (try 512MiB, 1.5GB or 8GiB)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return size


def format_bytes(n: int | float | None, *, missing: str = "n/a") -> str:
    """Binary units with three significant figures: 0 B, 812 B, 1.50 KiB, 23.4 MiB, 79.6 GiB."""
    if n is None:
        return missing
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    if unit == "B":
        return f"{sign}{int(n)} B"
    digits = 2 if n < 10 else 1 if n < 100 else 0
    return f"{sign}{n:.{digits}f} {unit}"
