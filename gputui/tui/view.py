"""What the screen shows, folded from a Source's updates. No textual, no torch.

The panels only render a RunView, and it is the one reader of the run's info and summary: a
panel asks it (`observed`, `total_steps`, `why_not`...), never the records. Tests drive one with
plain samples and events (tests/tui/test_view.py).
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..telemetry.controls import AMP_MODES
from ..telemetry.describe import describe, number, waiting_text
from ..telemetry.events import EVENTS
from ..telemetry.history import RunSeries
from ..telemetry.hub import IDLE_S
from ..telemetry.run import RunInfo, RunSummary
from ..telemetry.sample import Event, GpuReading, RankMemory, StepSample
from .ranks import Ranks
from .sources import Update

KINDS = {
    "control_refused": "refused",
    "memory_limit": "refused",  # the limit asked for is not what the run gets
    "oom": "oom",
    "oom_recovered": "oom",
    "thrashing": "oom",
    "error": "error",
    "loss_not_finite": "error",
}
"""The timeline's colour of an event; any other is "applied" if it answers a request, else "info"."""

MAX_ETA = 100 * 365 * 86400.0
"""Seconds past which the time left is not shown (not a forecast: a rate nearly zero)."""


@dataclass
class Entry:
    """One line of the timeline."""

    t: float
    step: int
    text: str
    kind: str  # requested, applied, refused, oom, error, info


class Requests(dict[int, str]):
    """The requests this screen sent that the job has not answered: request id -> what the timeline said,
    and what each asked for, which a key pressed again before the answer counts on from."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: dict[int, tuple[str, Any]] = {}

    def add(self, request: int, text: str, action: str, value: Any) -> None:
        self[request], self.asked[request] = text, (action, value)

    def answered(self, request: int) -> None:
        self.pop(request, None)
        self.asked.pop(request, None)

    def clear(self) -> None:
        super().clear()
        self.asked.clear()

    def once_applied(self, actions: tuple[str, ...], now: Any) -> Any:
        """What a setting will be once the requests waiting are applied: the newest one's of `actions` (its
        value, or its action where the action is the value: pause, resume), else `now`."""
        for request in reversed(self):
            action, value = self.asked[request]
            if action in actions:
                return action if value is None else value
        return now


@dataclass
class RunView:
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time  # what the job's idle_since is measured on
    script: str = ""
    info: RunInfo | None = None
    summary: RunSummary | None = None
    latest: StepSample | None = None
    first: StepSample | None = None
    gpus: GpuReading | None = None
    runs: int = 0
    series: RunSeries = field(default_factory=RunSeries)
    timeline: deque[Entry] = field(default_factory=lambda: deque(maxlen=500))
    pending: Requests = field(default_factory=Requests)
    paused: bool = False
    auto_recover: bool = True
    changed: dict[str, tuple[int, Any]] = field(default_factory=dict)  # a setting: (samples_seen, value)
    stopping: bool = False
    signalled: str | None = None  # `gputui run` was signalled (why): its screen leaves once the script ends
    waiting_oom: Event | None = None
    rank_waiting: Event | None = None  # under torchrun: this rank waits for others (until its next step)
    top: Event | None = None
    plan: Event | None = None  # the latest "plan" event: the what-if table (remedies bar, planner screen)
    evals: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=1000))  # (step, value; NaN)
    cuda_summary: str | None = None
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    failure: str | None = None  # the script's traceback, or why it could not start
    ooms: int = 0
    idle_since: float | None = None  # the script works outside a step since then (wall clock)
    skipped: int = 0  # fp16 steps the GradScaler skipped (the latest step_skipped event's count)
    banner: str | None = None  # attach: disconnected, reconnecting, the job ended...
    remote: bool = False  # attached to a job in another process
    # Counters that only grow: a panel compares them with what it last drew to skip a re-render.
    generation: int = 0  # runs started over (a new fit, a reconnection)
    samples_seen: int = 0
    entries: int = 0  # timeline lines ever added or folded into
    plans: int = 0  # plan events seen
    evals_seen: int = 0  # eval events seen
    _filling: Entry | None = None  # the timeline's line of a plan still coming in (the next event replaces it)

    # -- folding updates ------------------------------------------------------------------------
    def apply(self, update: Update) -> bool:
        """Fold an update in; True if anything changed (the widgets then re-render)."""
        changed = update.banner != self.banner
        self.banner, generation = update.banner, self.generation
        if update.runs != self.runs or update.reset:
            if update.reset:  # the job replays its recent events: start the timeline over too
                self.timeline.clear()
            self._new_run(update.runs)
            self.series.load(update.history or {})
            changed = True
        if update.info is not None and update.info is not self.info:  # a run_continued event's too (hub.emit)
            self.info = update.info
            self.auto_recover = update.info.auto_recover
            changed = True
        for sample in update.samples:
            self._sample(sample)
        for event in update.events:
            self._event(event)
        if update.reset or generation != self.generation:  # a welcome: its events came before its last step
            self.changed.clear()
        if update.summary is not None and self.summary is None:
            self.summary = update.summary
            self.ended = self.ended or self.clock()
            self.pending.clear()  # a stop is answered by the run's end, and nothing after it will be
            changed = True  # the run ended: the header's status, the charts drawn whole
        if update.gpus is not self.gpus:
            self.gpus = update.gpus
            changed = True
        if update.idle_since != self.idle_since:
            self.idle_since = update.idle_since
            changed = True
        return changed or bool(update.samples or update.events or update.summary is not self.summary)

    def _new_run(self, runs: int) -> None:
        self.runs = runs
        self.generation += 1
        self.info = self.summary = self.latest = self.first = self.waiting_oom = self.top = self.plan = None
        self.changed.clear()
        self.rank_waiting = None
        self.ooms = self.skipped = 0
        self.series.clear()
        self.evals.clear()
        self.pending.clear()
        self.paused = self.stopping = False
        self.started, self.ended = self.clock(), None

    def _sample(self, s: StepSample) -> None:
        if self.first is None:
            self.first = s
        self.latest = s
        self.rank_waiting = None  # the step it waited in is done
        self.samples_seen += 1
        self.series.add(s.step, s.loss, s.memory, s.grad_norm)

    def _event(self, e: Event) -> None:
        request = e.get("request_id")
        if request is not None:
            self.pending.answered(request)
        # A job's event without a detail its name always has changes no setting: a timeline line (its name).
        # The plan's, the OOM's and the eval's readers take what is there (.get).
        whole = all(key in e.details for key in EVENTS.get(e.name, ()))
        if e.name == "paused":
            self.paused = True
        elif e.name == "resumed":
            self.paused = False
            self.waiting_oom = None
        elif e.name == "auto_recover_changed" and whole:
            self.auto_recover = bool(e["enabled"])
        elif e.name in ("amp_changed", "checkpointing_changed") and whole:  # before the next step's record says it
            value = e["to"] if e.name == "amp_changed" else e["enabled"]
            if type(value) is (str if e.name == "amp_changed" else bool):  # a job's record: checked before use
                self.changed[e.name[: -len("_changed")]] = (self.samples_seen, value)
        elif e.name in ("micro_batch_changed", "oom_recovered", "thrashing") and whole:
            size = e["to"] if e.name == "micro_batch_changed" else e["micro_batch_to"]
            if type(size) is int and type(e["accumulation"]) is int:
                self.changed["pieces"] = (self.samples_seen, (size, e["accumulation"]))
        elif e.name == "rank_waiting" and whole:
            self.rank_waiting = e if number(e["waited_s"]) is not None else self.rank_waiting
        elif e.name == "oom" and e.get("waiting"):
            self.waiting_oom = e
        elif e.name == "top_tensors":
            self.top = e  # the table is on its own screen; the timeline says the request was answered
        elif e.name == "memory_summary":
            self.cuda_summary = e.get("text")
        elif e.name == "plan":
            self.plan = e
            self.plans += 1
        elif e.name == "eval":  # the loss chart's eval line; a value not finite (null) is a gap in it
            value = number(e.get("value"))
            self.evals.append((e.step, math.nan if value is None else float(value)))
            self.evals_seen += 1
        elif e.name == "signalled":
            self.signalled = str(e.get("reason"))
        elif (
            e.name == "step_skipped" and whole and type(e["skipped"]) is int
        ):  # a job's record: only what describe() needs is checked
            self.skipped = e["skipped"]
        if e.name in ("oom", "oom_recovered"):
            self.ooms += 1
        text = describe(e)
        if request is not None and e.name != "control_refused":
            text = f"✓ {text} · applied after step {e.step}, {e.get('latency_s', 0) * 1000:.0f} ms after the request"
        entry = Entry(e.t, e.step, text, KINDS.get(e.name, "applied" if request else "info"))
        if e.name == "plan" and request is None and self.timeline and self.timeline[0] is self._filling:
            entry.kind = self.timeline[0].kind  # the same table filling in over a few boundaries: one line
            self.timeline[0] = entry
            self.entries += 1
        else:
            self._log(entry)
        if e.name == "plan":
            self._filling = None if e.get("complete", True) else entry

    def _log(self, entry: Entry) -> None:
        self.timeline.appendleft(entry)
        self.entries += 1

    @property
    def step(self) -> int:
        return self.latest.step if self.latest else 0

    def requested(self, request_id: int | None, text: str, action: str = "", value: Any = None) -> None:
        """The user asked for something: say so at once, before the loop applies it."""
        if request_id is None:
            return
        self.pending.add(request_id, text, action, value)
        self._log(
            Entry(time.time(), self.step, f"→ requested: {text} · applies at the next step boundary", "requested")
        )

    def script_ended(self, code: int, failure: str | None) -> None:
        self.exit_code, self.failure = code, failure
        self.ended = self.ended or self.clock()
        if failure and not (self.summary and self.summary.error):  # fit's own error event said it
            first = failure.strip().splitlines()[-1] if failure.strip() else "the script failed"
            self._log(Entry(time.time(), self.step, first, "error"))

    # -- the run, as the panels ask for it ----------------------------------------------------------
    @property
    def name(self) -> str:
        """The script, as the header names it (an attached job's comes from its argv)."""
        argv = self.info.argv if self.info else ()
        name = os.path.basename(argv[0]) if argv and (self.remote or not self.script) else self.script
        pid = self.info.pid if self.info else 0
        return f"{name} · pid {pid}" if self.remote and pid else name or "…"

    @property
    def device_name(self) -> str:
        return self.info.device_name if self.info else ""

    @property
    def rank(self) -> tuple[int, int] | None:
        """(rank, world size) of one rank of a torchrun job, whose every rank is its own run; None for one process."""
        return (self.info.rank, self.info.world_size) if self.info and self.info.world_size > 1 else None

    @property
    def job_ranks(self) -> tuple[RankMemory, ...]:
        """Every rank of a torchrun job as the latest step's exchange gave them (a step late); () for one process."""
        return self.latest.ranks if self.latest else ()

    def ranks(self, lines: int) -> Ranks | None:
        """The job's ranks in at most `lines` lines (Ranks.pick()); None for one process."""
        ranks = self.job_ranks
        return Ranks.pick(ranks, self.rank[0] if self.rank else None, lines) if ranks else None

    @property
    def observed(self) -> bool:
        """The script runs its own loop (gputui watches it): no batch, AMP or checkpointing of its own."""
        return self.info is not None and self.info.observed

    @property
    def total_steps(self) -> int | None:
        return self.info.total_steps if self.info else None

    @property
    def epochs(self) -> int | None:
        return self.info.epochs if self.info else None

    @property
    def amp(self) -> str | None:
        """The mixed precision in use (None before the run says)."""
        return self._setting("amp", self.latest.amp if self.latest else self.info.amp if self.info else None)

    @property
    def checkpointing(self) -> bool:
        now = self.latest.checkpointing if self.latest is not None else bool(self.info and self.info.checkpointing)
        return bool(self._setting("checkpointing", now))

    @property
    def pieces(self) -> tuple[int, int, int] | None:
        """(micro-batch, accumulation, global batch) in use (None before the first step's record)."""
        s = self.latest
        if s is None:
            return None
        return (*self._setting("pieces", (s.micro_batch, s.accumulation)), s.batch_size)

    @property
    def micro_batch(self) -> int | None:
        return self.pieces[0] if self.pieces else None

    def _setting(self, name: str, recorded: Any) -> Any:
        """A setting as the last step's record says it, or as a change applied after that record says it."""
        seen, value = self.changed.get(name, (-1, recorded))
        return value if seen == self.samples_seen else recorded

    @property
    def refused(self) -> Mapping[str, str]:
        """Control action -> why this run refuses it."""
        return self.info.refused if self.info else {}

    @property
    def training(self) -> bool:
        return self.info is not None and self.summary is None and self.exit_code is None

    @property
    def status(self) -> str:
        if self.banner:
            return self.banner
        if self.failure:
            return "failed"
        if self.summary is not None:
            return self.summary.outcome
        if self.exit_code is not None:
            return "finished"
        if self.info is None:
            return "starting"
        if self.waiting_oom is not None:
            return "OOM: waiting"
        if self.rank_waiting is not None:  # counted on from the event (the job says it once a threshold)
            e = self.rank_waiting
            return waiting_text(e, float(e["waited_s"]) + max(0.0, self.wall() - e.t))
        if self.stopping:
            return "stopping"
        if self.paused:
            return "paused"
        return "between steps" if self.between_steps else "training"

    @property
    def between_steps(self) -> bool:
        """The script works outside a step (evaluates, saves, runs between two fit calls) for a while."""
        return self.idle_since is not None and self.wall() - self.idle_since >= IDLE_S

    @property
    def elapsed(self) -> float:
        if self.summary is not None:
            return self.summary.elapsed_s
        if self.info is not None and self.info.started:  # wall clock: right for a job attached to long after
            return max(0.0, time.time() - self.info.started)
        if self.started is None:
            return 0.0
        return (self.ended or self.clock()) - self.started

    @property
    def eta(self) -> float | None:
        if self.status != "training":  # no rate while paused, waiting (an OOM, a rank), stopping or gone
            return None
        total, s = self.total_steps, self.latest
        if not total or s is None or not s.samples_per_s or not s.batch_size or not self.training:
            return None
        eta = (total - s.step) * s.batch_size / s.samples_per_s
        return eta if 0 <= eta < MAX_ETA else None  # a job's rate of 1e-300 samples/s is no duration

    def next_amp(self) -> str:
        # a mode this gputui does not know (a newer job's) steps to the first
        current = self.pending.once_applied(("set_amp",), self.amp) or "off"
        return AMP_MODES[(AMP_MODES.index(current) + 1) % len(AMP_MODES) if current in AMP_MODES else 0]
