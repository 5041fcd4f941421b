"""Steps and samples per second over the last few steps (a window, so a pause or a slow first step
fades out instead of dragging the figure for the whole run).

The hub derives them as it drains the rows the training thread published (telemetry/hub.py), in a
batch: per step, the window's points and tuples cost a millisecond step several microseconds in place
(cold after torch's work), a few hundred nanoseconds warm."""

from __future__ import annotations

from collections import deque
from typing import Any

from .sample import RATE_FROM, RATES_AT


class Rate:
    def __init__(self, window: int = 32) -> None:
        self._points: deque[tuple[float, int, int]] = deque(maxlen=window)

    def add(self, t: float, steps: int, samples: int) -> tuple[float | None, float | None]:
        """Record the counters at time `t`; returns (steps per second, samples per second)."""
        points = self._points
        if points and (steps < points[-1][1] or t < points[-1][0]):
            points.clear()  # another run's counters (an own loop after fit's), or the clock stepped back
        points.append((t, steps, samples))
        (t0, k0, s0), (t1, k1, s1) = self._points[0], self._points[-1]
        if t1 <= t0:
            return None, None
        return (k1 - k0) / (t1 - t0), ((s1 - s0) / (t1 - t0) if s1 > s0 else None)

    def fill(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        """A published row (telemetry/sample.py: StepSample's fields) with its rates, its point added."""
        t, step, samples = (row[i] for i in RATE_FROM)
        fields = list(row)
        fields[RATES_AT[0]], fields[RATES_AT[1]] = self.add(t, step, samples)
        return tuple(fields)

    def clear(self) -> None:
        self._points.clear()
