"""Line charts in braille: 2 x 4 dots a cell, so an 80-column terminal plots 150+ points.

A pure function from series to Rich Text lines: the widgets call it on resize and on new data,
and tests read its output without an app.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import groupby

from rich.text import Text

# Dot bits of a braille cell: _BITS[column][row], rows counted from the top.
_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


@dataclass(frozen=True)
class Series:
    values: Sequence[float]
    style: str
    peaks: bool = False  # squeeze by max (memory: a peak must show) instead of by mean (loss)


def resample(values: Sequence[float], points: int, reduce: Callable[[Sequence[float]], float]) -> list[float]:
    """`points` values standing for `values` (each the reduce of its slice), or `values` if fewer."""
    n = len(values)
    if n <= points:
        return list(values)
    return [reduce(values[i * n // points : max(i * n // points + 1, (i + 1) * n // points)]) for i in range(points)]


def axis_number(v: float, width: int = 7) -> str:
    """`v` in at most `width` characters, as precise as fits: an axis label is never cut (a cut
    "9.03e-01" reads as 9.03e-0, off by orders of magnitude)."""
    for spec in (".3g", ".2g", ".1g", ".0e"):
        text = f"{v:{spec}}"
        if len(text) <= width:
            return text
    return text


def plot(
    series: Sequence[Series],
    width: int,
    height: int,
    *,
    low: float | None = None,
    high: float | None = None,
    label: Callable[[float], str] | None = None,
    gutter: int = 8,
) -> list[Text]:
    """`height` lines of `width` cells: a y-axis gutter with the top and bottom values, then the plot.

    Later series are drawn over earlier ones (a cell takes the style of the last series with a
    dot in it). Each series is stretched over the full width.
    """
    plot_width = max(1, width - gutter)
    if label is None:
        label = partial(axis_number, width=gutter - 1)
    all_values = [v for s in series for v in s.values]
    if not all_values or height < 1:
        return [Text(" " * width) for _ in range(max(height, 0))]
    low = min(all_values) if low is None else low
    high = max(all_values) if high is None else high
    if high <= low:
        high = low + (abs(low) or 1.0)
    dots_x, dots_y = plot_width * 2, height * 4
    cells = [[0] * plot_width for _ in range(height)]
    styles: list[list[str | None]] = [[None] * plot_width for _ in range(height)]
    for s in series:
        values = resample(s.values, dots_x, reduce=max if s.peaks else _mean)
        if not values:
            continue
        prev_row = None
        span = max(1, len(values) - 1)
        for i, v in enumerate(values):
            x = round(i * (dots_x - 1) / span) if len(values) > 1 else 0
            row = round((high - min(max(v, low), high)) / (high - low) * (dots_y - 1))
            rows = [row] if prev_row is None else range(min(row, prev_row), max(row, prev_row) + 1)
            for r in rows:  # a vertical run joins this point to the previous one
                cy, cx = r // 4, x // 2
                cells[cy][cx] |= _BITS[x % 2][r % 4]
                styles[cy][cx] = s.style
            prev_row = row
    lines = []
    for y in range(height):
        if y == 0:
            axis = label(high)
        elif y == height - 1:
            axis = label(low)
        else:
            axis = ""
        line = Text(axis[: gutter - 1].rjust(gutter - 1) + " " if gutter else "", style="dim")
        # One span per run of cells in one style, not one per cell: rendering cost grows with spans.
        for style, run in groupby(zip(cells[y], styles[y], strict=True), key=lambda cell: cell[1]):
            line.append("".join(chr(0x2800 + bits) if bits else " " for bits, _ in run), style=style or "")
        lines.append(line)
    return lines


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def smooth(values: Sequence[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard smooths its curves)."""
    out, ema = [], 0.0
    for i, v in enumerate(values, 1):
        ema = weight * ema + (1 - weight) * v
        out.append(ema / (1 - weight**i))
    return out
