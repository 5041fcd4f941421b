"""The step boundary: the controls queued since the last step applied in order (each answered by an
event), the pause, and the stop a control or a signal asks for. Between two steps only, so a
remedy never lands inside an accumulation window."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..interrupts import notice, ours
from ..step.checkpointing import Checkpointing
from ..step.precision import Precision
from ..telemetry.controls import CHANGES, Control
from ..telemetry.hub import Hub
from .planhook import PlanningHook
from .session import RunSession
from .state import RunState


class Job(Protocol):
    """Under torchrun, what the last exchange said of the job (strategies/exchange.py's Agreement): a
    resize acts on the job's sizes, so every rank decides alike."""

    @property
    def ranks(self) -> Sequence[Any]: ...

    def job_sizes(self) -> tuple[int, int]: ...

    def resized(self, micro_batch: int) -> None: ...


REPEATED_SIGNAL_S = 2.0
"""Under torchrun a Ctrl-C reaches a rank twice (from the terminal, then passed on by torchrun): a
second signal this soon after the first is that one, not a request to stop at once."""


_HANDLERS = {
    "halve_batch": "_resize",
    "double_batch": "_resize",
    "set_amp": "_set_amp",
    "set_checkpointing": "_set_checkpointing",
    "set_auto_recover": "_set_auto_recover",
    "plan": "_plan",
    "stop": "_request_stop",
}
"""The method that applies each control, by name: a boundary holding its own bound methods would be a
cycle, keeping the run's optimizer and model (their memory on the device) alive after fit() until a
collection."""


class Boundary:
    def __init__(
        self,
        hub: Hub,
        session: RunSession,
        state: RunState,
        precision: Precision,
        checkpointing: Checkpointing,
        planning: PlanningHook,
        agreement: Job | None,
    ) -> None:
        self.hub, self.session, self.state = hub, session, state
        self.precision, self.checkpointing, self.planning = precision, checkpointing, planning
        self.agreement = agreement  # under torchrun: what the last exchange said of the job
        self.signal: str | None = None  # SIGINT's or SIGTERM's reason, set by the handler

    def passed(self, batch: Any) -> bool:
        """One process's boundary: apply every queued control; while paused, wait here (a plan asked
        for is made meanwhile, on `batch`). False: stop before the next step."""
        hub = self.hub
        if hub.controls.queued or self.session.paused:  # most boundaries: nothing to apply or wait for

            def apply() -> None:
                self.apply_queued()
                self.planning.paused(batch)

            apply()
            self.session.wait_while_paused(apply, self.stopping)
        if self.signal is None and hub.stop_signal is None:  # most boundaries: stopping() has nothing to take
            return self.state.stop_reason is None
        return not self.stopping()

    def signalled(self) -> str | None:
        """A stop signal: this thread's handler's, or the hub's (set where fit is not the main thread)."""
        return self.signal or self.hub.stop_signal

    def stopping(self) -> bool:
        signalled = self.signalled()
        state = self.state
        if signalled and not state.stop_reason:
            state.stop_reason = signalled
        return state.stop_reason is not None

    def apply_queued(self) -> list[Control]:
        """Apply what is queued, in order; returns the controls that changed something."""
        return self.apply_all(self.hub.controls.drain())

    def apply_all(self, controls: list[Control]) -> list[Control]:
        """Requests to free the cache are merged: one gc + empty_cache per boundary is all it takes,
        and each costs a full garbage collection."""
        applied, freed = [], False
        for control in controls:
            if control.action == "free_cache":
                if freed:
                    self.session.refuse(control, "the cache was freed at this boundary already")
                    continue
                freed = True
            if self._apply(control):
                applied.append(control)
        self.planning.changed(applied)
        return applied

    def _apply(self, control: Control) -> bool:
        """Apply one control; True if it changed something. Every request is answered by an event."""
        # Under torchrun the controls applied are the ones every rank agreed on, and so must be the stop: a
        # signal this rank alone has seen is agreed at the next exchange (refused here alone, ranks would part)
        stopping = self.state.stop_reason or (self.agreement is None and self.signalled())
        if control.action in CHANGES and stopping:
            return self.session.refuse(control, "the run is stopping after this step")
        applied = self.session.apply(control)
        if applied is not None:
            return applied
        handler: Callable[[Control], bool] = getattr(self, _HANDLERS[control.action])
        return handler(control)

    def _plan(self, control: Control) -> bool:
        return self.planning.asked(control)

    def _resize(self, control: Control) -> bool:
        state, agreement, sizing = self.state, self.agreement, self.state.sizing
        current, batch = state.micro_batch_now(), state.batch_size
        if agreement is not None and agreement.ranks:  # the job's (the largest rank's): every rank decides alike
            current, batch = agreement.job_sizes()
        if control.action == "halve_batch":
            why = sizing.why_not_halve(current)
            if why:
                return self.session.refuse(control, why)
            new = sizing.halved(current)
        else:
            if current >= batch:
                return self.session.refuse(control, f"the micro-batch already equals the global batch ({batch})")
            new = sizing.doubled(current, batch)
        details: dict[str, Any] = {"from": current, "to": new}
        self.session.emit("micro_batch_changed", control, **details, accumulation=state.accumulation_at(new))
        state.micro_batch = new
        if agreement is not None:
            agreement.resized(new)
        return True

    def _set_amp(self, control: Control) -> bool:
        value = control.value
        if value == self.precision.mode:
            return self.session.refuse(control, f"AMP is already {value}")
        reason = self.precision.unsupported(value)
        if reason:
            return self.session.refuse(control, reason)
        old = self.precision.mode
        self.precision.set(value)
        self.session.emit("amp_changed", control, **{"from": old, "to": value})
        return True

    def _set_checkpointing(self, control: Control) -> bool:
        if control.value == self.checkpointing.enabled:
            return self.session.refuse(control, f"checkpointing is already {'on' if control.value else 'off'}")
        self.checkpointing.set(control.value)
        self.session.emit("checkpointing_changed", control, enabled=control.value, how=self.checkpointing.how)
        return True

    def _set_auto_recover(self, control: Control) -> bool:
        if control.value == self.state.auto_recover:
            return self.session.refuse(control, f"auto-recover is already {'on' if control.value else 'off'}")
        self.state.auto_recover = control.value
        self.session.emit("auto_recover_changed", control, enabled=control.value)
        return True

    def _request_stop(self, control: Control) -> bool:
        self.state.stop_reason = "requested"
        return True

    # -- Ctrl-C and SIGTERM: finish the step, then stop ---------------------------------------
    def install_signals(self) -> Callable[[], None]:
        """The first signal stops after the current step; a second stops at once. Returns the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None  # the TUI's worker thread: the app handles keys, the runner signals
        names: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
        previous = {sig: signal.getsignal(sig) for sig in names}
        shared = self.agreement is not None
        first: list[float] = []

        @ours
        def handler(signum: int, frame: Any) -> None:
            if self.signal is not None:  # the second one: stop now
                if shared and time.monotonic() - first[0] < REPEATED_SIGNAL_S:
                    return  # torchrun passing on the Ctrl-C the terminal gave this rank already
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                raise SystemExit(128 + signum)
            self.signal = names[signum]
            first.append(time.monotonic())
            again = f"again after {REPEATED_SIGNAL_S:g} s" if shared else "again"
            notice(f"\ngputui: {self.signal}: finishing the current step, then stopping ({again} to stop at once)\n")

        for sig in names:
            signal.signal(sig, handler)

        def restore() -> None:
            for sig, prev in previous.items():
                signal.signal(sig, prev)

        return restore

    def error_of(self, exc: BaseException) -> str | None:
        """The run's error for an exception out of a step; None where it is a stop (stop_of), then the run's."""
        stop = stop_of(exc)
        if stop is None:
            return f"{type(exc).__name__}: {exc}"
        self.state.stop_reason = self.state.stop_reason or stop
        return None


def stop_of(exc: BaseException) -> str | None:
    """The stop an exception out of a step is (None: a failure): a second SIGTERM's SystemExit(143)
    (install_signals), a SystemExit(0) the script raised to end; the process ends with either, so the stop
    carried to a next part (continuity.py) stops nothing. A KeyboardInterrupt stays an error: a notebook's
    interrupt is caught, and the next fit() must train."""
    if isinstance(exc, SystemExit):
        if exc.code in (0, None):
            return "exited"
        if exc.code == 128 + signal.SIGTERM:
            return "terminated"
    return None
