"""The metrics file: one JSON object a line (start, step, event, end), written line by line.

Written by the training thread as it goes, so `tail -f` and a crash both see every finished step.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .hub import SinkFailed
from .run import RunInfo, RunSummary, launched_rank
from .sample import VERSION, Event, StepSample


def for_rank(path: str) -> str:
    """Under torchrun every rank writes its own file: rank 0 the path as given, rank N `name.rankN.ext`
    beside it (one file written by several processes would interleave and tear their lines)."""
    rank = launched_rank()
    if not rank:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class MetricsFile:
    """Each line is one unbuffered write of its bytes, so a failed write leaves nothing behind to
    flush (or fail again) at close; a disk that fills mid-line gets the partial line cut off.
    The first failure ends the file for good: a file of whole lines is worth more than one with
    a gap, and training goes on."""

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = for_rank(os.fspath(path))
        try:
            self._file = open(self.path, "ab" if append else "wb", buffering=0)
        except OSError as exc:
            raise ValueError(f"cannot write the metrics file {self.path}: {exc.strerror}") from None

    def _line(self, record: dict[str, Any]) -> None:
        if self._file.closed:
            return
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        written = 0
        try:
            while written < len(data):  # a write(2) may take part of the line and fail on the rest
                written += self._file.write(data[written:])
        except OSError as exc:  # the hub drops this sink: it is never called again
            if written:
                try:
                    os.ftruncate(self._file.fileno(), self._file.tell() - written)
                except OSError:  # a pipe or a device: nothing to cut
                    pass
            raise SinkFailed(
                f"metrics file {self.path}: {exc.strerror or exc}; no more lines will be written",
                sink="metrics",
                path=self.path,
                error=exc.strerror or str(exc),
            ) from None

    def on_start(self, info: RunInfo) -> None:
        self._line({"v": VERSION, "kind": "start", "t": round(time.time(), 6), **info.to_json()})

    def on_sample(self, sample: StepSample) -> None:
        self._line(sample.to_json())

    def on_event(self, event: Event) -> None:
        self._line(event.to_json())

    def on_end(self, summary: RunSummary) -> None:
        self._line({"v": VERSION, "kind": "end", "t": round(time.time(), 6), **summary.to_json()})

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # an unbuffered file has nothing left to write: never fails a run that trained
            pass
