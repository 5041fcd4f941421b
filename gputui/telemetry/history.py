"""A whole run's history in bounded memory: full resolution until it is long, then coarser.

The loss chart and the memory chart show the entire run, however long. When a series reaches
`capacity` points, neighbouring pairs merge (loss by mean, memory by max, so a peak is never
averaged away) and each point then stands for twice as many steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from statistics import fmean
from typing import Any

from .sample import Memory


class History:
    def __init__(self, capacity: int = 4096, reduce: Callable[[Sequence[float]], float] = fmean) -> None:
        if capacity < 2 or capacity % 2:
            raise ValueError("capacity must be an even number of points")
        self.capacity = capacity
        self.reduce = reduce
        self.steps: list[int] = []
        self.values: list[float] = []
        self.stride = 1  # steps per point once merged
        self._pending: list[tuple[int, float]] = []
        self._last = -1

    def add(self, step: int, value: float | None) -> None:
        """Append a point; a step not after the last one (a replayed record) is ignored."""
        if value is None or not math.isfinite(value) or step <= self._last:
            return
        self._last = step
        if self.stride > 1:  # gather `stride` raw points into one
            self._pending.append((step, value))
            if len(self._pending) < self.stride:
                return
            step, value = self._pending[-1][0], self.reduce([v for _, v in self._pending])
            self._pending = []
        self.steps.append(step)
        self.values.append(value)
        if len(self.values) >= self.capacity:
            self._halve()

    def _halve(self) -> None:
        pairs = range(0, len(self.values) - 1, 2)
        self.steps = [self.steps[i + 1] for i in pairs]
        self.values = [self.reduce(self.values[i : i + 2]) for i in pairs]
        self.stride *= 2

    def __len__(self) -> int:
        return len(self.values)

    def clear(self) -> None:
        self.steps, self.values, self.stride, self._pending, self._last = [], [], 1, [], -1

    def load(self, steps: list[int], values: list[float], stride: int) -> None:
        """Start from a history received from elsewhere (a job being attached to); a point that is not a
        number (a job's null) is not one here either."""
        kept = [(s, v) for s, v in zip(steps, values, strict=False) if isinstance(v, (int, float)) and math.isfinite(v)]
        self.steps, self.values = [s for s, _ in kept], [float(v) for _, v in kept]
        self.stride, self._pending = stride, []
        self._last = self.steps[-1] if self.steps else -1


class RunSeries:
    """The series a run's charts draw, a point a step: the loss (squeezed by mean), the gradient norm
    and allocated, reserved and peak memory (by max: a spike must show). One place for them: the job's
    server keeps the run's for clients that attach later, and every screen keeps its own."""

    def __init__(self) -> None:
        self.loss = History()
        self.grad_norm = History(reduce=max)
        self.allocated = History(reduce=max)
        self.reserved = History(reduce=max)
        self.peak = History(reduce=max)

    def _named(self) -> dict[str, History]:
        return {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "peak": self.peak,
        }

    def add(self, step: int, loss: float | None, memory: Memory, grad_norm: float | None = None) -> None:
        """A step's points, from its figures (the job's server folds records without making samples)."""
        self.loss.add(step, loss)
        self.grad_norm.add(step, grad_norm)
        self.allocated.add(step, memory.allocated)
        self.reserved.add(step, memory.reserved)
        self.peak.add(step, memory.peak)

    def clear(self) -> None:
        for history in self._named().values():
            history.clear()

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {name: {"steps": h.steps, "values": h.values, "stride": h.stride} for name, h in self._named().items()}

    def load(self, series: dict[str, tuple[list[int], list[float], int]]) -> None:
        """Start from series received from a job (name -> steps, values, stride); unknown names are ignored."""
        for name, history in self._named().items():
            if name in series:
                history.load(*series[name])
