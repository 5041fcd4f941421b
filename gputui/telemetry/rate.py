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

    def fill(self, row: list[Any]) -> list[Any]:
        """A published row (telemetry/sample.py: StepSample's fields, its rates None) with its rates over the
        window filled in, in place, its point (time, step, samples) added. One call a row, no Python call
        inside: the hub drains its rows on the training thread, and each call there is a step's cost."""
        points = self._points
        t1, k1, s1 = point = _point(row)
        if points:
            last = points[-1]
            if k1 < last[1] or t1 < last[0]:
                points.clear()  # another run's counters (an own loop after fit's), or the clock stepped back
        points.append(point)
        t0, k0, s0 = points[0]
        if t1 > t0:
            dt = t1 - t0
            row[_STEPS] = (k1 - k0) / dt
            if s1 > s0:
                row[_SAMPLES] = (s1 - s0) / dt
        return row

    def clear(self) -> None:
        self._points.clear()


_point = itemgetter(*RATE_FROM)
_STEPS, _SAMPLES = RATES_AT
