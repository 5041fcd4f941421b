"""The script's own output, as a terminal would show it. No textual: tested without an app."""

from __future__ import annotations

import threading
from collections import deque

from ..telemetry.printable import printable


def visible(line: str) -> str:
    """What a terminal leaves of one line: the text after its last carriage return that has any
    (progress bars redraw themselves with "\\r"), without escape sequences or control bytes."""
    if "\r" in line:
        line = next((part for part in reversed(line.split("\r")) if part), "")
    return printable(line).expandtabs()


class OutputLog:
    """The script's output as whole lines (prints arrive in pieces: text, then "\\n"); thread-safe.

    A line still being written (a progress bar redrawing itself with "\\r") is `current`: the
    screen shows it as one line that changes, and it joins `lines` when its newline comes."""

    def __init__(self, limit: int = 10_000) -> None:
        self.lines: deque[str] = deque(maxlen=limit)
        self.total = 0  # lines ever written: a reader's position survives the deque dropping old ones
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            parts = (self._partial + text).split("\n")
            partial = parts.pop()
            if "\r" in partial:  # only the last redraw of a line that keeps redrawing is worth its memory
                last = next((part for part in reversed(partial.split("\r")) if part), "")
                partial = "\r" + last + ("\r" if partial.endswith("\r") else "")
            self._partial = partial
            self.lines.extend(visible(part) for part in parts)
            self.total += len(parts)

    @property
    def current(self) -> str:
        """The line being written now, as a terminal would show it ("" if none)."""
        with self._lock:
            return visible(self._partial)

    def since(self, position: int) -> tuple[list[str], int]:
        """Lines after `position` (those still kept), and the position to pass next time."""
        with self._lock:
            new = min(self.total - position, len(self.lines))
            return (list(self.lines)[len(self.lines) - new :] if new > 0 else []), self.total

    def tail(self, count: int) -> list[str]:
        """The last `count` lines as a terminal shows them, the one being written included."""
        lines, _ = self.since(max(0, self.total - count))
        current = self.current
        return (lines + [current])[-count:] if current else lines
