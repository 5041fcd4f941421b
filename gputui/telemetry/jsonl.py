"""The metrics file: one JSON object a line (start, step, event, end), in the order they happened; a
run appends its own, so a file given again keeps the runs before it.

A step's line is written by a thread of the file's own, at most FLUSH_S after the hub hands the step
over (hub.FLUSH_S after it, or at the next step, event or end where no server thread flushes steps
left waiting): made and encoded on the training thread, it cost a 1.5 ms CPU step ~75 us (the
encoder's code and data cold after the step's own work), written in a batch ~15 us a line, and off
the training thread. The run's start, its events and its end are written where they happen, after
the steps before them, so `tail -f` sees each step within a quarter of a second, and an error, a
Ctrl-C or a stop still writes every step (a SIGKILL loses at most the last quarter second).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
import weakref
from collections import deque
from typing import Any

from .hub import SinkFailed, say_failed
from .run import RunInfo, RunSummary, launched_rank
from .sample import VERSION, Event, StepRecord, StepSample


def for_rank(path: str) -> str:
    """Under torchrun every rank writes its own file: rank 0 the path as given, rank N `name.rankN.ext`
    beside it (one file written by several processes would interleave and tear their lines)."""
    rank = launched_rank()
    if not rank:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class MetricsFile:
    """Every write is one unbuffered write of whole lines, so a failed write leaves nothing behind to
    flush (or fail again) at close; a disk that fills mid-line gets the partial line cut off. The
    first failure ends the file for good (a file of whole lines is worth more than one with a gap)
    and training goes on: a failure of the writing thread is raised at the sink's next call, where
    the hub says it once and drops the sink (or said by close(), if no call comes)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = for_rank(os.fspath(path))
        try:  # appended: a path given again (a resumed run, a rerun) keeps the runs before, each from its start
            self._file = open(self.path, "ab", buffering=0)
        except OSError as exc:
            raise ValueError(f"cannot write the metrics file {self.path}: {exc.strerror}") from None
        self._steps: deque[StepRecord] = deque()  # published, not written yet (appended at the hub's flushes)
        self._lock = threading.Lock()  # one writer at a time: the thread, or an event's line
        self._failure: SinkFailed | None = None  # the writing thread's, for the next call to raise
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        _OPEN.add(self)

    # -- the sink ---------------------------------------------------------------------------
    def on_record(self, record: StepRecord) -> None:
        if self._failure is not None:
            self._raise_failure()
        if self._file.closed:  # failed, or a forked child's copy
            return
        self._steps.append(record)
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_steps, name="gputui-metrics", daemon=True)
            self._thread.start()

    def on_sample(self, sample: StepSample) -> None:
        self.on_record(StepRecord.of(sample))

    def on_start(self, info: RunInfo) -> None:
        self._line({"v": VERSION, "kind": "start", "t": round(time.time(), 6), **info.to_json()})

    def on_event(self, event: Event) -> None:
        self._line(event.to_json())

    def on_end(self, summary: RunSummary) -> None:
        self._line({"v": VERSION, "kind": "end", "t": round(time.time(), 6), **summary.to_json()})

    def close(self) -> None:
        """Write what is left, then close; a failure then is said on stderr (the hub may be gone)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            with self._lock:
                self._flush()
        except SinkFailed as failed:
            say_failed(failed)
        unsaid, self._failure = self._failure, None
        if unsaid is not None:  # the thread's, and no call came to raise it
            say_failed(unsaid)
        try:
            self._file.close()
        except OSError:  # an unbuffered file has nothing left to write: never fails a run that trained
            pass
        _OPEN.discard(self)

    def _forked(self) -> None:
        """In a forked child: the parent writes the file (its queued steps too); the child's copy writes
        nothing, and its lock (taken by the parent's thread, maybe, at the fork) is a new one."""
        self._lock, self._stop, self._thread = threading.Lock(), threading.Event(), None
        self._steps.clear()
        with contextlib.suppress(OSError):
            self._file.close()

    # -- writing ----------------------------------------------------------------------------
    def _line(self, record: dict[str, Any]) -> None:
        """One line now, after the steps before it."""
        if self._failure is not None:
            self._raise_failure()
        with self._lock:
            self._flush(_encode(record))

    def _raise_failure(self) -> None:
        """The writing thread's failure, raised once: the hub says it and drops this sink."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _write_steps(self) -> None:
        while not self._stop.wait(FLUSH_S):
            try:
                with self._lock:
                    self._flush()
            except SinkFailed as failure:
                self._failure = failure
                return

    def _flush(self, after: bytes = b"") -> None:
        """The steps waiting, then `after`, in one write (under the lock)."""
        steps = self._steps
        if self._file.closed:  # failed before: nothing more is written
            steps.clear()
            return
        data = b"".join([_encode(steps.popleft().sample().to_json()) for _ in range(len(steps))]) + after
        if not data:
            return
        written = 0
        try:
            while written < len(data):  # a write(2) may take part of the data and fail on the rest
                written += self._file.write(data[written:])
        except OSError as exc:
            partial = written - (data.rfind(b"\n", 0, written) + 1)  # the whole lines written stay
            if partial:
                try:
                    os.ftruncate(self._file.fileno(), self._file.tell() - partial)
                except OSError:  # a pipe or a device: nothing to cut
                    pass
            with contextlib.suppress(OSError):
                self._file.close()  # nothing more is written, whoever asks
            raise SinkFailed(
                f"metrics file {self.path}: {exc.strerror or exc}; no more lines will be written",
                sink="metrics",
                path=self.path,
                error=exc.strerror or str(exc),
            ) from None


FLUSH_S = 0.2
"""The most a step's line waits, once the hub handed it over, before it is written (its thread's turn)."""

_OPEN: weakref.WeakSet[MetricsFile] = weakref.WeakSet()
"""The files not closed yet: a script that never closes one still gets its steps at exit."""


def _close_all() -> None:
    for metrics in list(_OPEN):
        metrics.close()


def _forked() -> None:
    for metrics in list(_OPEN):
        metrics._forked()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_forked)


def _encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()
