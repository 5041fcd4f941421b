"""fit's what-if planner: the predicted peak of each remedy that applies now, and the micro-batch that fits.

Predictions are made on demand (the user opens the planner, an OOM, a step peak near capacity), never
continuously, at a step boundary on the training thread: a tracing thread beside training slowed the
step 19x in the study (the GIL passed back and forth each op). One boundary traces for at most
BOUNDARY_S; the rest of a table waits for the next ones, so a step is never held long (paused, no
step waits: the whole table at once). Each prediction is cached (predictions.py). The prediction for
the setting in use is compared with the step peak then measured and the difference (allocator rounding,
workspaces the trace cannot see) is added to every prediction as `correction`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from ..step.sizing import Sizing
from ..telemetry.controls import Control
from ..units import format_bytes
from .predictions import Later, NoPrediction, Predictions
from .table import Remedies, Row, Setting, option

FIT_AT = 0.9
"""A prediction fits below this share of a device's capacity: the margin covers what a trace cannot see
(fragmentation, workspaces beyond the correction); FSDP's prevention halves at the same line."""
FIT_AT_TRACKED = 0.98
"""The same under a CPU budget, which is checked against the count the trace predicts exactly."""
NEAR_CAPACITY = 0.85
"""A measured step peak past this share of capacity plans ahead (once per setting and batch shape)."""
BOUNDARY_S = 0.5
"""Tracing stops at a boundary once it has taken this long; the table goes on at the next one."""
ASKED_S = 2.0
"""The same for a table the user asked for and waits on (a T5's trace takes 0.6 s: one row a step was slow)."""
OOM_S = 2.0
"""Tracing after an OOM stops after this long and the micro-batch is halved instead (cached: an OOM at a
batch shape seen before costs no trace)."""
RECALIBRATE = 0.01
"""A correction that moved by more than this share of the measured peak since the last table sends it again."""


def _weakly(method: Callable[[str], None]) -> Callable[[str], None]:
    """`method`, called through a weak reference to its object: the predictions call the planner back, and
    holding it strongly would be a cycle keeping the model and the optimizer (their memory on the device)
    alive after fit() returns, until a collection."""
    ref = weakref.WeakMethod(method)

    def call(reason: str) -> None:
        bound = ref()
        if bound is not None:
            bound(reason)

    return call


class Planner:
    """Predictions for one fit run; `emit` and `refuse` are the session's. `automatic`: it traces by itself
    (after an OOM, near capacity, after a remedy), else only for a request (fit's `planning="asked"`).
    Every request waiting for a table is answered by it, or refused with the reason. Every call is made
    on the training thread."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: Callable[[nn.Module, Any], torch.Tensor],
        device: torch.device,
        *,
        tracked: bool,
        checkpoint_modules: Any,
        checkpointing_unavailable: str | None,
        blocks: int,
        sizing: Sizing,
        amp_unsupported: Callable[[str], str | None],
        emit: Callable[..., None],
        refuse: Callable[[Control, str], object],
        automatic: bool = True,
    ) -> None:
        self.predictions = Predictions(
            model,
            optimizer,
            step,
            device,
            tracked=tracked,
            fit_at=FIT_AT_TRACKED if tracked else FIT_AT,
            checkpoint_modules=checkpoint_modules,
            blocks=blocks,
            floor=sizing.floor,
            turned_off=_weakly(self._turned_off),
        )
        self.remedies = Remedies(sizing, amp_unsupported, checkpointing_unavailable)
        self.sizing, self.tracked = sizing, tracked
        self.emit, self.refuse = emit, refuse
        self.automatic = automatic
        self._pending: tuple[str, list[Control]] | None = None  # (trigger, the requests) of a table under way
        self._planned: set[tuple[Setting, Hashable, int]] = set()  # settings whose table was made (near capacity: once)
        self._said_correction: int | None = None  # the correction the last complete table carried
        self._near: set[Setting] = set()  # settings whose peak came near capacity (planned once each)

    @property
    def off(self) -> str | None:
        """Why planning stopped for this run (a trace left what it cannot take back), if it did."""
        return self.predictions.off

    # -- the loop's calls -------------------------------------------------------------------
    def step_measured(self, setting: Setting, shapes: Hashable, peak: int | None, breakdown: dict[str, int]) -> None:
        """After each step: the calibration. Cheap when nothing was predicted for this setting."""
        corrected = self.predictions.measured_step(setting, shapes, peak, breakdown)
        said = self._said_correction
        if corrected and said is not None and peak and abs(self.predictions.correction - said) > RECALIBRATE * peak:
            self.ask("calibrated")  # the table again, with what the run measured (cached: no trace)

    def near_capacity(self, setting: Setting, shapes: Hashable, peak: int | None, capacity: int | None) -> bool:
        """True (once per setting and shape) when a measured peak calls for a table."""
        if peak is None or not capacity or peak < NEAR_CAPACITY * capacity or setting in self._near:
            return False
        self._near.add(setting)  # once per setting: batches padded to their own length would plan at each
        return True

    def ask(self, trigger: str, control: Control | None = None) -> None:
        """Make the table at the next boundaries. A request joins those waiting (each gets the table); a
        table the planner makes by itself does not replace one asked for."""
        if control is None:
            if self.automatic and self.off is None and not (self._pending and self._pending[1]):
                self._pending = (trigger, [])
        elif self.off is not None:
            self.refuse(control, self.off)
        else:
            self._pending = ("asked", [*(self._pending[1] if self._pending else ()), control])

    @property
    def plans_itself(self) -> bool:
        """Whether an OOM gets a table without anyone asking."""
        return self.automatic and self.off is None

    def abandon(self, reason: str) -> None:
        """The run ends: each request still waiting is refused with `reason`."""
        for control in self._pending[1] if self._pending else ():
            self.refuse(control, reason)
        self._pending = None

    def _turned_off(self, reason: str) -> None:
        """No more traces this run: said once, and every waiting request refused."""
        self.emit("error", message=reason)
        self.abandon(reason)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def planned(self) -> bool:
        """A table was made this run (so the screen shows one that a new setting makes stale)."""
        return bool(self._planned)

    def work(
        self, now: Setting, batch: Any, shapes: Hashable, total: int, capacity: int | None, paused: bool = False
    ) -> None:
        """At a boundary: trace the table's rows for up to BOUNDARY_S (ASKED_S for a request), emit what is
        known. `paused`: no step waits, so the whole table at once, and no step will be measured to estimate
        the rows that cannot be traced from: the table is what can be predicted now."""
        if self._pending is None:
            return
        trigger, controls = self._pending
        predictions = self.predictions
        options: list[dict[str, Any]] = []
        complete = True
        predictions.deadline = None if paused else time.monotonic() + (ASKED_S if controls else BOUNDARY_S)
        try:
            for row in self.remedies.rows(now, total):
                try:
                    if row.remedy == "best":
                        best = self._best(now, batch, shapes, total, capacity)
                        if best is None:
                            continue
                        row = Row("best", best)
                    prediction = predictions.get(row.setting, batch, shapes)
                except Later:
                    prediction = None
                if prediction is None:  # later, or once a step is measured to estimate from
                    complete = complete and paused
                    continue
                options.append(
                    option(
                        row,
                        prediction,
                        peak=predictions.peak(prediction),
                        predicted=prediction.bytes_for(self.tracked),
                        fits=predictions.fits(prediction, capacity),
                        accumulation=self.sizing.accumulation(total, row.setting.micro_batch),
                        total=total,
                    )
                )
                if row.remedy == "best" and row.setting == now:
                    options[-1]["label"] += " (as now)"
        finally:
            predictions.deadline = None
        if self._pending is None:  # turned off meanwhile: its requests are refused
            return
        if complete and not options and controls:
            why = predictions.untraceable(now) or "no prediction"
            return self.abandon(f"nothing to predict with: {why}, and no step measured yet to estimate from")
        # Rows as they come (a screen fills in); each request is answered by the complete table.
        table = dict(
            trigger=trigger,
            options=options,
            capacity=capacity,
            correction=predictions.correction,
            measured=predictions.measured,
            tracked=self.tracked,
            complete=complete,
        )
        for control in controls if complete and controls else [None]:
            self.emit("plan", control, **table)
        if complete:
            self._pending = None
            self._planned.add(predictions.key(now, shapes))
            self._said_correction = predictions.correction

    def _best(self, now: Setting, batch: Any, shapes: Hashable, total: int, capacity: int | None) -> Setting | None:
        """The largest micro-batch predicted to fit as now; failing that, with checkpointing, then AMP."""
        if capacity is None:
            return None
        try:
            for amp, ck in self.remedies.fallbacks(now):
                found = self.predictions.largest(amp, ck, self.sizing.floor, total, batch, shapes, capacity)
                if found is not None:
                    return Setting(found, amp, ck)
        except NoPrediction:
            pass
        return None

    # -- after an OOM -----------------------------------------------------------------------
    def after_oom(
        self, failed: Setting, batch: Any, shapes: Hashable, capacity: int | None, second: bool = False
    ) -> tuple[int, str] | None:
        """The micro-batch to retry with after an OOM at `failed`, and why; None: halve (also
        where the planner does not plan by itself). `second`: the step ran out at a pick already, so
        the predictions are off by more than the margin here (on a GPU: fragmentation and segment
        rounding under a tight cap) and a pick above half would step down by that margin alone: half
        at most, so that a step takes log2 OOMs at worst (below half, the pick where half will not fit)."""
        if capacity is None or not self.sizing.can_halve(failed.micro_batch) or not self.plans_itself:
            return None
        half = self.sizing.halved(failed.micro_batch)
        self.predictions.deadline = time.monotonic() + OOM_S
        try:
            found = self._after_oom(failed, batch, shapes, capacity, half, second)
            return None if self.off else found  # turned off on the way: halving, as said
        except Later as later:  # out of time: what was found to fit, if it beats halving
            if later.fits is None or later.fits < half:
                return None
            return later.fits, f"the largest predicted to fit that {OOM_S:g} s of tracing found ({later.fits})"
        except NoPrediction:
            return None
        finally:
            self.predictions.deadline = None

    def oom(self, failed: Setting, batch: Any, shapes: Hashable, capacity: int | None) -> None:
        """Paused at an OOM (auto-recover off): what it teaches, and a table for the dialog."""
        if not self.plans_itself:
            return
        if capacity is not None:
            self.predictions.learn(failed, batch, shapes, capacity)
        self.ask("oom")

    def _after_oom(
        self, failed: Setting, batch: Any, shapes: Hashable, capacity: int, half: int, second: bool
    ) -> tuple[int, str] | None:
        predictions = self.predictions
        if predictions.learn(failed, batch, shapes, capacity) is None:
            return None
        amp, ck = failed.amp, failed.checkpointing
        # Halving's size first: if it fits, the search is above it (not after a second OOM) and a search
        # cut short still beats halving.
        fits_half = predictions.largest(amp, ck, half, half, batch, shapes, capacity) is not None
        lo, hi = (half, half if second else failed.micro_batch - 1) if fits_half else (self.sizing.floor, half - 1)
        found = predictions.largest(amp, ck, lo, hi, batch, shapes, capacity) if lo <= hi else None
        if found is None:
            return None
        chosen = predictions.get(Setting(found, amp, ck), batch, shapes)
        assert chosen is not None
        how = "predicted" if chosen.exact else "estimated"
        peak = format_bytes(predictions.peak(chosen))
        if second and found == half:
            return found, f"halved after a second OOM in this step ({how} peak {peak} of {format_bytes(capacity)})"
        return found, f"{how} peak {peak} of {format_bytes(capacity)} at {found}: the largest that fits"
