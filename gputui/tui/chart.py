"""Line charts in braille: 2 x 4 dots a cell, so an 80-column terminal plots 150+ points.

A Chart is kept between frames, so a frame costs the same at step 100 as at step 10^6: it reads
only the points a series gained since the last frame (a History appends to its list until it
starts a new one: a halving, a new run), folds them into the dot columns they fall in, and redraws
the cells from the first column that changed; a whole redraw comes only with a new scale, a new
size, a new list, or points past the right edge. Drawn at once, n points fill the width (each dot
column the max or mean of its slice, as the chart drawn from scratch each frame did); points past
the right edge squeeze the series into 1/GROWTH of the width, which the next points fill column by
column. Tests read its rows without an app.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import groupby

from rich.style import Style

# Dot bits of a braille cell: _BITS[column][row], rows counted from the top.
_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
_CHARS = [" ", *(chr(0x2800 + bits) for bits in range(1, 256))]
GROWTH = 9 / 8
"""Points past the right edge are squeezed into 8/9 of the width: the next eighth of the run extends
the chart column by column before the next squeeze (a whole redraw)."""
DIM = Style.parse("dim")  # the whole chart, the gutter's labels and the lines, is drawn dim

Row = tuple[tuple[str, Style], ...]
"""A chart line as runs of (text, style): cheap to compare, and to make into a terminal line."""


@dataclass(frozen=True)
class Series:
    values: Sequence[float]
    style: str
    peaks: bool = False  # squeeze by max (memory: a peak must show) instead of by mean (loss)
    gaps: bool = False  # NaN is no point (a line over some of the x positions: evaluations); False costs no test


def axis_number(v: float, width: int = 7) -> str:
    """`v` in at most `width` characters, as precise as fits: an axis label is never cut (a cut
    "9.03e-01" reads as 9.03e-0, off by orders of magnitude)."""
    for spec in (".3g", ".2g", ".1g", ".0e"):
        text = f"{v:{spec}}"
        if len(text) <= width:
            return text
    return text


class Reader:
    """Follows a list that only grows by appends until its owner replaces it with another one (a
    History's halving, clear and load each assign a new list): which of its values are new."""

    def __init__(self) -> None:
        self._values: Sequence[float] | None = None
        self._read = 0

    def read(self, values: Sequence[float]) -> int:
        """The index of the first value not read yet; 0 when `values` is not the list read last
        (the reader's owner starts over)."""
        start = self._read if values is self._values and len(values) >= self._read else 0
        self._values, self._read = values, len(values)
        return start


class _Line:
    """One series as dot columns: the points squeezed (by max or mean) into columns that stay where
    they are until the points pass the right edge (`capacity` points fill `dots` columns)."""

    def __init__(self, peaks: bool, gaps: bool) -> None:
        self.peaks, self.gaps = peaks, gaps
        self.reader = Reader()
        self.dots = self.capacity = 0
        self.xs: list[int] = []  # the dot column of each column that has points, left to right
        self.values: list[float] = []  # its points' max or mean
        self.placed: list[int] = []  # its dot row at the chart's scale, top down (placed by `Chart.draw`)
        self.low, self.high = math.inf, -math.inf  # over all points: the default scale

    def read(self, values: Sequence[float], dots: int) -> int | None:
        """Fold the new points in: the first dot column they changed (`dots` if none), or None if
        every column moved (a new list, a new width, points past the right edge)."""
        start, n = self.reader.read(values), len(values)
        moved = not (start and dots == self.dots and n <= self.capacity)
        if moved:  # drawn anew: a new list fills the width; points past the edge leave room for more
            self.capacity = n if not start or dots != self.dots else math.ceil(n * GROWTH)
            self.dots, self.low, self.high, start = dots, math.inf, -math.inf, 0
        elif start == n:
            return dots
        new = values[start:]
        if self.gaps:
            new = [v for v in new if not math.isnan(v)]
        if new:
            self.low, self.high = min(self.low, min(new)), max(self.high, max(new))
        first = self.column(start)
        keep = bisect_left(self.xs, first)  # the columns the new points fall in are made anew
        del self.xs[keep:], self.values[keep:], self.placed[keep:]
        if self.capacity <= dots:  # a column a point
            points = range(start, n) if not self.gaps else [i for i in range(start, n) if not math.isnan(values[i])]
            self.xs.extend(self.column(i) for i in points)
            self.values.extend(new)
        else:  # each column the max or mean of its slice, as C loops over it
            capacity = self.capacity
            for x in range(first, self.column(n - 1) + 1):
                part = values[x * capacity // dots : min(n, (x + 1) * capacity // dots)]
                if self.gaps:
                    part = [v for v in part if not math.isnan(v)]
                    if not part:
                        continue
                self.xs.append(x)
                self.values.append(max(part) if self.peaks else sum(part) / len(part))
        return None if moved else first

    def column(self, i: int) -> int:
        """The dot column of point `i`: spread over the width (fewer points than dots), or the
        column of the slice [x * capacity // dots, (x + 1) * capacity // dots) it is in."""
        n, dots = self.capacity, self.dots
        if n <= dots:
            return round(i * (dots - 1) / (n - 1)) if n > 1 else 0
        return ((i + 1) * dots - 1) // n


class Chart:
    """A line chart of a few series: `read()` their new points, then `draw()` its rows, each the same
    object as the frame before where nothing in it changed. Later series are drawn over earlier ones
    (a cell takes the style of the last series with a dot in it); each is stretched over the width."""

    def __init__(self, gutter: int = 8, label: Callable[[float], str] | None = None) -> None:
        self.gutter = gutter
        self.label = label or partial(axis_number, width=gutter - 1)
        self._lines: list[_Line] = []
        self._kinds: list[tuple[bool, bool, str]] = []  # each series' (peaks, gaps, style): others, other lines
        self._styles: list[Style] = []
        self._width = 0
        self._scale: tuple[int, float, float] | None = None  # height, low, high as last drawn; None: none
        self._redraw = 0  # the first cell column whose dots changed since the last draw
        self._cells: list[list[int]] = []
        self._cell_styles: list[list[Style | None]] = []
        self.rows: list[Row] = []

    def read(self, series: Sequence[Series], width: int) -> None:
        """Fold the series' new points in (all of them, the first time or after the list changed)."""
        plot_width = max(1, width - self.gutter)
        kinds = [(s.peaks, s.gaps, s.style) for s in series]
        if width != self._width or kinds != self._kinds:
            self._width, self._kinds, self._scale = width, kinds, None
            self._lines = [_Line(s.peaks, s.gaps) for s in series]
            self._styles = [DIM + Style.parse(s.style) for s in series]
        for line, s in zip(self._lines, series, strict=True):
            x = line.read(s.values, plot_width * 2)
            self._redraw = min(self._redraw, 0 if x is None else x // 2)

    def restart(self) -> None:
        """Forget what was read: the next read() takes every point anew and fills the width, as a chart
        drawn at once does (a run that ended is shown whole, not squeezed to make room for more)."""
        self._width = 0

    def span(self, index: int) -> tuple[float, float]:
        """The lowest and highest point of series `index` (inf, -inf before it has one)."""
        return self._lines[index].low, self._lines[index].high

    @property
    def extent(self) -> int:
        """How many cells of the plot the series reach, from the left."""
        return max((line.xs[-1] // 2 + 1 for line in self._lines if line.xs), default=0)

    def draw(self, height: int, *, low: float | None = None, high: float | None = None) -> list[Row]:
        """`height` rows of the width read: a y-axis gutter with the top and bottom values, then the
        plot. `low`, `high`: the scale, by default the series' lowest and highest points."""
        plot_width = max(1, self._width - self.gutter)
        if not any(line.xs for line in self._lines) or height < 1:
            self._scale = None
            return [((" " * self._width, Style.null()),)] * max(height, 0)
        low = min(line.low for line in self._lines) if low is None else low
        high = max(line.high for line in self._lines) if high is None else high
        if high <= low:
            high = low + (abs(low) or 1.0)
            if math.isinf(high):  # a flat line near the largest float
                low, high = low / 2, low
        start, self._redraw = self._redraw, plot_width
        before_rows = self.rows
        if (height, low, high) != self._scale:  # every dot moves
            self._scale, start = (height, low, high), 0
            self._cells = [[0] * plot_width for _ in range(height)]
            self._cell_styles = [[None] * plot_width for _ in range(height)]
            self.rows = [()] * height
            for line in self._lines:
                line.placed.clear()
        elif start >= plot_width:
            return self.rows
        cells, styles = self._cells, self._cell_styles
        before = [(c[start:], s[start:]) for c, s in zip(cells, styles, strict=True)]
        for c, s in zip(cells, styles, strict=True):
            c[start:] = [0] * (plot_width - start)
            s[start:] = [None] * (plot_width - start)
        dots_y = height * 4
        top, span = high / 2, high / 2 - low / 2  # in halves (exact): high - low overflows for 1e308 and -1e308
        for line, line_style in zip(self._lines, self._styles, strict=True):
            dots = line.placed
            for v in line.values[len(dots) :]:  # the columns not yet placed at this scale
                dots.append(round((top - min(max(v, low), high) / 2) / span * (dots_y - 1)))
            for k in range(bisect_left(line.xs, 2 * start), len(dots)):
                x, dot = line.xs[k], dots[k]
                prev = dots[k - 1] if k else dot
                bits, cx = _BITS[x % 2], x // 2
                for r in range(min(dot, prev), max(dot, prev) + 1):  # a vertical run joins it to the previous point
                    cells[r // 4][cx] |= bits[r % 4]
                    styles[r // 4][cx] = line_style
        for y in range(height):
            if self.rows[y] and before[y] == (cells[y][start:], styles[y][start:]):
                continue
            axis = self.label(high) if y == 0 else self.label(low) if y == height - 1 else ""
            runs = [(axis[: self.gutter - 1].rjust(self.gutter - 1) + " ", DIM)] if self.gutter else []
            # One run per stretch of cells in one style, not one per cell: a terminal line's cost grows with runs.
            for style, run in groupby(zip(cells[y], styles[y], strict=True), key=lambda cell: cell[1]):
                runs.append(("".join(_CHARS[bits] for bits, _ in run), style or DIM))
            made = tuple(runs)
            self.rows[y] = before_rows[y] if y < len(before_rows) and before_rows[y] == made else made
        return self.rows
