"""A job in another process, as a Source for the app: `gputui attach`."""

from __future__ import annotations

from typing import Any

from ..telemetry.client import Mirror
from .model import Update

WATCH_ONLY = "watch-only: attach with --control to steer"


class RemoteSource:
    def __init__(self, mirror: Mirror, *, control: bool) -> None:
        self.mirror = mirror
        self.watch_only = None if control else WATCH_ONLY
        self._generation = -1
        self._cursor = (0, 0)

    def poll(self) -> Update:
        m = self.mirror
        reset = m.generation != self._generation
        if reset:
            self._generation, self._cursor = m.generation, (0, 0)
        hub = m.hub
        samples, events, self._cursor = hub.since(self._cursor)
        return Update(
            samples,
            events,
            hub.info,
            hub.summary,
            hub.gpu_poller.latest(),
            hub.runs,
            reset=reset,
            history=m.history if reset else None,
            banner=m.status,
        )

    def request(self, action: str, value: Any = None) -> int | None:
        return self.mirror.request(action, value)
