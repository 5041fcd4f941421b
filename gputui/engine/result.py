"""What fit() returns, the error it raises when a run cannot go on, and under torchrun what a rank's
step failed with and what the ranks agreed (plain dataclasses: no torch)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from ..telemetry.run import RunSummary
from ..telemetry.sample import Event


@dataclass(frozen=True)
class FitResult:
    steps: int
    """Optimizer steps done."""
    epochs: int
    """Complete passes over the data."""
    samples: int
    """Samples trained on (a batch retried after an OOM counts once)."""
    micro_batch: int | None
    """The micro-batch at the end, after any halving."""
    loss: float | None
    """Loss of the last global batch."""
    events: list[Event] = field(default_factory=list)
    stopped: str | None = None
    """Why training ended early: "requested", "interrupted", "terminated"; None if it ran its course."""
    amp: str = "off"
    checkpointing: bool = False
    ooms_recovered: int = 0
    elapsed_s: float = 0.0
    rank: int = 0
    """This process's rank under torchrun (0 alone)."""
    world_size: int = 1
    """Processes training together (1 alone)."""

    def summary(self, error: str | None = None) -> RunSummary:
        """The record the run ends with (the metrics file's end line, the socket's, the screen's)."""
        return RunSummary(
            steps=self.steps,
            epochs=self.epochs,
            samples=self.samples,
            micro_batch=self.micro_batch,
            loss=self.loss,  # NaN kept for the summary line; the record's JSON has it null
            stopped=self.stopped,
            amp=self.amp,
            checkpointing=self.checkpointing,
            ooms_recovered=self.ooms_recovered,
            elapsed_s=round(self.elapsed_s, 3),
            error=error,
        )


class SettingsError(ValueError):
    """A setting cannot apply to this run (a GPU memory limit without a GPU): one line for the user,
    the same from fit()'s arguments and from the command line, in either mode."""


class FitError(RuntimeError):
    """Training cannot go on (OOM at micro-batch 1, OOM in optimizer.step, bad step() output...).

    The message is one line meant for the user; `result` holds what was done before it.
    """

    result: FitResult | None = None


@dataclass
class Failure:
    """What ended this rank's step: said at the exchange, then raised on every rank."""

    message: str
    oom: bool
    error: BaseException | None = None
    notes: list[str] = field(default_factory=list)
    """What gputui could not undo of the failed step, said under the FitError (Recovery.drop_for)."""


@dataclass
class Agreed:
    """What the exchange told every rank (the same on each)."""

    items: int
    """What the step's loss is a mean over, summed over all ranks: the global batch's samples, or the
    items fit(items=) counts in it (tokens). Each rank's gradient is weighted by its share of this."""
    all_have_batch: bool
    all_have_next: bool
    fatal: int
    fatal_oom: int
    fatal_ranks: list[int]
    stop: str | None
    failed: int = 0
    """Ranks whose synced backward failed (said by the exchange after it, ddp.py)."""
    failed_fatal: int = 0
    """Of those, ranks that cannot go on."""
    failed_ranks: list[int] = field(default_factory=list)
    marker: float | None = None
    """The reduced value of the gradient element the marker took (verdict.py), put back after it."""
    every: int = 0
    """Steps between two exchanges when no rank has anything to say (rank 0's proposal)."""
    closing: int = 0
    """Ranks whose run was closing (their last exchange): on a group shared with the steps' exchange (NCCL's
    gloo side group), one closing where others are not is a run that ended on one rank only."""
    closing_ranks: list[int] = field(default_factory=list)


def first_line(exc: BaseException) -> str:
    """An error's first line (a CUDA error's advice runs on for lines); its type where it says nothing."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def add_note(error: BaseException, line: str) -> None:
    """A line under an error that stays the one raised, once: a note (Python 3.11+), on stderr where there are
    none (not a warning: one turned into an error would replace the error it is about)."""
    if line in getattr(error, "__notes__", ()):
        return
    note = getattr(error, "add_note", None)
    if note is not None:
        note(line)
    else:
        sys.stderr.write(f"gputui: {line}\n")
