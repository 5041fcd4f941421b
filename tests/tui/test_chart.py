"""The chart kept between frames draws what a chart drawn from scratch draws: extended by new points,
over a History that halves, resized, rescaled; and a frame with nothing new redraws nothing."""

import math
import random
from functools import partial
from itertools import groupby

import pytest
from rich.console import Console
from rich.style import Style
from rich.text import Text

from gputui.telemetry.history import History
from gputui.tui.chart import GROWTH, Chart, Series, axis_number
from gputui.tui.panels.loss import LossTrend

CONSOLE = Console(width=400)
BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))  # a braille cell's dots: [column][row]


def old_plot(series, width, height, *, low=None, high=None, label=None, gutter=8, capacity=None):
    """The chart as it was drawn from scratch each frame (gputui 0.1's plot(), its resample() written
    out for `capacity`: the points each series' columns are laid out for, its length by default)."""
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
    styles = [[None] * plot_width for _ in range(height)]
    for index, s in enumerate(series):
        n = capacity[index] if capacity else len(s.values)
        if n <= dots_x:  # each point its column, spread over the width
            values = list(s.values)
            xs = [round(i * (dots_x - 1) / (n - 1)) if n > 1 else 0 for i in range(len(values))]
        else:  # each column the max or mean of its slice of `n` points
            reduce = max if s.peaks else (lambda part: sum(part) / len(part))
            parts = [s.values[x * n // dots_x : min(len(s.values), (x + 1) * n // dots_x)] for x in range(dots_x)]
            values = [reduce(part) for part in parts if part]
            xs = list(range(len(values)))
        prev_row = None
        for x, v in zip(xs, values, strict=True):
            row = round((high - min(max(v, low), high)) / (high - low) * (dots_y - 1))
            rows = [row] if prev_row is None else range(min(row, prev_row), max(row, prev_row) + 1)
            for r in rows:
                cy, cx = r // 4, x // 2
                cells[cy][cx] |= BITS[x % 2][r % 4]
                styles[cy][cx] = s.style
            prev_row = row
    lines = []
    for y in range(height):
        axis = label(high) if y == 0 else label(low) if y == height - 1 else ""
        line = Text(axis[: gutter - 1].rjust(gutter - 1) + " " if gutter else "", style="dim")
        for style, run in groupby(zip(cells[y], styles[y], strict=True), key=lambda cell: cell[1]):
            line.append("".join(chr(0x2800 + bits) if bits else " " for bits, _ in run), style=style or "")
        lines.append(line)
    return lines


def cells(line) -> list[tuple[str, Style]]:
    """A line, Text or chart row, as (character, style) per cell: what a terminal shows."""
    runs = CONSOLE.render(line) if isinstance(line, Text) else line
    return [(char, style or Style.null()) for text, style, *_ in runs for char in text if char != "\n"]


def drawn(chart, series, width, height, **scale):
    chart.read(series, width)
    return chart.draw(height, **scale)


def capacities(chart):
    return [line.capacity for line in chart._lines]


def walk(rng, n, start=1.0):
    values, v = [], start
    for _ in range(n):
        v = max(0.0, v + rng.gauss(0, 0.1))
        values.append(v)
    return values


@pytest.mark.parametrize("seed", range(12))
def test_a_chart_drawn_at_once_is_the_chart_drawn_from_scratch(seed):
    rng = random.Random(seed)
    width, height = rng.randint(9, 90), rng.randint(1, 14)
    series = [
        Series(walk(rng, rng.choice([1, 2, 7, 50, 150, 400, 3000])), "dim"),
        Series(walk(rng, rng.choice([1, 3, 90, 200, 4000])), "bold green", peaks=seed % 2 == 0),
    ]
    scale = rng.choice([{}, {"low": 0.0}, {"high": 1.2}, {"low": 0.5, "high": 0.5}])
    rows = drawn(Chart(), series, width, height, **scale)
    assert [cells(row) for row in rows] == [cells(line) for line in old_plot(series, width, height, **scale)]


@pytest.mark.parametrize("seed", range(8))
def test_a_chart_extended_by_new_points_is_the_chart_drawn_from_scratch(seed):
    """Frame by frame, as a screen pulls: the same cells as a chart drawn from scratch with the
    columns laid out for as many points; the rows no new point reached are the same objects."""
    rng = random.Random(seed)
    width, height = rng.randint(12, 70), rng.randint(2, 12)
    loss, peak = History(capacity=256), History(capacity=256, reduce=max)
    chart, step = Chart(), 0
    reused = 0
    for _ in range(60):
        for _ in range(rng.choice([0, 1, 1, 2, 5, 40])):
            step += 1
            loss.add(step, 2 * math.exp(-step / 300) + rng.random() / 10)
            peak.add(step, 1000 + rng.choice([0, 0, 0, 50, 400]))
        series = [Series(peak.values, "yellow", peaks=True), Series(loss.values, "bold blue")]
        before = list(chart.rows)
        scale = {"low": 0.0, "high": 1500.0} if seed % 2 else {}
        rows = list(drawn(chart, series, width, height, **scale))
        expected = old_plot(series, width, height, capacity=capacities(chart), **scale)
        assert [cells(row) for row in rows] == [cells(line) for line in expected]
        reused += sum(a is b for a, b in zip(before, rows, strict=False))
        assert all(a is b for a, b in zip(before, rows, strict=False) if a == b)  # an unchanged row is not made again
    assert reused  # most frames change a few rows
    assert loss.stride > 1  # the history halved on the way: a new list, its columns laid out anew


def test_new_points_fill_the_room_left_then_squeeze_the_series_again():
    values, chart = [], Chart()
    series = [Series(values, "blue")]
    values.extend(range(100))
    drawn(chart, series, 58, 4)
    assert chart.extent == 50  # drawn at once: the whole width
    values.append(100)  # past the right edge: squeezed, with room for an eighth more
    drawn(chart, series, 58, 4)
    assert capacities(chart) == [math.ceil(101 * GROWTH)]
    assert chart.extent < 50
    values.extend(range(101, capacities(chart)[0]))
    drawn(chart, series, 58, 4)
    assert chart.extent == 50 and capacities(chart) == [math.ceil(101 * GROWTH)]


@pytest.mark.parametrize("n", [40, 400])  # a column a point; squeezed
def test_a_series_with_gaps_has_no_dot_where_it_is_nan(n):
    """The eval line: over the loss points' x positions, none before the first evaluation."""
    line = [math.nan] * (n // 2) + [float(i % 3) for i in range(n - n // 2)]
    rows = drawn(Chart(), [Series([float(i) for i in range(n)], "dim"), Series(line, "red", gaps=True)], 58, 4)
    red = {x for row in rows for x, (char, style) in enumerate(cells(row)[8:]) if style.color and char.strip()}
    assert min(red) in (24, 25) and max(red) == 49  # the second half of the 50 cells, whole


def test_a_frame_with_nothing_new_draws_nothing_and_a_point_redraws_its_rows_only():
    values = [math.sin(i / 5) for i in range(40)]
    chart = Chart()
    series = [Series(values, "green")]
    drawn(chart, series, 48, 8, low=-1.0, high=1.0)
    values.append(0.0)  # past the right edge: squeezed, with room for more
    first = list(drawn(chart, series, 48, 8, low=-1.0, high=1.0))
    again = drawn(chart, series, 48, 8, low=-1.0, high=1.0)
    assert all(a is b for a, b in zip(first, again, strict=True))
    values.append(values[-1])  # a point at the last one's height: it changes the rows it is drawn in
    after = drawn(chart, series, 48, 8, low=-1.0, high=1.0)
    assert 0 < sum(a is not b for a, b in zip(first, after, strict=True)) <= 2


def test_the_loss_trend_extended_by_new_points_is_the_trend_of_the_whole_run():
    rng = random.Random(3)
    history, trend = History(capacity=64), LossTrend()
    for step in range(1, 700):
        history.add(step, 3 * math.exp(-step / 100) + rng.random())
        if rng.random() < 0.3:
            continue
        raw = history.values
        trend.read(raw)
        ema, smoothed = 0.0, []
        for i, v in enumerate(raw, 1):
            ema = 0.9 * ema + (1 - 0.9) * v  # as smooth() did
            smoothed.append(ema / (1 - 0.9**i))
        assert trend.smoothed == smoothed
        assert trend.best == min(range(len(raw)), key=raw.__getitem__)
        assert trend.top == (max(raw[len(raw) // 10 :]) if len(raw) >= 20 else None)
