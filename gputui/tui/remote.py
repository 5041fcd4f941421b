"""A job in another process, as a Source for the app: the screen of `gputui run` and `gputui attach`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..telemetry.client import Mirror
from .sources import LocalSource, Update

WATCH_ONLY = "watch-only: attach with --control to steer"


class RemoteSource:
    """The mirror's hub read as a local one, started over (with the job's history) at each connection;
    the job's output lines come once each, over all connections (the mirror leaves out those it has)."""

    def __init__(self, mirror: Mirror, *, control: bool) -> None:
        self.mirror = mirror
        self.watch_only = None if control else WATCH_ONLY
        self._generation = -1
        self._local = LocalSource(mirror.hub)

    def poll(self) -> Update:
        m = self.mirror
        reset = m.generation != self._generation
        if reset:  # a new connection replays into a fresh hub
            self._generation, self._local = m.generation, LocalSource(m.hub)
        update = self._local.poll()
        return replace(update, reset=reset, history=m.history if reset else None, banner=m.status)

    def request(self, action: str, value: Any = None) -> int | None:
        return self.mirror.request(action, value)
