"""Where the screen's updates come from: a hub, read for what is new since the last poll. The screen
(a process of its own under `gputui run`, or `gputui attach`) reads the mirror of a job's hub
(remote.py's RemoteSource wraps a LocalSource on it); tests read a hub of their own. No textual: the
view is tested on a Source without an app."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..telemetry.hub import Hub
from ..telemetry.output import left_out
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
    output: Sequence[str] = ()  # the script's new output lines
    current: str | None = None  # the line it is writing now, when that changed
    idle_since: float | None = None  # outside a step since then (hub.idle_since)


class Source(Protocol):
    watch_only: str | None
    """None if controls can be sent, else why not (shown on every dimmed remedy key)."""

    def poll(self) -> Update: ...
    def request(self, action: str, value: Any = None) -> int | None:
        """Send a control; returns its request id. RuntimeError with the reason if refused."""
        ...


class LocalSource:
    """A hub in this process: the mirror's (remote.py), or a test's."""

    watch_only: str | None = None

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._cursor = (0, 0)
        self._printed = 0  # lines of the hub's output read
        self._writes = 0
        self._current: str | None = None  # what the reader was last told: None, so the first poll tells it

    def poll(self) -> Update:
        samples, events, self._cursor = self.hub.since(self._cursor)
        hub = self.hub
        lines, current = self._output()
        return Update(
            samples,
            events,
            hub.info,
            hub.summary,
            hub.gpus,
            hub.runs,
            output=lines,
            current=current,
            idle_since=hub.idle_since,
        )

    def _output(self) -> tuple[list[str], str | None]:
        """The hub's output lines since the last poll, and its current line if it changed."""
        log = self.hub.output
        if log.writes == self._writes:
            return [], None
        self._writes = log.writes
        lines, total = log.since(self._printed)
        if total - self._printed > len(lines):  # the log dropped lines before this poll came
            lines.insert(0, left_out(total - self._printed - len(lines), "printed faster than the screen reads"))
        self._printed = total
        current = log.current
        if current == self._current:
            return lines, None
        self._current = current
        return lines, current

    def request(self, action: str, value: Any = None) -> int | None:
        return self.hub.controls.request(action, value, source="tui").id
