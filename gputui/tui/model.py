"""What the screen shows, folded from the hub's samples and events. No textual, no torch.

The widgets only render a RunView; tests drive one with plain samples and events. A Source is
where the updates come from: the hub in this process (`gputui run`), later a socket (`attach`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..telemetry.controls import AMP_MODES
from ..telemetry.describe import BATCH_NORM_FLOOR, describe
from ..telemetry.history import RunSeries
from ..telemetry.hub import Hub
from ..telemetry.printable import printable
from ..telemetry.sample import Event, GpuReading, StepSample


@dataclass(frozen=True)
class Key:
    key: str
    action: str
    label: str
    help: str
    control: bool = True  # sends a control to the training loop (so it needs one running)


KEYS = (
    Key(
        "b",
        "halve_batch",
        "halve",
        "Halve the micro-batch: accumulation doubles, the global batch, sampler and LR schedule stay as they are.",
    ),
    Key("B", "double_batch", "double", "Double the micro-batch (up to the global batch): faster, more memory."),
    Key("a", "cycle_amp", "AMP", "Cycle mixed precision: off -> bf16 -> fp16 (with a GradScaler) -> off."),
    Key(
        "c",
        "toggle_checkpointing",
        "ckpt",
        "Activation checkpointing on the model's repeated blocks: "
        "recompute activations in backward instead of keeping them (less memory, ~30% more compute).",
    ),
    Key(
        "f",
        "free_cache",
        "free",
        "gc.collect() + torch.cuda.empty_cache(): return cached blocks to the "
        "device (helps other processes; adds no capacity to this one).",
    ),
    Key(
        "o",
        "toggle_auto_recover",
        "auto",
        "Auto-recover: on OOM halve the micro-batch and retry the same batch; off: pause and ask.",
    ),
    Key("p", "toggle_pause", "pause", "Pause after the current step / resume."),
    Key(
        "s",
        "snapshot",
        "snap",
        "CUDA memory snapshot: a pickle for pytorch.org/memory_viz and memory_summary() as text.",
    ),
    Key("t", "top_tensors", "tensors", "The live tensors grouped by shape, dtype and role, largest first."),
    Key("m", "memory", "memory", "Every memory reading, with what each one means.", control=False),
    Key("l", "log", "log", "The script's own output (stdout and stderr).", control=False),
    Key("question_mark", "help", "help", "This help.", control=False),
    Key("q", "quit", "quit", "Quit: asks first while training, then stops after the current step.", control=False),
)


@dataclass(frozen=True)
class Update:
    samples: list[StepSample]
    events: list[Event]
    info: dict[str, Any] | None
    summary: dict[str, Any] | None
    gpus: GpuReading | None
    runs: int
    reset: bool = False  # start the view over (a remote job, just (re)connected)
    history: dict[str, tuple[list[int], list[float], int]] | None = None  # the run so far, for a reset
    banner: str | None = None  # the connection's state, when it is not simply live


class Source(Protocol):
    watch_only: str | None
    """None if controls can be sent, else why not (shown on every dimmed remedy key)."""

    def poll(self) -> Update: ...
    def request(self, action: str, value: Any = None) -> int | None:
        """Send a control; returns its request id. RuntimeError with the reason if refused."""
        ...


class LocalSource:
    """The hub of this process: the script trains in a worker thread of the app."""

    watch_only = None

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._cursor = (0, 0)

    def poll(self) -> Update:
        samples, events, self._cursor = self.hub.since(self._cursor)
        poller = self.hub.gpu_poller
        return Update(
            samples,
            events,
            self.hub.info,
            self.hub.summary,
            poller.latest() if poller is not None else None,
            self.hub.runs,
        )

    def request(self, action: str, value: Any = None) -> int | None:
        return self.hub.controls.request(action, value, source="tui").id


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


@dataclass
class Entry:
    """One line of the timeline."""

    t: float
    step: int
    text: str
    kind: str  # requested, applied, refused, oom, error, info


@dataclass
class RunView:
    clock: Callable[[], float] = time.monotonic
    script: str = ""
    info: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    latest: StepSample | None = None
    first: StepSample | None = None
    gpus: GpuReading | None = None
    runs: int = 0
    series: RunSeries = field(default_factory=RunSeries)
    timeline: deque[Entry] = field(default_factory=lambda: deque(maxlen=500))
    pending: dict[int, str] = field(default_factory=dict)
    paused: bool = False
    auto_recover: bool = True
    stopping: bool = False
    waiting_oom: Event | None = None
    top: Event | None = None
    cuda_summary: str | None = None
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    failure: str | None = None  # the script's traceback, or why it could not start
    ooms: int = 0
    banner: str | None = None  # attach: disconnected, reconnecting, the job ended...
    remote: bool = False  # attached to a job in another process

    @property
    def name(self) -> str:
        """The script, as the header names it (an attached job's comes from its argv)."""
        info = self.info or {}
        argv = info.get("argv") or []
        name = os.path.basename(argv[0]) if argv and (self.remote or not self.script) else self.script
        return f"{name} · pid {info['pid']}" if self.remote and info.get("pid") else name or "…"

    # -- folding updates ------------------------------------------------------------------------
    def apply(self, update: Update) -> bool:
        """Fold an update in; True if anything changed (the widgets then re-render)."""
        changed = update.banner != self.banner
        self.banner = update.banner
        if update.runs != self.runs or update.reset:
            if update.reset:  # the job replays its recent events: start the timeline over too
                self.timeline.clear()
            self._new_run(update.runs)
            self.series.load(update.history or {})
            changed = True
        if update.info is not None and update.info is not self.info:
            self.info = update.info
            self.auto_recover = bool(update.info.get("auto_recover", True))
            changed = True
        for sample in update.samples:
            self._sample(sample)
        for event in update.events:
            self._event(event)
        if update.summary is not None and self.summary is None:
            self.summary = update.summary
            self.ended = self.ended or self.clock()
        if update.gpus is not self.gpus:
            self.gpus = update.gpus
            changed = True
        return changed or bool(update.samples or update.events or update.summary is not self.summary)

    def _new_run(self, runs: int) -> None:
        self.runs = runs
        self.info = self.summary = self.latest = self.first = self.waiting_oom = self.top = None
        self.ooms = 0
        self.series.clear()
        self.pending.clear()
        self.paused = self.stopping = False
        self.started, self.ended = self.clock(), None

    def _sample(self, s: StepSample) -> None:
        if self.first is None:
            self.first = s
        self.latest = s
        self.series.add(s)

    def _event(self, e: Event) -> None:
        request = e.get("request_id")
        if request is not None:
            self.pending.pop(request, None)
        if e.name == "paused":
            self.paused = True
        elif e.name == "resumed":
            self.paused = False
            self.waiting_oom = None
        elif e.name == "auto_recover_changed":
            self.auto_recover = bool(e["enabled"])
        elif e.name == "oom" and e.get("waiting"):
            self.waiting_oom = e
        elif e.name == "top_tensors":
            self.top = e  # the table is on its own screen; the timeline says the request was answered
        elif e.name == "memory_summary":
            self.cuda_summary = e.get("text")
        if e.name in ("oom", "oom_recovered"):
            self.ooms += 1
        kind = {
            "control_refused": "refused",
            "oom": "oom",
            "oom_recovered": "oom",
            "thrashing": "oom",
            "error": "error",
            "loss_not_finite": "error",
        }.get(e.name, "applied" if request else "info")
        text = describe(e)
        if request is not None and e.name != "control_refused":
            text = f"✓ {text} · applied after step {e.step}, {e.get('latency_s', 0) * 1000:.0f} ms after the request"
        self.timeline.appendleft(Entry(e.t, e.step, text, kind))

    def requested(self, request_id: int | None, text: str) -> None:
        """The user asked for something: say so at once, before the loop applies it."""
        if request_id is None:
            return
        self.pending[request_id] = text
        step = self.latest.step if self.latest else 0
        self.timeline.appendleft(
            Entry(time.time(), step, f"→ requested: {text} · applies at the next step boundary", "requested")
        )

    def script_ended(self, code: int, failure: str | None) -> None:
        self.exit_code, self.failure = code, failure
        self.ended = self.ended or self.clock()
        if failure and not (self.summary and self.summary.get("error")):  # fit's own error event said it
            first = failure.strip().splitlines()[-1] if failure.strip() else "the script failed"
            self.timeline.appendleft(Entry(time.time(), self.latest.step if self.latest else 0, first, "error"))

    # -- what the screen asks ---------------------------------------------------------------------
    @property
    def training(self) -> bool:
        return self.info is not None and self.summary is None and self.exit_code is None

    @property
    def status(self) -> str:
        if self.banner:
            return self.banner
        if self.failure or (self.summary and self.summary.get("error")):
            return "failed"
        if self.exit_code is not None or self.summary is not None:
            return "stopped" if self.summary and self.summary.get("stopped") else "finished"
        if self.info is None:
            return "starting"
        if self.waiting_oom is not None:
            return "OOM: waiting"
        if self.stopping:
            return "stopping"
        return "paused" if self.paused else "training"

    @property
    def elapsed(self) -> float:
        if self.summary is not None and self.summary.get("elapsed_s") is not None:
            return float(self.summary["elapsed_s"])
        started = (self.info or {}).get("started")
        if started:  # wall clock: right for a job attached to long after it began
            return max(0.0, time.time() - started)
        if self.started is None:
            return 0.0
        return (self.ended or self.clock()) - self.started

    @property
    def eta(self) -> float | None:
        total = (self.info or {}).get("total_steps")
        s = self.latest
        if not total or s is None or not s.samples_per_s or not s.batch_size or not self.training:
            return None
        return (total - s.step) * s.batch_size / s.samples_per_s

    @property
    def device(self) -> str:
        return (self.info or {}).get("device", "")

    def why_not(self, action: str, watch_only: str | None) -> str | None:
        """None if the key can act now, else the one-line reason shown when it is pressed."""
        key = next((k for k in KEYS if k.action == action), None)
        if key is None or not key.control:
            return None
        if watch_only:
            return watch_only
        if self.info is None:
            return "training has not started yet"
        if not self.training:
            return "training has ended"
        if self.info.get("mode") == "observe" and action not in (
            "free_cache",
            "snapshot",
            "top_tensors",
            "toggle_pause",
        ):
            return self.info.get("needs_fit") or "this needs gputui.fit"
        s = self.latest
        if action == "halve_batch" and s is not None and s.micro_batch <= 1:
            return "the micro-batch is already 1"
        if action == "halve_batch" and s is not None and s.micro_batch <= self.info.get("min_micro_batch", 1):
            return BATCH_NORM_FLOOR
        if action == "double_batch" and s is not None and s.micro_batch >= s.batch_size:
            return f"the micro-batch already equals the global batch ({s.batch_size})"
        if action == "toggle_checkpointing" and self.info.get("checkpointing_unavailable"):
            return self.info["checkpointing_unavailable"]
        if action == "snapshot" and not self.device.startswith("cuda"):
            return "memory snapshots are a CUDA feature (on this device: t shows the top tensors)"
        return None

    def next_amp(self) -> str:
        current = self.latest.amp if self.latest else (self.info or {}).get("amp", "off")
        return AMP_MODES[(AMP_MODES.index(current) + 1) % len(AMP_MODES)]

    @property
    def checkpointing(self) -> bool:
        if self.latest is not None:
            return self.latest.checkpointing
        return bool((self.info or {}).get("checkpointing"))
