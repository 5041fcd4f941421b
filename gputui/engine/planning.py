"""fit's what-if planner: the predicted peak of each remedy that applies now, and the micro-batch that fits.

Predictions are made on demand (the user opens the planner, an OOM, a step peak near capacity), never
continuously, at a step boundary on the training thread: a tracing thread beside training slowed the
step 19x in the study (the GIL passed back and forth each op). One boundary traces for at most
BOUNDARY_S; the rest of a table waits for the next ones, so a step is never held long (paused, no
step waits: the whole table at once). Each prediction
is cached by (setting, batch shapes). The prediction for the setting in use is compared with the step
peak then measured and the difference (allocator rounding, workspaces the trace cannot see) is added
to every prediction as `correction`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import plan
from ..step.microbatch import sizes
from ..telemetry.controls import AMP_MODES, Control
from ..units import format_bytes

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
PICK_TRACES = 8
"""At most this many predictions to find the largest micro-batch that fits (it is found in 3-4)."""


@dataclass(frozen=True)
class Setting:
    micro_batch: int
    amp: str
    checkpointing: bool


@dataclass(frozen=True)
class Row:
    """One option of the table: a remedy, its key on the screen, and the setting it would run."""

    remedy: str
    key: str | None
    setting: Setting


_KEYS = {"halve": "b", "double": "B", "amp": "a", "checkpointing": "c"}


class _Later(Exception):
    """The tracing time is spent: the rest of a table waits for the next boundary; a search says the
    largest micro-batch it had found to fit by then (`fits`), if any."""

    def __init__(self, fits: int | None = None) -> None:
        super().__init__(fits)
        self.fits = fits


class NoPrediction(Exception):
    """Nothing to predict with: the step cannot be traced and no step has been measured to estimate from."""


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
        min_micro_batch: int,
        amp_unsupported: Callable[[str], str | None],
        emit: Callable[..., None],
        refuse: Callable[[Control, str], object],
        automatic: bool = True,
    ) -> None:
        self.model, self.optimizer, self.step, self.device = model, optimizer, step, device
        self.tracked = tracked
        self.fit_at = FIT_AT_TRACKED if tracked else FIT_AT
        self.checkpoint_modules = checkpoint_modules
        self.checkpointing_unavailable = checkpointing_unavailable
        self.blocks = blocks
        self.min_micro_batch = min_micro_batch
        self.amp_unsupported = amp_unsupported
        self.emit, self.refuse = emit, refuse
        self.automatic = automatic
        self.off: str | None = None  # why planning stopped for this run (a trace left what it cannot take back)
        self.correction = 0
        self.measured: int | None = None
        self._cache: dict[tuple[Setting, Hashable, int], plan.Prediction] = {}
        self._untraceable: dict[tuple[str, bool], str] = {}  # (amp, checkpointing) whose step cannot be traced
        self._breakdown: dict[str, int] | None = None  # a measured step's, for estimates
        self._measured_setting: Setting | None = None
        self._pending: tuple[str, list[Control]] | None = None  # (trigger, the requests) of a table under way
        self._planned: set[tuple[Setting, Hashable, int]] = set()  # settings whose table was made (near capacity: once)
        self._deadline: float | None = None  # while a table is traced at a boundary
        self._entries = len(optimizer.state)  # the optimizer's state entries at the last measured step
        self._said_correction: int | None = None  # the correction the last complete table carried
        self._near: set[Setting] = set()  # settings whose peak came near capacity (planned once each)

    # -- single predictions -----------------------------------------------------------------
    def prediction(self, setting: Setting, batch: Any, shapes: Hashable) -> plan.Prediction | None:
        """The cached or new prediction for `setting` on a batch of `shapes`; None when the step cannot
        be traced and no step has been measured yet to estimate from."""
        key = self._key(setting, shapes)
        found = self._cache.get(key)
        if found is not None:
            return found
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise _Later
        prediction = None
        mode = (setting.amp, setting.checkpointing)  # a step may trace as one and not as another
        if mode not in self._untraceable and self.off is None:
            try:
                prediction = plan.predict(
                    self.model,
                    self.optimizer,
                    batch,
                    self.step,
                    micro_batch=setting.micro_batch,
                    amp=setting.amp,
                    checkpointing=setting.checkpointing,
                    device=self.device,
                    checkpoint_modules=self.checkpoint_modules,
                    min_micro_batch=self.min_micro_batch,
                )
            except plan.Untraceable as exc:
                self._untraceable[mode] = str(exc)
            except plan.Unsafe as exc:
                self._turn_off(str(exc))
            except Exception as exc:  # the model's code on fake tensors: whatever it raises, training goes on
                self._untraceable[mode] = f"the step cannot be traced ({plan.line(exc)})"
        if prediction is None:
            if self._breakdown is None or self._measured_setting is None:
                return None
            m = self._measured_setting
            prediction = plan.estimate(
                self._breakdown,
                m.micro_batch,
                m.amp,
                m.checkpointing,
                micro_batch=setting.micro_batch,
                amp=setting.amp,
                checkpointing=setting.checkpointing,
                blocks=self.blocks,
                reason=self._untraceable.get(mode, "not traced"),
            )
        self._cache[key] = prediction
        return prediction

    def untraceable(self, setting: Setting) -> str | None:
        """Why `setting`'s step cannot be traced, if it cannot."""
        return self._untraceable.get((setting.amp, setting.checkpointing))

    def _key(self, setting: Setting, shapes: Hashable) -> tuple[Setting, Hashable, int]:
        """What a step's peak depends on: the setting, the batch's shapes, and whether the optimizer has
        made its state yet (before its first step the peak is where it makes it; after, it is held)."""
        return setting, shapes, len(self.optimizer.state)

    def peak(self, prediction: plan.Prediction) -> int:
        """A prediction as the run would measure it: the peak it is checked against, corrected."""
        return prediction.bytes_for(self.tracked) + (self.correction if prediction.exact else 0)

    def fits(self, prediction: plan.Prediction, capacity: int | None) -> bool | None:
        return None if capacity is None else self.peak(prediction) <= self.fit_at * capacity

    # -- the loop's calls -------------------------------------------------------------------
    def step_measured(self, setting: Setting, shapes: Hashable, peak: int | None, breakdown: dict[str, int]) -> None:
        """After each step: the calibration. Cheap when nothing was predicted for this setting."""
        entries = len(self.optimizer.state)
        if peak is None or entries != self._entries:  # the step that made the optimizer's state: not steady
            self._entries = entries
            return
        self.measured, self._measured_setting, self._breakdown = peak, setting, breakdown
        predicted = self._cache.get(self._key(setting, shapes))
        if predicted is not None and predicted.exact:
            self.correction = peak - predicted.bytes_for(self.tracked)
            said = self._said_correction
            if said is not None and abs(self.correction - said) > RECALIBRATE * peak:
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

    def _turn_off(self, reason: str) -> None:
        """No more traces this run (another would leave the same); said once, and every waiting request refused."""
        self.off = f"planning is off for this run: {reason}"
        self.emit("error", message=self.off)
        self.abandon(self.off)

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
        options: list[dict[str, Any]] = []
        complete = True
        self._deadline = None if paused else time.monotonic() + (ASKED_S if controls else BOUNDARY_S)
        try:
            for row in self.rows(now, total):
                try:
                    if row.remedy == "best":
                        best = self._best(now, batch, shapes, total, capacity)
                        if best is None:
                            continue
                        row = Row("best", None, best)
                    prediction = self.prediction(row.setting, batch, shapes)
                except _Later:
                    prediction = None
                if prediction is None:  # later, or once a step is measured to estimate from
                    complete = complete and paused
                    continue
                option = self.option(row, prediction, total, capacity)
                if row.remedy == "best" and row.setting == now:
                    option["label"] += " (as now)"
                options.append(option)
        finally:
            self._deadline = None
        if self._pending is None:  # turned off meanwhile: its requests are refused
            return
        if complete and not options and controls:
            why = self.untraceable(now) or "no prediction"
            return self.abandon(f"nothing to predict with: {why}, and no step measured yet to estimate from")
        # Rows as they come (a screen fills in); each request is answered by the complete table.
        table = dict(
            trigger=trigger,
            options=options,
            capacity=capacity,
            correction=self.correction,
            measured=self.measured,
            tracked=self.tracked,
            complete=complete,
        )
        for control in controls if complete and controls else [None]:
            self.emit("plan", control, **table)
        if complete:
            self._pending = None
            self._planned.add(self._key(now, shapes))
            self._said_correction = self.correction

    def rows(self, now: Setting, total: int) -> list[Row]:
        """The remedies that apply to `now`: the setting itself, each key's, and the best fit."""
        mb, floor = now.micro_batch, self.min_micro_batch
        rows = [Row("now", None, now)]
        if mb > floor:
            rows.append(Row("halve", "b", Setting(max(mb // 2, floor), now.amp, now.checkpointing)))
        if mb < total:
            rows.append(Row("double", "B", Setting(min(mb * 2, total), now.amp, now.checkpointing)))
        for mode in AMP_MODES:
            if mode != now.amp and self.amp_unsupported(mode) is None:
                rows.append(Row("amp", "a", Setting(mb, mode, now.checkpointing)))
        if self.checkpointing_unavailable is None:
            rows.append(Row("checkpointing", "c", Setting(mb, now.amp, not now.checkpointing)))
        rows.append(Row("best", None, now))
        return rows

    def option(self, row: Row, prediction: plan.Prediction, total: int, capacity: int | None) -> dict[str, Any]:
        s = row.setting
        return {
            "remedy": row.remedy,
            "key": row.key,
            "label": label(row.remedy, s, len(sizes(total, s.micro_batch, self.min_micro_batch))),
            "micro_batch": s.micro_batch,
            "accumulation": len(sizes(total, s.micro_batch, self.min_micro_batch)),
            "amp": s.amp,
            "checkpointing": s.checkpointing,
            "peak": self.peak(prediction),
            "predicted": prediction.bytes_for(self.tracked),
            "phase": prediction.phase,
            "exact": prediction.exact,
            "reason": prediction.reason,
            "fits": self.fits(prediction, capacity),
            "seconds": round(prediction.seconds, 3),
            "breakdown": dict(prediction.breakdown),
        }

    def _best(self, now: Setting, batch: Any, shapes: Hashable, total: int, capacity: int | None) -> Setting | None:
        """The largest micro-batch predicted to fit as now; failing that, with checkpointing, then AMP."""
        if capacity is None:
            return None
        ck_options = [now.checkpointing] + ([True] if self.checkpointing_unavailable is None else [])
        amp_options = [now.amp] + [m for m in ("bf16", "fp16") if m != now.amp and self.amp_unsupported(m) is None][:1]
        try:
            for amp in amp_options:
                for ck in dict.fromkeys(ck_options):
                    found = self.largest(amp, ck, self.min_micro_batch, total, batch, shapes, capacity)
                    if found is not None:
                        return Setting(found, amp, ck)
        except NoPrediction:
            pass
        return None

    def largest(self, amp: str, ck: bool, lo: int, hi: int, batch: Any, shapes: Hashable, capacity: int) -> int | None:
        """The largest micro-batch in [lo, hi] predicted to fit; None: not even `lo`. NoPrediction: none made.
        The peak grows about linearly with the micro-batch: the guess interpolates, then checks its neighbour."""

        def peak(m: int) -> int:
            p = self.prediction(Setting(m, amp, ck), batch, shapes)
            if p is None:
                raise NoPrediction
            return self.peak(p)

        limit = self.fit_at * capacity
        p_hi = peak(hi)
        if p_hi <= limit:
            return hi
        p_lo = peak(lo)
        if p_lo > limit:
            return None
        try:
            for _ in range(PICK_TRACES):
                if hi - lo <= 1:
                    break
                guess = lo + int((limit - p_lo) * (hi - lo) / max(p_hi - p_lo, 1))
                guess = min(max(guess, lo + 1), hi - 1)
                p = peak(guess)
                if p <= limit:
                    lo, p_lo = guess, p
                else:
                    hi, p_hi = guess, p
        except _Later:
            raise _Later(lo) from None
        return lo

    def after_oom(self, failed: Setting, batch: Any, shapes: Hashable, capacity: int | None) -> tuple[int, str] | None:
        """The micro-batch to retry with after an OOM at `failed`, and why; None: halve as before (also
        where the planner does not plan by itself)."""
        if capacity is None or failed.micro_batch <= self.min_micro_batch or not self.plans_itself:
            return None
        self._deadline = time.monotonic() + OOM_S
        try:
            found = self._after_oom(failed, batch, shapes, capacity)
            return None if self.off else found  # turned off on the way: halving, as said
        except _Later as later:  # out of time: what was found to fit, if it beats halving
            half = max(failed.micro_batch // 2, self.min_micro_batch)
            if later.fits is None or later.fits < half:
                return None
            return later.fits, f"the largest predicted to fit that {OOM_S:g} s of tracing found ({later.fits})"
        except NoPrediction:
            return None
        finally:
            self._deadline = None

    def oom(self, failed: Setting, batch: Any, shapes: Hashable, capacity: int | None) -> None:
        """Paused at an OOM (auto-recover off): what it teaches, and a table for the dialog."""
        if not self.plans_itself:
            return
        if capacity is not None:
            self._learn(failed, batch, shapes, capacity)
        self.ask("oom")

    def _learn(self, failed: Setting, batch: Any, shapes: Hashable, capacity: int) -> plan.Prediction | None:
        """The prediction at the failed setting; one that says it fits was low by at least what it missed
        capacity by, and the correction grows to say so."""
        p = self.prediction(failed, batch, shapes)
        if p is not None and p.exact and self.peak(p) <= capacity:
            self.correction = capacity - p.bytes_for(self.tracked) + 1
        return p

    def _after_oom(self, failed: Setting, batch: Any, shapes: Hashable, capacity: int) -> tuple[int, str] | None:
        if self._learn(failed, batch, shapes, capacity) is None:
            return None
        # Halving's size first: if it fits, the search is above it and a search cut short still beats halving.
        half = max(failed.micro_batch // 2, self.min_micro_batch)
        fits_half = self.largest(failed.amp, failed.checkpointing, half, half, batch, shapes, capacity) is not None
        lo, hi = (half, failed.micro_batch - 1) if fits_half else (self.min_micro_batch, half - 1)
        found = self.largest(failed.amp, failed.checkpointing, lo, hi, batch, shapes, capacity) if lo <= hi else None
        if found is None:
            return None
        chosen = self.prediction(Setting(found, failed.amp, failed.checkpointing), batch, shapes)
        assert chosen is not None
        how = "predicted" if chosen.exact else "estimated"
        peak = format_bytes(self.peak(chosen))
        return found, f"{how} peak {peak} of {format_bytes(capacity)} at {found}: the largest that fits"


def label(remedy: str, s: Setting, accumulation: int) -> str:
    settings = f"{s.micro_batch}x{accumulation}"
    if remedy in ("halve", "double"):
        return f"micro-batch {settings}"
    if remedy == "amp":
        return f"AMP {s.amp}"
    if remedy == "checkpointing":
        return f"checkpointing {'on' if s.checkpointing else 'off'}"
    extras = [x for x in (s.amp if s.amp != "off" else "", "ckpt" if s.checkpointing else "") if x]
    return " ".join([settings, *extras]) if remedy == "best" else "as now"
