"""The script's own output, as a terminal would show it: whole lines, and the one being written.

It lives in the hub (`hub.output`), written by whatever captures the script's streams (the TUI's
print capture and its pipe for what C code writes, both bytes through a LineWriter, or headless
`gputui run`'s tee), read by the socket server for attach clients, and replayed into the TUI's own
log (a local run's or an attached job's). Everything kept is already made inert (`printable()`): no escape sequence or
control byte reaches a terminal or a socket.
"""

from __future__ import annotations

import codecs
import io
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .printable import printable

LINE_LIMIT = 4096
"""Characters of a line kept (its start; "…" marks the cut): a script printing a megabyte without
a newline costs neither the training thread (each write copies the line so far) nor a client."""

_RAW = 2 * LINE_LIMIT
"""Characters of a line as written that are looked at: escape sequences take room that is not shown."""


def cut(line: str) -> str:
    """`line`, at most LINE_LIMIT characters of it and an ellipsis."""
    return line if len(line) <= LINE_LIMIT else line[:LINE_LIMIT] + "…"


def visible(line: str) -> str:
    """What a terminal leaves of one line: the text after its last carriage return that has any
    (progress bars redraw themselves with "\\r"), without escape sequences or control bytes."""
    if "\r" in line:
        line = next((part for part in reversed(line.split("\r")) if part), "")
    return cut(printable(line[:_RAW]).expandtabs())


def left_out(count: int, why: str) -> str:
    """The line that stands for `count` lines a reader never got."""
    return f"… {count} line{'' if count == 1 else 's'} not shown ({why})"


class OutputLog:
    """The script's output as whole lines (prints arrive in pieces: text, then "\\n"); thread-safe.

    A line still being written (a progress bar redrawing itself with "\\r") is `current`: the
    screen shows it as one line that changes, and it joins `lines` when its newline comes."""

    def __init__(self, limit: int = 10_000) -> None:
        self.lines: deque[str] = deque(maxlen=limit)
        self.total = 0  # lines ever written: a reader's position survives the deque dropping old ones
        self.writes = 0  # changes ever made (lines or the current one): a reader's check, without the lock
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        """Text as the script wrote it (any piece of a line, several lines, carriage returns)."""
        with self._lock:
            parts = (self._partial + text).split("\n")
            partial = parts.pop()
            if "\r" in partial:  # only the last redraw of a line that keeps redrawing is worth its memory
                last = next((part for part in reversed(partial.split("\r")) if part), "")
                partial = "\r" + last[:_RAW] + ("\r" if partial.endswith("\r") else "")
            self._partial = partial[: _RAW + 2]
            self._add([visible(part) for part in parts])

    def add(self, lines: Sequence[str], current: str | None = None) -> None:
        """Lines already made visible elsewhere (a hub's, a job's), and the line being written
        there (None: as it was)."""
        if not lines and current is None:
            return
        with self._lock:
            if current is not None:
                self._partial = cut(current)
            self._add([cut(line) for line in lines])

    def _add(self, lines: list[str]) -> None:
        self.lines.extend(lines)
        self.total += len(lines)
        self.writes += 1

    @property
    def current(self) -> str:
        """The line being written now, as a terminal would show it ("" if none)."""
        with self._lock:
            return visible(self._partial)

    def since(self, position: int, limit: int | None = None) -> tuple[list[str], int]:
        """Lines after `position` (those still kept; the last `limit` of them), and the position to
        pass next time. A reader that fell behind the deque computes what it lost from the two."""
        with self._lock:
            new = min(self.total - position, len(self.lines), len(self.lines) if limit is None else limit)
            lines = list(itertools.islice(reversed(self.lines), max(new, 0)))
            lines.reverse()
            return lines, self.total

    def tail(self, count: int) -> list[str]:
        """The last `count` lines as a terminal shows them, the one being written included."""
        lines, _ = self.since(max(0, self.total - count))
        current = self.current
        return (lines + [current])[-count:] if current else lines


class LineWriter(io.BufferedIOBase):
    """The binary side of the script's captured output (`sys.stdout.buffer` under the TUI, and the
    pipe C code writes into): bytes decoded as the terminal would (UTF-8, a character split between
    writes joined up), passed to `sink` a line at a time, so two streams' lines never splice. A line
    waits for its end ("\\n", or a progress bar's "\\r") or a flush, as at a terminal, but never past
    what the log keeps of a line (_RAW characters): then what there is goes on and the log cuts it,
    so a megabyte written without a newline is never held whole."""

    def __init__(self, sink: Callable[[str], None], fd: int = -1, name: str = "") -> None:
        super().__init__()
        self._sink, self._fd, self.name = sink, fd, name
        self._split = b""  # the start of a character the next write ends
        self._lock = threading.Lock()  # the script's threads may write at once, as to Python's own streams
        self.held = ""  # the line so far, waiting for its end

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:  # faulthandler, subprocess: the pipe behind it
        if self._fd < 0:
            raise io.UnsupportedOperation("fileno")
        return self._fd

    def write(self, data: Any) -> int:
        if type(data) is not bytes:
            data = bytes(memoryview(data))  # text or a number: TypeError, as from any binary stream
        size = len(data)
        with self._lock:
            if self._split:
                data = self._split + data
            text, used = codecs.utf_8_decode(data, "replace", False)
            self._split = data[used:]
            if self.held:
                text = self.held + text
            end = max(text.rfind("\n"), text.rfind("\r")) + 1
            if len(text) - end > _RAW:
                end = len(text)
            self.held = text[end:]
            if end:
                self._sink(text[:end])
        return size

    def flush(self) -> None:
        super().flush()  # ValueError once closed, as any stream
        with self._lock:
            if self.held:
                text, self.held = self.held, ""
                self._sink(text)
