"""Memory readings. Each module imports its own backend (torch, pynvml, psutil); none imports textual."""

from __future__ import annotations

from ..telemetry.sample import Memory

STEP_READ_S = 0.1
"""Seconds between the readings a probe makes after steps (step_reading): the screen redraws 4 times a
second, and each reading's peak covers the steps since the one before. On CUDA a reading and its peak
reset cost a launch-bound step on an H200 about 140 us (benchmarks/fit_cost.py); on a CPU, its key
and record cost a millisecond step several microseconds in place."""


class PacedReadings:
    """A probe's readings after steps, at most every STEP_READ_S. A reading elsewhere, a freed cache or an
    OOM sets `_step_read_at` to -inf: what changed is read after the next step."""

    _step_read_at = float("-inf")  # when step_reading last read

    def read(self) -> Memory:
        raise NotImplementedError

    def step_reading(self, now: float) -> Memory | None:
        """After a step, at `now` (time.monotonic(), the publisher's clock): a reading, or None where the
        last one (at most STEP_READ_S old, and no other reading, cache freeing or OOM since) stands for it."""
        if now - self._step_read_at < STEP_READ_S:
            return None
        memory = self.read()
        self._step_read_at = now
        return memory
