"""What the script printed, as the clients' `output` records.

The script's output goes out as whole lines, at a bounded rate: a script printing in a tight loop
costs the clients (and the server thread's share of the GIL) no more than a steady trickle, and
they are told how much they missed.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..output import OutputLog

RECENT_OUTPUT = 200
"""Lines of the script's output a new client receives as the past."""

OUTPUT_LINES = 1000
"""Lines of output a second sent at most (a second's worth at once): past it the older lines of a
turn are dropped, and the record says how many."""

OUTPUT_CHARS = 256 * 1024
"""Characters of output a second sent at most, likewise (lines are cut at output.LINE_LIMIT): a flood
of long lines costs a client at most this (a few times it in JSON) a second."""


class _Budget:
    """Output lines and characters the clients may get now: refilled at OUTPUT_LINES and OUTPUT_CHARS
    a second, up to one second's worth."""

    def __init__(self) -> None:
        self.lines, self.chars, self._at = float(OUTPUT_LINES), float(OUTPUT_CHARS), time.monotonic()

    def take(self, lines: list[str]) -> list[str]:
        """The newest of `lines` the budget allows (spent)."""
        now = time.monotonic()
        self.lines = min(float(OUTPUT_LINES), self.lines + (now - self._at) * OUTPUT_LINES)
        self.chars = min(float(OUTPUT_CHARS), self.chars + (now - self._at) * OUTPUT_CHARS)
        self._at = now
        kept = _newest(lines, int(self.lines), int(self.chars))
        self.lines -= len(kept)
        self.chars -= sum(map(len, kept))
        return kept


def _newest(lines: list[str], count: int, chars: int) -> list[str]:
    """The last lines of `lines`, at most `count` of them holding at most `chars` characters."""
    kept = 0
    for line in reversed(lines[-count:] if count > 0 else []):
        chars -= len(line)
        if chars < 0:
            break
        kept += 1
    return lines[len(lines) - kept :]


class Printed:
    """The script's output as read from hub.output: lines read (the job's count of them), the recent
    ones, the line being written, and how much more the clients may get now."""

    def __init__(self, log: OutputLog) -> None:
        self.log = log
        self.total = 0
        self.changes = 0  # bumped when what a welcome ends with changed
        self._writes = 0
        self._recent: deque[str] = deque(maxlen=RECENT_OUTPUT)
        self._current = ""
        self._budget = _Budget()

    def read(self, clients: bool) -> dict[str, Any] | None:
        """What the script printed since the last turn: into the recent lines, and, for `clients`, as
        one record within the budget (the oldest lines dropped, and counted, past it)."""
        log = self.log
        if log.writes == self._writes:
            return None
        self._writes = log.writes
        lines, total = log.since(self.total, limit=max(RECENT_OUTPUT, OUTPUT_LINES))
        current = log.current
        missed = total - self.total - len(lines)  # more than the hub's log holds since the last turn
        if not lines and not missed and current == self._current:
            return None
        self.total, self._current = total, current
        self._recent.extend(lines[-RECENT_OUTPUT:])
        self.changes += 1
        if not clients:
            return None
        sent = self._budget.take(lines)
        return self._record(sent, dropped=missed + len(lines) - len(sent))

    def recent(self) -> dict[str, Any] | None:
        """The record a welcome ends with: the recent lines; None before anything was printed."""
        if not (self.total or self._current):
            return None
        return self._record(_newest(list(self._recent), RECENT_OUTPUT, OUTPUT_CHARS), dropped=0)

    def _record(self, lines: list[str], dropped: int) -> dict[str, Any]:
        """`total`: lines the script has printed (the last of `lines` is that one), so a client that
        reconnects knows which it has; `dropped`: lines before these that were not sent."""
        return {"kind": "output", "lines": lines, "current": self._current, "total": self.total, "dropped": dropped}
