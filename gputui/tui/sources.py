"""Where the screen's updates come from: the hub in this process (`gputui run`) or a job's socket
(`gputui attach`, remote.py). No textual: the view is tested on a Source without an app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..telemetry.hub import Hub
from ..telemetry.run import RunInfo, RunSummary
from ..telemetry.sample import Event, GpuReading, StepSample


@dataclass(frozen=True)
class Update:
    samples: list[StepSample]
    events: list[Event]
    info: RunInfo | None  # None before the run starts
    summary: RunSummary | None  # None until the run ends
    gpus: GpuReading | None
    runs: int
    reset: bool = False  # start the view over (a remote job, just (re)connected)
    history: dict[str, tuple[list[int], list[float], int]] | None = None  # the run so far, for a reset
    banner: str | None = None  # the connection's state, when it is not simply live


class Source(Protocol):
    watch_only: str | None
    """None if controls can be sent, else why not (shown on every dimmed remedy key)."""

    def poll(self) -> Update: ...
    def request(self, action: str, value: Any = None) -> int | None:
        """Send a control; returns its request id. RuntimeError with the reason if refused."""
        ...


class LocalSource:
    """A hub of this process: the script trains in a worker thread of the app."""

    watch_only: str | None = None

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._cursor = (0, 0)

    def poll(self) -> Update:
        samples, events, self._cursor = self.hub.since(self._cursor)
        hub = self.hub
        return Update(samples, events, hub.info, hub.summary, hub.gpus, hub.runs)

    def request(self, action: str, value: Any = None) -> int | None:
        return self.hub.controls.request(action, value, source="tui").id
