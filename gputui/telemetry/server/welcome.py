"""What a new client gets before the live records: who the job is, and the run so far.

The server keeps its own view of the run, folded in its thread in publication order, so a new client
never sees a record twice: the run's start info and end summary, its history in bounded points, the
recent events, the last step and GPU reading, and the script's recent output. The welcome's bytes
are built once per change of that view, not per connection: a flood of connections costs no
serializing.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import Any

from ..history import RunSeries
from ..hub import Hub
from ..protocol import clean, encode
from ..run import RunInfo
from ..sample import Event, StepRecord
from .printed import Printed

RECENT_EVENTS = 200
"""Events a new client receives as the recent past (its timeline)."""

STANDING = {
    "paused": "pause",
    "resumed": "pause",
    "oom": "oom",
    "auto_recover_changed": "auto_recover",
    "rank_waiting": "rank_waiting",
    "plan": "plan",
    "top_tensors": "top_tensors",
    "memory_summary": "memory_summary",
    "step_skipped": "step_skipped",
}
"""Events whose latest one (of its family) says how the job stands now (paused, waiting after an OOM,
the last plan...): a new client receives it however many events came after it."""

KEPT_EVALS = 1000
"""Evaluations a new client receives however old: the loss chart's eval line (a screen keeps as many)."""

FOLD_AT = 4096
"""Steps kept unfolded at most: the history stays bounded (it halves) with no client for days."""


class RunSoFar:
    def __init__(self, hub: Hub, printed: Printed) -> None:
        self.hub, self.printed = hub, printed
        self.started = time.time()
        self.later = True  # clients may connect later (a listening server): their welcome needs the history
        self.info: dict[str, Any] | None = None
        self.summary: dict[str, Any] | None = None
        self.last_step: StepRecord | None = None  # as an object: encoded only when a client wants it
        self._seq = 0  # events folded in, numbering them: the welcome sends its events in their order
        self.events: deque[tuple[int, dict[str, Any]]] = deque(maxlen=RECENT_EVENTS)
        self.standing: dict[str, tuple[int, dict[str, Any]]] = {}  # STANDING's family -> its latest
        self.evals: deque[tuple[int, dict[str, Any]]] = deque(maxlen=KEPT_EVALS)
        self.series = RunSeries()
        self.gpus: dict[str, Any] | None = None
        self._gpus_at = 0.0
        self._unfolded: list[StepRecord] = []  # steps not in the series yet: folded for a welcome
        self.idle_since: float | None = None  # as last sent: outside a step since then (Hub.idle)
        self._changes = 0
        self._welcome: tuple[tuple[int, int], bytes] | None = None

    def step(self, record: StepRecord) -> None:
        self._changes += 1
        self.last_step = record
        if self.later:
            self._unfolded.append(record)
            if len(self._unfolded) >= FOLD_AT:
                self._fold()

    def record(self, kind: str, item: Any) -> dict[str, Any]:
        """Fold a record other than a step in; returns it as sent (cleaned)."""
        self._changes += 1
        if kind == "start":
            self.info, self.summary, self.last_step = item.to_json(), None, None
            self.events.clear()
            self.standing.clear()
            self.evals.clear()
            self.series.clear()
            self._unfolded.clear()
            return clean({"kind": "start", "runs": self.hub.runs, "info": self.info})
        if kind == "event":
            record = clean(item.to_json())
            self._seq += 1
            numbered = (self._seq, record)
            self.events.append(numbered)
            family = STANDING.get(item.name)
            if family is not None:
                self.standing[family] = numbered
            elif item.name == "eval":
                self.evals.append(numbered)
            if item.name == "run_continued" and self.info is not None:
                self.info = item_info(self.info, item)
            return record
        self.summary = item.to_json()
        return clean({"kind": "end", "summary": self.summary})

    def idle_record(self) -> dict[str, Any] | None:
        """The run's idle time if it changed since the last said (looked at each turn: two reads)."""
        idle = self.hub.idle()
        if idle == self.idle_since:
            return None
        self._changes += 1
        self.idle_since = idle
        return {"kind": "idle", "since": idle}

    def gpus_record(self) -> dict[str, Any] | None:
        """The hub's GPU reading if it is new (looked at once a second), as sent."""
        now = time.monotonic()
        if now - self._gpus_at < 1.0:
            return None
        self._gpus_at = now
        reading = self.hub.gpus
        if reading is None or (self.gpus is not None and reading.t == self.gpus.get("t")):
            return None
        self._changes += 1
        self.gpus = clean(reading.to_json())
        return self.gpus

    def welcome(self) -> bytes:
        """Who, the run so far, the recent past, then `live`."""
        key = (self._changes, self.printed.changes)
        if self._welcome is not None and self._welcome[0] == key:
            return self._welcome[1]
        hello = {
            "kind": "hello",
            "pid": os.getpid(),
            "argv": list(sys.argv),
            "server_started": self.started,
            "runs": self.hub.runs,
            "info": self.info,
            "summary": self.summary,
            "idle_since": self.idle_since,
            "controllable": True,
        }
        self._fold()
        records = [clean(hello), clean({"kind": "history", "series": self.series.to_json()}), *self.past()]
        if self.last_step is not None:
            records.append(clean({"kind": "steps", "rows": [self.last_step.row()]}))
        if self.gpus is not None:
            records.append(self.gpus)
        output = self.printed.recent()
        if output is not None:
            records.append(output)
        records.append({"kind": "live"})
        welcome = b"".join(encode(record) for record in records)
        self._welcome = (key, welcome)
        return welcome

    def past(self) -> list[dict[str, Any]]:
        """The recent events, after the older ones a new client still needs (STANDING's, the evals),
        all in the order they came."""
        recent = self.events[0][0] if self.events else self._seq + 1
        older = sorted(e for e in (*self.standing.values(), *self.evals) if e[0] < recent)
        return [record for _, record in (*older, *self.events)]

    def _fold(self) -> None:
        """The steps since the last fold into the history a welcome sends, from their records' figures
        (no sample made): when a client comes or FOLD_AT have gathered, not each step."""
        add = self.series.add
        for item in self._unfolded:
            add(*item.charted())
        self._unfolded.clear()


def item_info(info: dict[str, Any], event: Event) -> dict[str, Any]:
    """The run's info as a `run_continued` event changes it."""
    return clean(RunInfo.from_json(info).continued(event.details).to_json())
