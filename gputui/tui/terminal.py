"""Keep the screen clean while the TUI owns the terminal, and notice when the terminal dies.

Python-level prints are captured by Textual, but C and C++ code (NCCL, cuDNN, a library's own
logging) write to file descriptors 1 and 2 directly and would scribble over the screen. While
the app runs, those descriptors point into a pipe whose text joins the script's log, fd 0 is
/dev/null (keys are the app's: a script reading stdin would split them with it), and Textual
reads and draws on duplicates of the real terminal.

A terminal can die without a SIGHUP reaching us (the pane's leader ignores HUP, `tmux
kill-session`): reads then see EOF, writes fail with EIO, and Textual's writer thread would die,
leaving the UI thread blocked on its full queue. So Textual writes through `_Screen`, which
drops what cannot be written, a watchdog polls the terminal for a hang-up, and either sends
SIGHUP to the main thread: the hand-over to headless then happens in one place (runner.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TextIO

from ..telemetry.output import LineWriter


def _report_lost() -> None:
    """The terminal is gone: as if its SIGHUP had come (to the main thread, whose handler acts)."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGHUP)


class _Screen(io.TextIOWrapper):
    """The terminal as Textual writes to it: a write that fails (EIO: the terminal is gone) is
    dropped and reported, instead of killing Textual's writer thread."""

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except OSError:
            _report_lost()
            return len(text)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            _report_lost()


class Terminal:
    """The duplicates of fds 0, 1 and 2 that Textual uses while the app runs."""

    def __init__(self) -> None:
        self.fds = os.dup(0), os.dup(1), os.dup(2)

    def release(self) -> None:
        """Point Textual's descriptors at /dev/null: what it still writes vanishes, reads see EOF.
        Only system calls: safe in a signal handler."""
        null = os.open(os.devnull, os.O_RDWR)
        for fd in self.fds:
            os.dup2(null, fd)
        os.close(null)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def _watch(fd: int, wake: int) -> None:
    """Block until the terminal hangs up (POLLHUP needs no event mask) or `wake` is written."""
    poller = select.poll()
    poller.register(fd, 0)
    poller.register(wake, select.POLLIN)
    if wake not in {ready for ready, _ in poller.poll()}:
        _report_lost()


READ = 65536
"""Bytes the pump reads from the pipe at once: with what its LineWriter holds, the most of a line it keeps."""


def captured_stream(sink: Callable[[str], None], fd: int, stream: TextIO | None) -> io.TextIOWrapper:
    """sys.stdout or sys.stderr (`stream`, whose encoding, errors and line buffering it keeps) while
    the screen owns the terminal: a text stream over a binary one, as Python's own, so `buffer`,
    `reconfigure()` and `fileno()` (the pipe) work; every write goes on as it is made
    (write_through), so text and `buffer` bytes keep their order, and lines reach `sink` whole."""
    name = "<stdout>" if fd == 1 else "<stderr>"
    return io.TextIOWrapper(
        LineWriter(sink, fd, name),
        encoding=getattr(stream, "encoding", None) or "utf-8",
        errors=getattr(stream, "errors", None) or "strict",
        line_buffering=bool(getattr(stream, "line_buffering", False)),
        write_through=True,
    )


QUIET = 0.1
"""Seconds the pipe may stay quiet before the end of a line in it is shown as it stands: a progress bar
that C code redraws with "\\r" (nothing flushes the pipe's end of a line as `print(flush=True)` does)."""


def pump(fd: int, lines: LineWriter) -> None:
    """What C code writes to fds 1 and 2, from the pipe into `lines` as it comes, until every write
    end is closed; then `fd` is closed. LineWriter bounds what waits for a newline."""
    ready = select.poll()
    ready.register(fd, select.POLLIN)
    try:
        while True:
            if lines.held and not ready.poll(QUIET * 1000):
                lines.flush()
            data = os.read(fd, READ)
            if not data:
                break
            lines.write(data)
        lines.flush()
    finally:
        os.close(fd)


@contextlib.contextmanager
def captured_output(sink: Callable[[str], None]) -> Iterator[Terminal]:
    """For the duration: fd 0 is /dev/null, fds 1 and 2 a pipe into `sink`, sys.stdout and sys.stderr
    write into `sink`; yields the terminal's own descriptors (duplicates), for the screen."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    terminal = Terminal()
    read_end, write_end = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    streams = sys.stdout, sys.stderr
    captured = captured_stream(sink, 1, streams[0]), captured_stream(sink, 2, streams[1])
    sys.stdout, sys.stderr = captured
    reader = threading.Thread(target=pump, args=(read_end, LineWriter(sink)), name="gputui-output", daemon=True)
    reader.start()
    try:
        yield terminal
    finally:
        for stream in captured:  # the end of a line the script wrote without one
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = streams
        os.dup2(terminal.fds[0], 0)
        os.dup2(terminal.fds[1], 1)  # the pipe's last write ends close here: the reader sees EOF
        os.dup2(terminal.fds[2], 2)
        terminal.close()
        reader.join(timeout=1)


@contextlib.contextmanager
def guarded_terminal(sink: Callable[[str], None]) -> Iterator[Terminal]:
    """captured_output, and Textual drawing on the terminal's descriptors through _Screen, with a
    watchdog for a terminal that dies without a SIGHUP."""
    with captured_output(sink) as terminal:
        originals = sys.__stdin__, sys.__stdout__, sys.__stderr__
        # Textual reads these when the app is built and when its driver starts: the real terminal.
        tty_in, tty_out, tty_err = terminal.fds
        sys.__stdin__ = open(tty_in, closefd=False)  # type: ignore[misc]
        sys.__stdout__, sys.__stderr__ = (  # type: ignore[misc]
            _Screen(
                io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
                # Python's own default when it started with the stream closed (sys.__stdout__ is None)
                encoding=stream.encoding if stream else "utf-8",
                errors=stream.errors if stream else "strict",
            )
            for fd, stream in ((tty_out, originals[1]), (tty_err, originals[2]))
        )
        wake_read, wake_write = os.pipe()
        watchdog = threading.Thread(target=_watch, args=(tty_in, wake_read), name="gputui-terminal", daemon=True)
        watchdog.start()
        try:
            yield terminal
        finally:
            os.write(wake_write, b"x")
            watchdog.join()
            for fd in (wake_read, wake_write):
                os.close(fd)
            for stream in (sys.__stdout__, sys.__stderr__):
                with contextlib.suppress(Exception):
                    stream.flush()
            sys.__stdin__, sys.__stdout__, sys.__stderr__ = originals  # type: ignore[misc]
