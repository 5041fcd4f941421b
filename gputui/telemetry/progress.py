"""The headless progress display: one line redrawn in place on a terminal, plain lines elsewhere.

What `python train.py` and `gputui run --headless` show: step, loss, micro-batch x
accumulation, memory, speed; events on lines of their own so they stay in the scrollback.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TextIO

from ..units import counted, format_bytes, format_count, format_pieces
from .describe import describe
from .hub import Hub, SinkFailed
from .run import RunInfo, RunSummary
from .sample import Event, StepRecord, StepSample


def render(sample: StepSample, info: RunInfo | None) -> str:
    """The progress line for one sample."""
    total = info.total_steps if info else None
    epochs = info.epochs if info else None
    step = f"step {sample.step}" + (f"/{total}" if total else "")
    epoch = f"epoch {sample.epoch + 1}" + (f"/{epochs}" if epochs else "")
    loss = "loss n/a" if sample.loss is None else f"loss {sample.loss:.4g}"
    batch = f"batch {format_pieces(sample.micro_batch, sample.accumulation, sample.batch_size)}"
    m = sample.memory
    label = "CPU" if m.device == "cpu" else m.device
    memory = f"{label} {format_bytes(m.allocated)}"
    if m.reserved is not None:
        memory += f" (reserved {format_bytes(m.reserved)})"
    if m.peak is not None:
        memory += f" peak {format_bytes(m.peak)}"
    if m.capacity is not None:
        memory += f" of {format_bytes(m.capacity)}"
    parts = [step, epoch, loss, batch, f"amp {sample.amp}"]
    if sample.checkpointing:
        parts.append("ckpt on")
    parts.append(memory)
    if sample.samples_per_s is not None:
        parts.append(f"{format_count(sample.samples_per_s)} samples/s")
    return " | ".join(parts)


class ProgressLine:
    """A telemetry sink writing to `stream` (stdout); redraws at most every `interval` seconds."""

    def __init__(self, stream: TextIO | None, *, interval: float | None = None) -> None:
        self.stream = stream
        try:
            self.tty = stream is not None and stream.isatty()
        except (AttributeError, ValueError):  # a stream without isatty, or a closed one
            self.tty = False
        self.interval = interval if interval is not None else (0.1 if self.tty else 2.0)
        self._info: RunInfo | None = None
        self._last_draw = 0.0
        self._pending: deque[StepRecord] = deque(maxlen=1)  # the newest step not drawn yet
        self.on_record = self._pending.append
        """A step, kept (a C call, no frame: the hub calls it for every step); flushed() draws it."""
        self._drawn = False  # a line without a newline is on the terminal
        self._first = True  # the next step is a part's first (a fit call's, a Trainer's): drawn at once
        self.quiet = False
        self._trainer: int | None = None  # the thread that starts the run: the one that prints with the script

    def _write(self, text: str) -> None:
        try:
            if self.stream is None:  # Python's sys.stdout when the process started with fd 1 closed
                raise ValueError("stdout is closed")
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError) as exc:  # a closed pipe must not stop training: the hub drops us, says so once
            error = getattr(exc, "strerror", None) or str(exc)
            raise SinkFailed(
                f"progress line: {error}; no more progress will be written", sink="progress", error=error
            ) from None

    def _clear(self) -> None:
        if self._drawn:
            self._write("\r\x1b[K")
            self._drawn = False

    def _draw(self, sample: StepSample) -> None:
        line = render(sample, self._info)
        if self.tty:
            width = shutil.get_terminal_size((120, 24)).columns - 1
            self._write("\r" + line[:width] + "\x1b[K")
            self._drawn = True
        else:
            self._write(line + "\n")
        self._last_draw = time.monotonic()
        self._pending.clear()

    def on_start(self, info: RunInfo) -> None:
        self._info = info
        self._trainer = threading.get_ident()
        # A script with its own loop prints its own progress: gputui adds nothing to its output.
        self.quiet = info.observed
        if self.quiet:
            return
        # Under torchrun one rank prints (rank 0): its batch, samples and speed are its share's.
        ranks = f" as rank {info.rank} of {info.world_size} (figures are this rank's)" if info.world_size > 1 else ""
        length = []
        if info.epochs:
            length.append(f"{info.epochs} epoch{'s' if info.epochs != 1 else ''}")
        if info.total_steps:
            length.append(f"{info.total_steps} steps")
        budget = f", budget {format_bytes(info.memory_budget)}" if info.memory_budget else ""
        self._write(
            f"gputui: training {info.model} ({format_count(info.params)} params) on {info.device_name}"
            f"{budget}{ranks}; {', '.join(length) or 'until the data ends'}; Ctrl-C stops after the current step\n"
        )

    def on_sample(self, sample: StepSample) -> None:
        self.on_record(StepRecord.of(sample))
        self.flushed()

    def flushed(self) -> None:
        """After the hub's flush: its newest step drawn if it is a part's first or the last drawing is
        `interval` old (its sample made only then), else kept for the next flush or the end."""
        pending = self._pending
        if self.quiet or not pending:
            return
        if self._trainer is not None and threading.get_ident() != self._trainer:
            # Steps the server thread flushed while the script works between steps (printing, perhaps):
            # the training thread draws them, never in the middle of one of the script's lines.
            return
        if self._first or time.monotonic() - self._last_draw >= self.interval:
            self._first = False
            self._draw(pending[0].sample())

    def on_event(self, event: Event) -> None:
        if self.quiet or event.name == "error":  # it surfaces as the exception fit() raises
            return
        if event.name == "plan" and not event.get("complete", True):  # its rows still coming: the whole table once
            return
        if event.name == "run_continued" and self._info is not None:  # "step N/M": the run's new total
            self._info = self._info.continued(event.details)
        if event.name == "part_ended":  # the script works on outside a step: its last step stays on screen
            self._last_line()
            self._first = True
            return
        self._clear()
        self._write(f"gputui: step {event.step} | {describe(event)}\n")
        if event.name == "oom" and event.get("waiting"):  # auto-recover off, and no screen to answer in
            pid = os.getpid()
            self._write(
                f"gputui: answer it from another terminal: gputui attach {pid} --control, or gputui ctl {pid} ...\n"
            )

    def _last_line(self) -> None:
        """The last step drawn (if the interval held it back), its line ended."""
        if self._pending:
            self._draw(self._pending[0].sample())
        self._clear() if not self.tty else self._write("\n" if self._drawn else "")
        self._drawn = False

    def on_end(self, summary: RunSummary) -> None:
        if self.quiet:
            return
        self._last_line()
        self._write(summary_line(summary) + "\n")


def summary_line(summary: RunSummary) -> str:
    """How a fit run ended: headless prints it then, the TUI when it closes (closing_lines)."""
    loss = "n/a" if summary.loss is None else f"{summary.loss:.4g}"
    recovered = f", {counted(summary.ooms_recovered, 'OOM')} recovered" if summary.ooms_recovered else ""
    how = {"stopped": f"stopped ({summary.stopped})", "finished": "done", "interrupted": "interrupted at once"}.get(
        summary.outcome, summary.outcome
    )
    return (
        f"gputui: {how}: {counted(summary.steps, 'step')}, {counted(summary.samples, 'sample')} in "
        f"{summary.elapsed_s:.1f}s; "
        f"last loss {loss}; micro-batch {summary.micro_batch}, amp {summary.amp}, "
        f"checkpointing {'on' if summary.checkpointing else 'off'}{recovered}"
    )


def saved_line(saved: Mapping[str, int]) -> str | None:
    """The files gputui.save wrote (path -> bytes), printed when the script has ended; None if none."""
    if not saved:
        return None
    return "gputui: saved " + ", ".join(f"{path} ({format_bytes(size)})" for path, size in saved.items())


def closing_lines(hub: Hub) -> list[str]:
    """What the TUI prints once it has given the terminal back: each fit run's end line, as headless
    printed it when the run ended (an own loop's run has none: the script prints its own), then the
    files saved, as headless prints them when the script has ended."""
    lines = [summary_line(summary) for info, summary in hub.ended if not info.observed]
    saved = saved_line(hub.saved)
    return lines if saved is None else [*lines, saved]
