"""The metrics file: one JSON object a line (start, step, event, end), flushed line by line.

Written by the training thread as it goes, so `tail -f` and a crash both see every finished step.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .sample import VERSION, Event, StepSample


class MetricsFile:
    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = os.fspath(path)
        try:
            self._file = open(self.path, "a" if append else "w", buffering=1, encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot write the metrics file {self.path}: {exc.strerror}") from None

    def _line(self, record: dict[str, Any]) -> None:
        if self._file.closed:
            return
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        except OSError:  # a full disk must not stop training
            pass

    def on_start(self, info: dict[str, Any]) -> None:
        self._line({"v": VERSION, "kind": "start", "t": round(time.time(), 6), **info})

    def on_sample(self, sample: StepSample) -> None:
        self._line(sample.to_json())

    def on_event(self, event: Event) -> None:
        self._line(event.to_json())

    def on_end(self, summary: dict[str, Any]) -> None:
        self._line({"v": VERSION, "kind": "end", "t": round(time.time(), 6), **summary})

    def close(self) -> None:
        self._file.close()
