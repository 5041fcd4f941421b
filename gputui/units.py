"""Byte sizes as people write them ("512MiB", "1.5GB", "8g"), and every figure as gputui prints it:
bytes, durations, counts, readings with their unit. One module, so the progress line, the TUI and
`gputui watch` write the same figure the same way; and seconds read from the environment
(`GPUTUI_*_S`), checked one way.

Pure Python so the CLI can validate `--memory-budget` before torch is imported.
"""

from __future__ import annotations

import math
import os
import re
import time

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


def seconds_from_env(name: str, default: float) -> float:
    """Environment variable `name` as a positive number of seconds (`default` where unset or empty);
    ValueError, naming it, for anything else."""
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


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


def format_bytes_short(n: int | float | None) -> str:
    """Binary size for narrow panels: 9.25G, 812M, 12K, 0B."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit, size in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.2f}{unit}" if abs(v) < 10 else f"{v:.1f}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"
    return f"{n:.0f}B"


def format_duration(seconds: float | None) -> str:
    """A clock-like duration: 05:03, 1:02:09, 3d04:05:06 (hours and days only when there are some);
    --:-- if unknown."""
    if seconds is None:
        return "--:--"
    days, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    if days:
        return f"{days}d{h:02d}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


def format_clock(t: float) -> str:
    """A unix time as the local clock shows it (12:03:09); --:--:-- for one no clock can show (a job's
    t of 1e308)."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "--:--:--"


def format_count(n: float) -> str:
    """A large count in a few characters: 812, 12.3k, 124.4M, 1.5B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def counted(n: int, noun: str) -> str:
    """ "1 step", "2 steps", "0 OOMs": a count with its noun, plural unless one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_figure(value: float | None, unit: str, spec: str = "") -> str:
    """A reading with its unit ("61°C", "598 W" with spec ".0f"), or "n/a" where it is unknown
    (NVML would not say, a probe does not read it)."""
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def format_pieces(micro_batch: int, accumulation: int, total: int, *, spaced: bool = False, sums: bool = True) -> str:
    """A global batch as its micro-batches add up: "8x2=16", or with an uneven last piece "39+9=48" and
    "11x5+9=64" (written "39x2=48" it read as a product that does not add up). `spaced`: the TUI's
    "39 + 9 = 48"; `sums` False: without the total (a plan row's label)."""
    times, plus, equals = (" × ", " + ", " = ") if spaced else ("x", "+", "=")
    last = total - micro_batch * (accumulation - 1)
    if accumulation <= 1:
        pieces = f"{total}{times}1"  # one piece: the whole batch, whatever the setting
    elif last == micro_batch:
        pieces = f"{micro_batch}{times}{accumulation}"
    else:
        head = f"{micro_batch}{times}{accumulation - 1}" if accumulation > 2 else str(micro_batch)
        pieces = f"{head}{plus}{last}"
    return f"{pieces}{equals}{total}" if sums else pieces
