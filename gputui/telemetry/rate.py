"""Steps and samples per second over the last few steps (a window, so a pause or a slow first step
fades out instead of dragging the figure for the whole run).

The hub derives them as it drains the rows the training thread published (telemetry/hub.py), in a
batch: per step, the window's points and tuples cost a millisecond step several microseconds in place
(cold after torch's work), a few hundred nanoseconds warm."""

from __future__ import annotations

from collections import deque
from operator import itemgetter
from typing import Any

from .sample import RATE_FROM, RATES_AT


class Rate:
    def __init__(self, window: int = 32) -> None:
        self._points: deque[tuple[float, int, int]] = deque(maxlen=window)

    def fill(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        """A published row (telemetry/sample.py: StepSample's fields) with its rates over the window, its
        point (time, step, samples) added. One call a row, the point read by one C call: the hub drains
        its rows on the training thread, and each Python call there is a step's cost."""
        points = self._points
        point = _point(row)
        if points and (point[1] < points[-1][1] or point[0] < points[-1][0]):
            points.clear()  # another run's counters (an own loop after fit's), or the clock stepped back
        points.append(point)
        (t0, k0, s0), (t1, k1, s1) = points[0], point
        fields = list(row)
        if t1 > t0:
            fields[RATES_AT[0]], fields[RATES_AT[1]] = (
                (k1 - k0) / (t1 - t0),
                ((s1 - s0) / (t1 - t0) if s1 > s0 else None),
            )
        else:
            fields[RATES_AT[0]] = fields[RATES_AT[1]] = None
        return tuple(fields)

    def clear(self) -> None:
        self._points.clear()


_point = itemgetter(*RATE_FROM)
