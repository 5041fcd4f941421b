"""The planner as a run uses it: made the first time a prediction is asked for (a run that never needs
one never traces), fed each step's measured peak, asked at the boundary, after an OOM and for
micro_batch="auto". Nothing here may end a run: a planner that fails is said, and the run halves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..plan import NoPrediction, Planner, Setting
from ..plan.planner import NEAR_CAPACITY
from ..probes.cpu import CpuProbe
from ..step.checkpointing import Checkpointing
from ..step.microbatch import shapes
from ..step.precision import Precision
from ..telemetry.controls import Control
from ..telemetry.sample import Memory
from ..units import format_bytes
from .oom import OomInfo
from .session import RunSession
from .state import RunState

RESETTINGS = frozenset({"halve_batch", "double_batch", "set_amp", "set_checkpointing"})
"""The controls after which a plan made before is stale."""


class PlanningHook:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: Callable[[nn.Module, Any], torch.Tensor],
        device: torch.device,
        precision: Precision,
        checkpointing: Checkpointing,
        checkpoint_modules: Any,
        session: RunSession,
        state: RunState,
        *,
        auto_micro_batch: bool,
        mode: str,
        traceable: bool,
    ) -> None:
        self._make = lambda: Planner(
            model,
            optimizer,
            step,
            device,
            tracked=isinstance(session.probe, CpuProbe),
            checkpoint_modules=checkpoint_modules,
            checkpointing_unavailable=checkpointing.unavailable(),
            blocks=len(checkpointing.blocks),
            sizing=state.sizing,
            amp_unsupported=precision.unsupported,
            emit=session.emit,
            refuse=session.refuse,
            automatic=mode == "auto",
        )
        self.off = mode == "off"  # fit(planning="off"): the run never traces its step
        self.planner: Planner | None = None
        self.precision, self.checkpointing, self.session, self.state = precision, checkpointing, session, state
        self._auto_micro_batch = auto_micro_batch
        self._traceable = traceable  # a sharded step cannot be traced: no table made ahead there
        self._learnt: dict[str, Any] | None = None  # what an earlier run learnt, for the planner when made

    def get(self) -> Planner:
        if self.planner is None:
            self.planner = self._make()
            if self._learnt is not None:
                self.planner.predictions.load_state_dict(self._learnt)
        return self.planner

    def auto_off(self) -> None:
        """micro_batch="auto" has its answer already (a setting carried over or loaded)."""
        self._auto_micro_batch = False

    def state_dict(self, cache: bool = False) -> dict[str, Any] | None:
        """What the planner learnt (Predictions.state_dict), or what it was given and has yet to use."""
        if self.planner is None:
            learnt = self._learnt
            return None if learnt is None else {k: v for k, v in learnt.items() if cache or k != "cache"}
        return self.planner.predictions.state_dict(cache)

    def load_state_dict(self, learnt: dict[str, Any] | None) -> None:
        """Start from what an earlier run learnt: a resumed run, or the run before in this process."""
        self._learnt = learnt
        if learnt is not None and self.planner is not None:
            self.planner.predictions.load_state_dict(learnt)

    def abandon(self, reason: str) -> None:
        """The run ended: a request still waiting for its table is refused with `reason`."""
        if self.planner is not None:
            self.planner.abandon(reason)

    def paused(self, batch: Any) -> None:
        """Paused (by the user, or at an OOM): a plan asked for is made at once on `batch`, the one the
        next step trains (no step waits on it)."""
        planner, state = self.planner, self.state
        if self.session.paused and planner is not None and planner.pending and batch is not None:
            state.shapes = shapes(batch)
            planner.work(self.setting(), batch, state.shapes, state.batch_size, self.capacity(), paused=True)

    def plans_itself(self) -> bool:
        """Whether this run traces without being asked (planning="auto"): then an OOM's pause makes
        the dialog's table at once (the `oom` event tells the screen to wait for it)."""
        return self.get().plans_itself

    def at_oom(self, oom: OomInfo, batch: Any) -> None:
        """Paused at an OOM (auto-recover off): the table for the dialog, knowing the failed setting."""
        self.get().oom(self.setting(oom.micro_batch), batch, shapes(batch), self.capacity())

    def setting(self, micro_batch: int | None = None) -> Setting:
        size = self.state.micro_batch_now() if micro_batch is None else micro_batch
        return Setting(size, self.precision.mode, self.checkpointing.enabled)

    def capacity(self) -> int | None:
        """What the run may fill, as the probe says now (cuda.py: free + held, under the cap)."""
        return self.session.probe.capacity()

    # -- at the boundary --------------------------------------------------------------------
    def asked(self, control: Control) -> bool:
        """The plan control: answered at this boundary, once the batch is known."""
        fresh = self.planner is None
        planner = self.get()
        if fresh and self.session.memory is not None:
            # the table says what the last steps measured: read now, which also starts the planner's own
            # readings (every step's, from here) afresh, not with the steps since a reading a step made
            memory = self.session.memory = self.session.probe.read()
            self.measured(memory)
        planner.ask("asked", control)
        return True

    def changed(self, applied: list[Control]) -> None:
        """After the controls of a boundary: a table shown for the old setting is made again."""
        planner = self.planner
        if planner is not None and planner.planned and any(c.action in RESETTINGS for c in applied):
            planner.ask("changed")  # the remedies line keeps its predictions for the new setting

    def at_boundary(self, batch: Any) -> None:
        """The first batch of micro_batch="auto" starts at the largest micro-batch predicted to fit; a
        table asked for is traced here (a little each boundary), on the training thread."""
        if self._auto_micro_batch:
            self._auto_micro_batch = False
            self._choose_micro_batch(batch)
        planner = self.planner
        if planner is not None:
            self.state.shapes = shapes(batch)
            if planner.pending:
                s = self.state
                planner.work(self.setting(), batch, s.shapes, s.batch_size, self.capacity())

    def _choose_micro_batch(self, batch: Any) -> None:
        """micro_batch="auto": the largest predicted to fit; the whole batch where nothing can say."""
        state = self.state
        total = state.batch_size
        found, reason = self._auto_size(batch, total)
        state.micro_batch = None if found >= total else found
        details: dict[str, Any] = {"from": total, "to": found}
        self.session.emit("micro_batch_changed", **details, accumulation=state.accumulation_at(found), reason=reason)

    def _auto_size(self, batch: Any, total: int) -> tuple[int, str]:
        whole = "so the whole batch (OOM recovery will cut it)"
        capacity = self.capacity()
        if capacity is None:
            return total, f"auto: the device's capacity is unknown, {whole}"
        floor = self.state.sizing.floor
        try:
            predictions = self.get().predictions
            s = self.setting()
            found = predictions.largest(s.amp, s.checkpointing, floor, total, batch, shapes(batch), capacity)
            if found is None:
                return floor, "auto: no micro-batch is predicted to fit, so the smallest"
            chosen = predictions.get(self.setting(found), batch, shapes(batch))
        except NoPrediction:
            return total, f"auto: no prediction ({self.get().predictions.untraceable(self.setting())}), {whole}"
        except Exception as exc:  # a bug of ours must not stop a run that would train
            return total, f"auto: the planner failed ({type(exc).__name__}: {exc}), {whole}"
        assert chosen is not None
        how = "predicted" if chosen.exact else "estimated"
        peak = format_bytes(predictions.peak(chosen))
        return found, f"auto: {how} peak {peak} of {format_bytes(capacity)}, the largest that fits"

    # -- after an OOM, after a step ---------------------------------------------------------
    def after_oom(self, oom: OomInfo, batch: Any, second: bool = False) -> tuple[int, str] | None:
        """The planner's micro-batch after an OOM (`second` in its step: half at most); None (halve) when
        it cannot say. Never raises: a planner that fails must not turn a recoverable OOM into a crash."""
        capacity = self.capacity()
        if capacity is None:  # nothing to fit in: halve
            return None
        try:
            planner = self.get()
            picked = planner.after_oom(self.setting(oom.micro_batch), batch, shapes(batch), capacity, second)
            planner.ask("oom")  # the whole table, at the next boundaries
            return picked
        except Exception as exc:  # a bug of ours or the model's code on fake tensors: halve
            self.session.emit("error", message=f"the planner failed, halving instead: {type(exc).__name__}: {exc}")
            return None

    def after_step(self, memory: Memory) -> None:
        """A planner calibrates against each step; near capacity, one is made (where a step can be traced)."""
        near = memory.capacity and memory.peak and memory.peak >= NEAR_CAPACITY * memory.capacity
        if self.planner is not None or (near and self._traceable):
            self.measured(memory)

    def measured(self, memory: Memory) -> None:
        """The step just measured against its prediction; near capacity, a table is made ahead."""
        planner = self.get()
        setting, shape = self.setting(), self.state.shapes
        if memory.params is None:  # a CUDA reading has the allocator's totals only
            breakdown = planner.predictions.held_state()
        else:
            breakdown = {
                "parameters": memory.params,
                "gradients": memory.params,  # every trainable parameter has one at the peak
                "optimizer": memory.optimizer or 0,
            }
        breakdown["activations"] = max(0, (memory.peak or 0) - sum(breakdown.values()))
        planner.step_measured(setting, shape, memory.peak, breakdown)
        if planner.near_capacity(setting, shape, memory.peak, memory.capacity) and not planner.pending:
            planner.ask("near_capacity")
