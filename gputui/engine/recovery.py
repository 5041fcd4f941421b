"""What follows an out-of-memory error: drop the attempt, the micro-batch to retry at (the user's
remedy when auto-recover is off), the allocator's thrashing watched, or the run's end (its words in
endings.py). The strategies decide when (which rank, which phase); this decides what."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch

from ..telemetry.controls import BATCH_NORM_FLOOR, REMEDIES
from ..units import format_bytes
from .boundary import Boundary
from .endings import Endings, holes
from .oom import Buffers, Generators, OomInfo, drop
from .planhook import PlanningHook
from .result import Failure, FitError, add_note, first_line
from .session import RunSession
from .state import RunState

MAX_RETRIES = 16
"""OOMs in a row on one global batch before the run ends: a guard against remedies that do not help."""

THRASHING_STEPS = 3
"""Readings in a row with new allocator retries (at least one every two steps) before a pre-emptive
halving."""


class Recovery:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        generators: Generators,
        buffers: Buffers,
        session: RunSession,
        state: RunState,
        boundary: Boundary,
        planning: PlanningHook,
        *,
        shared: bool,
    ) -> None:
        self.optimizer, self.generators, self.buffers = optimizer, generators, buffers
        self.session, self.state, self.boundary, self.planning = session, state, boundary, planning
        self.shared = shared
        self.endings = Endings(session, state)  # the words a run ends with when a step cannot be trained on
        self.thrashing = False  # this rank's allocator thrashed since its last exchange (torchrun)
        self._retries: tuple[int, int, int, int] | None = None
        """At the last reading: the allocator's retries, readings in a row they grew, the steps those
        span, the step."""

    def no_budget_left(self) -> str | None:
        """Why no batch can fit before the first: the parameters and optimizer state pass the budget."""
        tracker, budget = self.session.tracker, self.session.budget
        if tracker is None or budget is None or tracker.total <= budget:
            return None
        return (
            f"the memory budget ({format_bytes(budget)}) is smaller than the model's "
            f"parameters and optimizer state ({format_bytes(tracker.total)}): no batch can fit"
        )

    def caught(self, exc: Exception, phase: str, size: int) -> OomInfo:
        """An OOM out of a step: the message kept, the frames let go (and a snapshot while the failed
        attempt's tensors are still alive, when history is recorded)."""
        if self.session.memory_history:
            self.session.snapshot("oom")
        return OomInfo(phase, drop(exc), size, self.state.baseline)

    def drop_step(self) -> None:
        """After an OOM: no gradient, no cached block, no counted byte, no draw from a generator and no
        running-statistics update of the failed attempt survives (no full gc either, unless device
        memory is still held: Probe.after_oom)."""
        for part in self._undo():
            part()

    def drop_failed_step(self, error: BaseException, first: Callable[[], Any] | None = None) -> None:
        """drop_step() after the script's own `error`, which stays the one raised (`first`: the strategy's own
        undo before it): a part that fails too (on a device the error broke, a CUDA device-side assert, every
        call does) is a note under it, and the parts after it still run (a script that catches the error
        trains on without the rest of the failed step)."""
        run_past_failures([first, *self._undo()] if first is not None else self._undo(), error, UNDO)

    def drop_for(self, failure: Failure | None) -> None:
        """drop_step() under torchrun on the way to the FitError every rank raises, this rank's `failure` said
        or to be said at an exchange: a part that fails (its device broken by the failure) is one of the
        failure's notes, under that FitError, not an error in its place. No failure: drop_step()."""
        if failure is None:
            self.drop_step()
            return
        for line in past_failures(self._undo(), UNDO):
            if line not in failure.notes:
                failure.notes.append(line)

    def dropped(self, error: FitError) -> FitError:
        """`error`, raised by this rank after its failed step, that step undone first (drop_failed_step)."""
        self.drop_failed_step(error)
        return error

    def _undo(self) -> list[Callable[[], Any]]:
        session = self.session
        parts: list[Callable[[], Any]] = [
            partial(self.optimizer.zero_grad, set_to_none=True),
            self.generators.restore,
            self.buffers.restore,
        ]
        if session.tracker is not None:
            parts.append(session.tracker.reset)
        parts.append(partial(session.probe.after_oom, self.state.baseline))
        if self.shared:
            # A failed attempt's DDP/FSDP objects can sit in an old generation's cycle: one left to the
            # interpreter's exit is torn down after its process group and aborts the process (SIGABRT):
            # a whole collection, not the young generations' alone.
            parts.append(gc.collect)
        return parts

    def recover(self, oom: OomInfo, retries: int, batch: Any = None) -> bool:
        """Decide what follows an OOM; True: retry the batch. Raises FitError when the run must end.
        With the batch, the planner picks the largest micro-batch predicted to fit (under torchrun this
        rank's share: the exchange then brings every rank to the smallest pick); without it, halve."""
        state, session = self.state, self.session
        details: dict[str, Any] = {
            "phase": oom.phase,
            "message": oom.message,
            "micro_batch": oom.micro_batch,
            "attempt": retries,
            "allocated_before": oom.allocated_before,
            "leaked": max(0, session.probe.allocated() - oom.allocated_before),
        }
        if oom.phase == "optimizer":
            session.emit("oom", **details, recovered=False)
            raise FitError(
                f"out of memory inside optimizer.step() at step {state.steps + 1}: not safe to retry (the "
                "parameters may be partly updated), so training stops. Optimizer state does not shrink "
                "with the micro-batch: use a lighter optimizer, fewer trainable parameters or more "
                f"memory. [{oom.message}]"
            )
        if retries > MAX_RETRIES:
            session.emit("oom", **details, recovered=False)
            raise FitError(
                f"gave up after {MAX_RETRIES} out-of-memory errors in a row on the same batch "
                f"(last in {oom.phase}: {oom.message})"
            )
        if state.auto_recover:
            if oom.micro_batch <= 1:
                session.emit("oom", **details, recovered=False)
                raise FitError(
                    f"out of memory in {oom.phase} at micro-batch 1: not even one sample fits"
                    f"{holes(self.session)}. Try "
                    f"AMP (bf16), activation checkpointing, a shorter sequence or a smaller model ({oom.message})"
                )
            if oom.micro_batch <= state.sizing.floor:
                session.emit("oom", **details, recovered=False)
                raise FitError(
                    f"out of memory in {oom.phase} at micro-batch {oom.micro_batch}, and the model has "
                    f"BatchNorm layers: {BATCH_NORM_FLOOR}, so it cannot be halved again. Replace them "
                    "with GroupNorm or LayerNorm (they do not depend on the batch), or make room: AMP "
                    "(bf16), activation checkpointing, a smaller model or more memory (SyncBatchNorm only "
                    f"helps with the batch spread over several GPUs) ({oom.message})"
                )
            new, why = state.sizing.halved(oom.micro_batch), "halved"
            picked = self.planning.after_oom(oom, batch, second=retries > 1) if batch is not None else None
            if picked is not None:
                new, why = picked
            state.ooms_recovered += 1
            state.micro_batch = new
            session.emit(
                "oom_recovered",
                **details,
                micro_batch_to=new,
                accumulation=state.accumulation_at(new),
                batch_size=state.batch_size,
                reason=why,
            )
            return True
        # Auto-recover off: wait at this boundary for the user. A remedy or resume retries the batch.
        # With the batch (one process) the planner's table for the dialog is made first, and plans
        # asked for meanwhile are made while waiting.
        planning = batch is not None and self.planning.plans_itself()
        session.emit("oom", **details, recovered=False, waiting=True, planning=planning)
        session.paused = True
        session.emit("paused", reason="oom")
        if planning:
            self.planning.at_oom(oom, batch)

        def apply() -> None:
            for control in self.boundary.apply_queued():
                if control.action in REMEDIES or control.action == "set_auto_recover":
                    if session.paused:
                        session.paused = False
                        session.emit("resumed", reason=control.action)
                    session.hub.clear_rate()
            self.planning.paused(batch)

        apply()
        session.wait_while_paused(apply, self.boundary.stopping)
        if self.boundary.stopping():
            return False
        state.ooms_recovered += 1  # the user's remedy (or retry as it was): the run goes on from this OOM
        return True

    def watch_thrashing(self, retries: int, step: int) -> None:
        """The allocator retrying (freeing its whole cache, then allocating again) step after step
        is the slow road to an OOM; with auto-recover on, halve the micro-batch before it comes
        (under torchrun, said at the exchange, where every rank halves). `retries` is read after `step`:
        after every step, or on CUDA a few times a second (probes/cuda.py). Thrashing is retries grown
        in THRASHING_STEPS readings in a row, by at least one every two steps since the reading before
        (read every step: a retry in each of THRASHING_STEPS steps)."""
        last = self._retries
        if last is None:  # the run's first reading: nothing to compare it with
            self._retries = (retries, 0, 0, step)
            return
        before, readings, steps, at = last
        grew = 2 * (retries - before) >= max(1, step - at) and retries > before
        readings, steps = (readings + 1, steps + step - at) if grew else (0, 0)
        self._retries = (retries, readings, steps, step)
        if readings < THRASHING_STEPS:
            return
        self._retries = (retries, 0, 0, step)
        if self.shared:
            self.thrashing = True
            return
        state = self.state
        current = state.micro_batch_now()
        if state.auto_recover and state.sizing.can_halve(current):
            state.micro_batch = state.sizing.halved(current)
            self.session.emit(
                "thrashing",
                alloc_retries=retries,
                steps=steps,
                micro_batch=current,
                micro_batch_to=state.micro_batch,
                accumulation=state.accumulation_at(state.micro_batch),
            )

    # -- under torchrun: the words every rank ends with ---------------------------------------
    def alone(self, oom: OomInfo, attempt: int, rank: int, batch: Any) -> str | None:
        """An OOM before this rank's first collective of the step: replayed here at the planner's pick
        for this rank's share (or half), as one process would (None); what one process would end with
        (micro-batch 1, the retry cap) is returned, to be said at the exchange so every rank ends
        together. Auto-recover off ends the run too: the others wait in a collective, and a process
        group's timeout is no time to think."""
        try:
            if not self.state.auto_recover:
                self.session.emit(
                    "oom", phase=oom.phase, message=oom.message, micro_batch=oom.micro_batch, recovered=False
                )
                raise FitError(
                    f"out of memory in {oom.phase} at micro-batch {oom.micro_batch} with auto-recover off: under "
                    f"torchrun a rank cannot wait for a remedy while the others wait for it [{oom.message}]"
                )
            self.recover(oom, attempt, batch)
        except FitError as exc:
            return f"rank {rank}, step {self.state.steps + 1}: {exc}"
        return None


UNDO = "undo the failed step"


def run_past_failures(parts: Iterable[Callable[[], Any]], error: BaseException, what: str) -> None:
    """Each of `parts`, though one fails, while `error` is on its way out: on a device the error broke (a
    CUDA device-side assert) every call fails, and each failure is a note under `error`, not the error
    raised in its place."""
    for line in past_failures(parts, what):
        add_note(error, line)


def past_failures(parts: Iterable[Callable[[], Any]], what: str) -> list[str]:
    """Each of `parts`, though one fails: the lines saying what failed (`what`: what gputui could not do)."""
    lines = []
    for part in parts:
        try:
            part()
        except Exception as exc:
            lines.append(f"gputui could not {what} ({type(exc).__name__}: {first_line(exc)})")
    return lines
