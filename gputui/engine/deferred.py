"""Each step's loss (and gradient norm) as a Python number, without waiting for the device.

`.item()` on a CUDA tensor waits for every kernel queued before it: read every step, it holds the
CPU back to the GPU's pace, and a launch-bound model loses the queue of work the CPU had run ahead
with. On CUDA each step's loss is copied into pinned host memory (non_blocking) behind an event and
read once the event has passed, usually a step later; only the run's last loss is waited for, when
fit returns it. Elsewhere it is read at once: a CPU tensor has nothing to wait for, and MPS has no
pinned memory to copy into. The gradient norm travels the same way, in a reader of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

MAX_PENDING = 32
"""Copies in flight at most: past it the oldest is not read (its loss is never shown), so a device
far behind the CPU costs a bounded few bytes of pinned memory."""


class Copy(Protocol):
    """One loss on its way to the host; reused once read."""

    def start(self, loss: torch.Tensor) -> None: ...
    def done(self) -> bool: ...
    def wait(self) -> None: ...
    def value(self) -> float: ...


class CudaCopy:
    """A pinned host scalar and the event recorded after the copy into it, on the loss's current stream."""

    def __init__(self) -> None:
        self.host = torch.empty((), dtype=torch.float32, pin_memory=True)
        self.event = torch.cuda.Event()

    def start(self, loss: torch.Tensor) -> None:
        self.host.copy_(loss.reshape(()), non_blocking=True)  # a loss of shape (1,) too: the step checks numel()
        self.event.record(torch.cuda.current_stream(loss.device))  # the copy's stream, whichever device is current

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def value(self) -> float:
        return self.host.item()  # a host tensor: no device involved


Then = Callable[[float], None]
"""What a value is handed to once read (a step's norm, to count the step if the GradScaler skipped it)."""


class DeferredLoss:
    """put() each step's scalar (the loss, the gradient norm); `latest` is the newest one read. `make`
    builds a Copy (None: read at once)."""

    def __init__(self, make: Callable[[], Copy] | None = None) -> None:
        self._make = make
        self._pending: deque[tuple[Copy, Then | None]] = deque()
        self._free: list[Copy] = []
        self.latest: float | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> DeferredLoss:
        return cls(CudaCopy if device.type == "cuda" else None)

    def put(self, loss: torch.Tensor, then: Then | None = None) -> float | None:
        """Start reading a step's value (a scalar tensor), handed to `then` once read; returns `latest`
        after taking what has arrived."""
        if self._make is None:
            self.latest = value = loss.item()
            if then is not None:
                then(value)
            return value
        pending = self._pending
        if len(pending) >= MAX_PENDING:  # stream order: its copy lands before the one reusing it
            copy, waiting = pending.popleft()
            if waiting is not None:  # never shown, but what it is handed to still counts on it
                copy.wait()
                waiting(copy.value())
            self._free.append(copy)
        copy = self._free.pop() if self._free else self._make()
        copy.start(loss)
        pending.append((copy, then))
        return self.poll()

    def poll(self) -> float | None:
        """Take every value that has arrived (in step order, without waiting); returns `latest`."""
        pending = self._pending
        while pending and pending[0][0].done():
            copy, then = pending.popleft()
            self.latest = value = copy.value()
            self._free.append(copy)
            if then is not None:
                then(value)
        return self.latest

    def last_or_latest(self) -> float | None:
        """last(), or where the device answers no wait (an error broke it: a CUDA device-side assert) the last
        value read."""
        try:
            return self.last()
        except Exception:
            return self.latest

    def last(self) -> float | None:
        """The last value put, exactly: waits for the copies still on their way (each is handed on)."""
        for copy, _ in self._pending:
            copy.wait()
        return self.poll()
