"""Steps and samples per second over the last few steps (a window, so a pause or a slow first step
fades out instead of dragging the figure for the whole run)."""

from __future__ import annotations

from collections import deque


class Rate:
    def __init__(self, window: int = 32) -> None:
        self._points: deque[tuple[float, int, int]] = deque(maxlen=window)

    def add(self, t: float, steps: int, samples: int) -> tuple[float | None, float | None]:
        """Record the counters at time `t`; returns (steps per second, samples per second)."""
        self._points.append((t, steps, samples))
        (t0, k0, s0), (t1, k1, s1) = self._points[0], self._points[-1]
        if t1 <= t0:
            return None, None
        return (k1 - k0) / (t1 - t0), ((s1 - s0) / (t1 - t0) if s1 > s0 else None)

    def clear(self) -> None:
        self._points.clear()
