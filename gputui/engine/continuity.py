"""One run per process: every fit() call and Trainer in a process is one run on screen, in the metrics
file and for attach clients.

A script that calls fit() once per evaluation interval, or opens a Trainer after a warm-up fit, means
one training run. So the first one starts the run and the script's end ends it (hub.finish); each one
after continues it (a `run_continued` event with its own length), and the run carries on:

    the step and sample counters     the screen, events and metrics count on
    a stop asked for                 `q` between two calls holds: every later call returns at once
    auto-recover                     a preference of the person at the keys
    what the run changed of its      what the keys chose or an OOM found, for the same model (another
    setting (micro-batch, AMP,       model has settings of its own; what no one changed is the next
    checkpointing), the planner's    call's arguments', and so is what the script passes differently
    predictions                      from its last call); the planner's predictions and calibration, so
                                     a call does not trace again what one traced

Each call's own figures are still its own (FitResult): the counters at its start are kept to tell.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..step.checkpointing import Checkpointing
from ..step.precision import Precision
from ..telemetry.hub import Hub
from ..telemetry.run import RunSummary
from .planhook import PlanningHook
from .state import RunState


@dataclass(frozen=True)
class Setting:
    """What a run changed of its setting (the keys, an OOM), for the next run on the same model; None: kept
    as it started (the next run's own arguments then hold)."""

    micro_batch: int | None | Unchanged
    amp: str | None
    checkpointing: bool | None
    planner: dict[str, Any] | None  # Predictions.state_dict(cache=True)
    arguments: tuple[Any, ...] | None = None  # the run's own (micro_batch, amp, checkpointing), "auto" as given


class Unchanged:
    """A micro-batch a run left as it started (None is a setting: the whole batch)."""


UNCHANGED = Unchanged()


class Carried:
    """What the runs of one hub hand on to the next; made with the first."""

    def __init__(self) -> None:
        self.started: float | None = None  # monotonic, when the first run started
        self.steps = self.samples = self.epochs = self.ooms_recovered = 0
        self.stop_reason: str | None = None
        self.auto_recover: bool | None = None
        self._model: weakref.ref[nn.Module] | None = None
        self._setting: Setting | None = None
        self._summary: RunSummary | None = None
        self._error: str | None = None

    def setting_for(self, model: nn.Module) -> Setting | None:
        """The setting the last run ended with, if it trained this same model."""
        if self._model is None or self._model() is not model:
            return None
        return self._setting

    def begin(self, hub: Hub) -> bool:
        """A run begins: True if it is the process's first (it starts the run; the others continue it)."""
        if self.started is not None:
            return False
        self.started = time.monotonic()
        hub.on_finish(lambda: self._finish(hub))
        return True

    def keep(
        self, model: nn.Module, setting: Setting, summary: RunSummary, error: str | None, totals: tuple[int, int]
    ) -> None:
        """A run ended: what the next one continues from; `totals`: the process's steps and samples so far."""
        self.steps, self.samples = totals
        self._model, self._setting = weakref.ref(model), setting
        self.stop_reason = self.stop_reason or summary.stopped
        self.epochs += summary.epochs
        self.ooms_recovered += summary.ooms_recovered
        self._summary, self._error = summary, error

    def _finish(self, hub: Hub) -> None:
        """The script ended: the run's end record, with the process's totals."""
        last = self._summary
        if last is None:
            return
        elapsed = time.monotonic() - (self.started or time.monotonic())
        hub.end(
            replace(
                last,
                steps=self.steps,
                samples=self.samples,
                epochs=self.epochs,
                ooms_recovered=self.ooms_recovered,
                stopped=self.stop_reason,
                elapsed_s=round(elapsed, 3),
                error=self._error,
            )
        )


class SettingNow:
    """The run's setting (micro-batch, AMP, checkpointing): what the keys and OOMs change, what one run
    hands the next on the same model and what a checkpoint resumes (gputui.Trainer.load_state_dict)."""

    def __init__(
        self,
        state: RunState,
        precision: Precision,
        checkpointing: Checkpointing,
        planning: PlanningHook,
        arguments: tuple[Any, ...],
    ) -> None:
        self.state, self.precision, self.checkpointing, self.planning = state, precision, checkpointing, planning
        self.started_with = self.now()  # the arguments' setting: what differs at the end is carried on
        self.arguments = arguments  # as the script gave them ("auto" is not the whole batch it may become)

    def now(self) -> tuple[int | None, str, bool]:
        return self.state.micro_batch, self.precision.mode, self.checkpointing.enabled

    def apply(self, micro_batch: Any, amp: str | None, checkpointing: bool | None) -> None:
        """A setting found before (an earlier run, a checkpoint), where this run can take it; UNCHANGED or
        None: this run's own."""
        if micro_batch is not UNCHANGED:
            self.state.micro_batch = micro_batch
            self.planning.auto_off()  # micro_batch="auto" has its answer
        if amp is not None and amp != self.precision.mode and self.precision.unsupported(amp) is None:
            self.precision.set(amp)
        ck = self.checkpointing
        if checkpointing is not None and checkpointing != ck.enabled and ck.unavailable() is None:
            ck.set(checkpointing)

    def take_up(self, setting: Setting | None) -> None:
        """The setting and the planner's predictions an earlier run on this model ended with, if any. An
        argument this run was given other than the earlier run's is the script's choice: it holds (a script
        that passes micro_batch=8 where its last call passed 16 means 8, whatever that run halved to)."""
        if setting is None:
            return
        micro_batch, amp, checkpointing = setting.micro_batch, setting.amp, setting.checkpointing
        if setting.arguments is not None:
            (mb0, amp0, ck0), (mb, amp_given, ck) = setting.arguments, self.arguments
            micro_batch = micro_batch if mb == mb0 else UNCHANGED
            amp = amp if amp_given == amp0 else None
            checkpointing = checkpointing if ck == ck0 else None
        self.apply(micro_batch, amp, checkpointing)
        self.planning.load_state_dict(setting.planner)

    def changed(self) -> Setting:
        """What this run changed of its setting, and what its planner learnt."""
        (mb0, amp0, ck0), (mb, amp, ck) = self.started_with, self.now()
        return Setting(
            mb if mb != mb0 else UNCHANGED,
            amp if amp != amp0 else None,
            ck if ck != ck0 else None,
            self.planning.state_dict(cache=True),
            self.arguments,
        )


_carried: weakref.WeakKeyDictionary[Hub, Carried] = weakref.WeakKeyDictionary()


def carried(hub: Hub) -> Carried:
    found = _carried.get(hub)
    if found is None:
        found = _carried[hub] = Carried()
    return found
