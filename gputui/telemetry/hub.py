"""The process's telemetry hub: the ring of recent samples, the events, the sinks, the controls and
the script's output.

One hub per process. The launcher (`gputui run`, the TUI) installs one with its settings before
the script starts; `fit()` publishes into whichever hub is installed, or makes its own when the
script runs under plain `python`.

Publishing a step is one append of its figures to `rows`, without a lock, a call or an object of
the hub's: in a millisecond step, what a step touches beyond its own work costs it several times its
warm cost (torch's step leaves the caches cold), and a record, the ring and the sinks made each step
measured ~6 us of a 2 ms step. The rows become records (sample.StepRecord), their rates filled in
(rate.py), and go to the sinks in a batch at a flush: the publisher's, every FLUSH_S (every step,
once steps take that long), before an event, a run's start or end (so every sink and reader gets the
steps before it, in order), and the server thread's once they are overdue (the script evaluates,
saves, works outside a step).
A reader drains the rows first: it sees every step published. The training thread never waits on a
reader, and a reader makes the step's StepSample when it asks for it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .controls import Controls
from .output import OutputLog
from .rate import Rate
from .run import RunInfo, RunSummary
from .sample import STEP_AT, Event, GpuReading, StepRecord, StepSample

IDLE_S = 1.0
"""Seconds outside a step after which the run is "between steps" (a step's own gap is far shorter)."""
FLUSH_S = 0.05
"""Seconds the steps published may wait in `rows` before their sinks get them (the server's tick)."""


class Sink(Protocol):
    """A consumer called by whoever flushes (the training thread, mostly; the server thread for steps
    left waiting), one call at a time: it must be quick and must not raise, but for SinkFailed once,
    when it can write no more.

    A sink that has an `on_record(record: StepRecord)` method is given each step's record instead
    of its sample, in the batches the hub flushes: it makes the sample only if and when it needs it
    (the progress line, a few times a second; the socket's server, on its own thread). One with a
    `flushed()` method is called once after a flush's steps: its on_record may then be a C call that
    keeps the record (a deque's append: no Python frame a step), and flushed() acts on the batch. A sink given
    samples is given each as its step ends: while one is added, the hub flushes every step (a sink
    that acts on a step, as a test's that steers at step N, needs it then)."""

    def on_start(self, info: RunInfo) -> None: ...
    def on_sample(self, sample: StepSample) -> None: ...
    def on_event(self, event: Event) -> None: ...
    def on_end(self, summary: RunSummary) -> None: ...


class SinkFailed(Exception):
    """A sink can write no more (a full disk, a closed pipe). The hub drops it and says so once:
    one line on stderr (the message) and a `sink_failed` event (the details); training goes on."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


@dataclass(frozen=True)
class Overrides:
    """Settings given on the gputui command line (None: not given). The RunSession applies them over
    the script's own (fit's arguments), in fit and in an own loop alike."""

    memory_budget: int | None = None
    gpu_memory_limit: int | None = None
    memory_history: bool | None = None
    snapshot_dir: str | None = None
    metrics: str | None = None


class Hub:
    def __init__(self, overrides: Overrides | None = None, *, ring_size: int = 4096) -> None:
        self.overrides = overrides or Overrides()
        self.controls = Controls()
        # The script's output, written by what captures it (the TUI, or headless gputui run's tee);
        # the socket server and the TUI read it. Its own lock: a print never waits on a sample.
        self.output = OutputLog()
        self._lock = threading.Lock()
        self.rows: deque[list[Any]] = deque()
        """The steps published since the last drain, each StepSample's fields in order (a list: the drain
        fills its rates in, telemetry/rate.py): the publisher's one append a step (a deque's append is
        atomic: no lock). Call flush() once `due` has passed."""
        self.due = 0.0  # monotonic time by which the rows should be flushed
        self._wait = FLUSH_S  # how long rows may wait: 0 while a sink wants samples as they come
        self._owed: deque[StepRecord] = deque()  # drained into the ring, not handed to the sinks yet
        self._rate = Rate()  # the rows' steps and samples per second, derived as they are drained
        self._calling = threading.RLock()  # one flush or event at a time calls the sinks, in order
        self._samples: deque[StepRecord] = deque(maxlen=ring_size)
        self._events: deque[Event] = deque(maxlen=ring_size)
        self._published = 0  # samples ever published: a reader's cursor counts against it
        self._emitted = 0
        self._sinks: list[Sink] = []
        self._step_calls: list[tuple[Sink, Callable[[StepRecord], None]]] = []  # the sinks' per-step calls
        self._flushed: list[tuple[Sink, Callable[[], None]]] = []  # the sinks' calls after a flush's steps
        self.gpus: GpuReading | None = None  # the latest reading of every GPU, once something reads them
        self.feeds_gpus = False  # whether an NVML poller feeds this hub (probes.nvml.feed): started once
        self.info: RunInfo | None = None
        self.summary: RunSummary | None = None
        self._closers: list[Callable[[], None]] = []
        self._finishers: list[Callable[[], None]] = []
        self.runs = 0
        self.ended: list[tuple[RunInfo, RunSummary]] = []  # every run's start and end records, in order
        self.saved: dict[str, int] = {}  # path -> bytes: what gputui.save wrote, for the closing summary
        # "terminated"/"interrupted": a signal asked the run to stop while the script trains in
        # another thread than the handler's (the TUI's). A plain write: a handler takes no lock.
        self.stop_signal: str | None = None
        # When the script left its last step (wall clock), while it works outside one (evaluates,
        # saves, runs between two fit calls); None while a step trains. Two writes a step, no lock.
        self.idle_since: float | None = None

    def add_sink(self, sink: Sink) -> None:
        self.flush()  # the steps published before it are not its
        with self._lock:
            self._sinks = [*self._sinks, sink]
            self._step_calls = [(s, _step_call(s)) for s in self._sinks]
            self._flushed = [(s, s.flushed) for s in self._sinks if hasattr(s, "flushed")]
            self._waits()

    def remove_sink(self, sink: Sink) -> None:
        with self._lock:
            self._sinks = [s for s in self._sinks if s is not sink]
            self._step_calls = [(s, call) for s, call in self._step_calls if s is not sink]
            self._flushed = [(s, call) for s, call in self._flushed if s is not sink]
            self._waits()

    def _waits(self) -> None:
        eager = any(getattr(s, "on_record", None) is None for s in self._sinks)
        self._wait = 0.0 if eager else FLUSH_S
        if eager:
            self.due = 0.0

    def start(self, info: RunInfo) -> None:
        with self._calling:
            self.flush()  # the last run's steps go before its successor's start
            with self._lock:
                self.info = info
                self.summary = None
                self.runs += 1
            self._call("on_start", info)

    def last_step(self) -> int:
        """The step published last (0 before any), without the lock: a signal handler asks, in a thread
        that may hold it (a deque's last item is read atomically)."""
        try:
            return int(self.rows[-1][STEP_AT])
        except IndexError:  # none waiting, or drained meanwhile: the ring has it
            pass
        try:
            return self._samples[-1].step
        except IndexError:
            return 0

    def publish(self, sample: StepSample) -> None:
        """Publish a sample made already (one received from a job); the engine publishes rows."""
        self.publish_record(StepRecord.of(sample))

    def publish_record(self, record: StepRecord) -> None:
        """Publish one step as a record made already (a job's, received), to the sinks at once."""
        with self._calling:
            with self._lock:
                self._drain()
                self._keep(record)
            self._deliver()

    def flush(self, now: float | None = None) -> None:
        """Hand every step published so far to the ring and the sinks, in order. `now`: the publisher's
        monotonic clock (the next flush is due FLUSH_S after it); without it (an event, a run's start,
        the server thread), the next step is flushed at once: a part's first step is drawn at once."""
        self.due = 0.0 if now is None else now + self._wait
        with self._calling:
            with self._lock:  # even with no rows left: a reader's drain under way has put its records in _owed
                self._drain()
            self._deliver()

    def flush_due(self) -> None:
        """The server thread's turn: flush the steps left waiting past `due` (the script works outside a
        step; a reader drained them meanwhile), unless the publisher flushes every step itself (a sink
        wants samples as they come) or a flush is under way (a sink blocked on a paused terminal must
        not stall the server)."""
        if not self._wait or not (self.rows or self._owed) or time.monotonic() < self.due:
            return
        if self._calling.acquire(blocking=False):
            try:
                self.flush()
            finally:
                self._calling.release()

    def _drain(self) -> None:
        """The rows into records, their rates filled in, in the ring and owed to the sinks; under the lock."""
        rows, fill, samples, owed = self.rows, self._rate.fill, self._samples, self._owed
        while rows:  # _keep() written out: a batch of rows at a time, on the training thread
            record = StepRecord(fill(rows.popleft()))
            samples.append(record)
            owed.append(record)
            self._published += 1

    def clear_rate(self) -> None:
        """The time from the last step published to the next is not training time (a pause, an evaluation,
        a new run's setup): the rate starts over with the next step."""
        with self._lock:
            self._drain()
            self._rate.clear()

    def _keep(self, record: StepRecord) -> None:
        self._samples.append(record)
        self._owed.append(record)
        self._published += 1

    def _deliver(self) -> None:
        """Every record owed to the sinks, in order; under `_calling` (_call() written out: a batch of steps
        at a time)."""
        owed = self._owed
        if not owed:
            return
        while owed:
            record = owed.popleft()
            for sink, call in self._step_calls:
                try:
                    call(record)
                except SinkFailed as failure:
                    self._failed(sink, failure, record.step)
        for sink, flushed in self._flushed:
            try:
                flushed()
            except SinkFailed as failure:
                self._failed(sink, failure)

    def emit(self, event: Event) -> None:
        with self._calling:  # no flush of another thread's between the steps before it and the event
            self.flush()
            self._event(event)

    def _event(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)
            self._emitted += 1
            if event.name == "run_continued" and self.info is not None:  # another fit call, the same run
                self.info = self.info.continued(event.details)
        self._call("on_event", event)

    def end(self, summary: RunSummary) -> None:
        with self._calling:
            self.flush()
            with self._lock:
                self.summary = summary
                if self.info is not None:
                    self.ended.append((self.info, summary))
            self._call("on_end", summary)

    def note_saved(self, path: str, size: int) -> None:
        """gputui.save wrote `size` bytes to `path` (the last save of a path counts)."""
        self.saved[path] = size

    def idle(self) -> float | None:
        """Since when the script has worked outside a step, once that is IDLE_S or longer; else None."""
        since = self.idle_since
        return since if since is not None and time.time() - since >= IDLE_S else None

    def publish_gpus(self, reading: GpuReading) -> None:
        """The newest reading of every GPU: readers take the latest (one attribute write, no lock),
        a second of them per reading, not one per step."""
        self.gpus = reading

    def on_finish(self, finisher: Callable[[], None]) -> None:
        """Call `finisher` once when the script is done with the hub (the run's end record goes out then:
        a process's fit calls and Trainers are one run, which ends with the script)."""
        self._finishers.append(finisher)

    def finish(self) -> None:
        """The script is done: its run ends, each finisher once. Called where the script ends, and before
        the telemetry closes, so every sink and client gets the end record (how the script itself
        ended is its exit code's to say: `script_ended`)."""
        while self._finishers:
            self._finishers.pop()()

    def on_close(self, closer: Callable[[], None]) -> None:
        """Call `closer` when the telemetry closes (a poller thread to stop)."""
        self._closers.append(closer)

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()

    def tell(self, sink: Sink, method: str, arg: Any) -> None:
        """Call one sink as every sink is called (a failure drops it and is said once); nothing if the
        hub dropped it already."""
        if sink not in self._sinks:
            return
        with self._calling:
            try:
                getattr(sink, method)(arg)
            except SinkFailed as failure:
                self._failed(sink, failure)

    def _call(self, method: str, arg: Any) -> None:
        with self._calling:
            for sink in self._sinks:
                try:
                    getattr(sink, method)(arg)
                except SinkFailed as failure:
                    self._failed(sink, failure)

    def _failed(self, sink: Sink, failure: SinkFailed, step: int | None = None) -> None:
        """Drop the sink and say so once (`step`: the step it failed on). The event goes after the steps
        delivered so far: not a flush, the failure may come in the middle of one."""
        self.remove_sink(sink)
        say_failed(failure)
        at = self.last_step() if step is None else step
        self._event(Event("sink_failed", at, {**failure.details, "message": str(failure)}))

    def since(self, cursor: tuple[int, int]) -> tuple[list[StepSample], list[Event], tuple[int, int]]:
        """What was published after `cursor` ((0, 0) at first), and the cursor to pass next time.

        A reader slower than the ring gets what the ring still holds: it misses samples, never
        blocks the publisher."""
        with self._lock:
            self._drain()
            records = _tail(self._samples, self._published - cursor[0])
            events = _tail(self._events, self._emitted - cursor[1])
            position = (self._published, self._emitted)
        return [r.sample() for r in records], events, position  # made here, outside the lock

    def latest(self) -> StepSample | None:
        with self._lock:
            self._drain()
            record = self._samples[-1] if self._samples else None
        return record.sample() if record is not None else None

    def samples(self) -> list[StepSample]:
        with self._lock:
            self._drain()
            records = list(self._samples)
        return [r.sample() for r in records]

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)


def say_failed(failure: SinkFailed) -> None:
    """A sink's failure, one line on stderr (which may be closed itself)."""
    try:
        sys.stderr.write(f"gputui: {failure}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _step_call(sink: Sink) -> Callable[[StepRecord], None]:
    """What the hub calls each step: the sink's on_record, or its on_sample given the step's sample."""
    on_record: Callable[[StepRecord], None] | None = getattr(sink, "on_record", None)
    if on_record is not None:
        return on_record
    return lambda record: sink.on_sample(record.sample())


def _tail(ring: deque[Any], count: int) -> list[Any]:
    if count <= 0:
        return []
    if count >= len(ring):
        return list(ring)
    return list(ring)[-count:]


_current: Hub | None = None


def _forked() -> None:
    """In a forked child: the hub's locks new (a thread of the parent's may have held them at the fork),
    and none of the parent's steps to hand on (the parent does)."""
    hub = _current
    if hub is not None:
        hub._lock, hub._calling = threading.Lock(), threading.RLock()
        hub.rows.clear()
        hub._owed.clear()


os.register_at_fork(after_in_child=_forked)


def install(hub: Hub | None) -> None:
    """Make `hub` the one fit() publishes into (None: fit makes its own)."""
    global _current
    _current = hub


def current() -> Hub | None:
    return _current
