"""One run as the hub sees it, whoever drives its loop.

fit's core (core.py) and the zero-change observer (observe.py) each hold a RunSession and add only
what is theirs: fit changes how the next step trains, the observer watches a loop it cannot
change. Everything else lives here once: the memory probe built from the run's settings, the
controls that need no loop (free the cache, snapshot, memory summary, top tensors, pause and
resume), the one pause-wait, the counters, when the rate starts over, the host readings, the run's info and
summary, and the events that answer every request.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ..probes import snapshot
from ..probes.cpu import StateTracker
from ..probes.device import Probe, for_device
from ..probes.host import HOST_INTERVAL, read_host
from ..probes.tensors import top_training_tensors
from ..telemetry.controls import SUMMARY_NEEDS_CUDA, Control
from ..telemetry.events import check_event
from ..telemetry.hub import Hub
from ..telemetry.run import RunInfo, RunSummary
from ..telemetry.sample import Event, HostReading, Memory, RankMemory
from ..units import parse_size
from .result import SettingsError

DEFAULT_SNAPSHOT_DIR = "gputui-snapshots"
PAUSE_POLL_S = 0.25
"""How often a paused run looks at its stop flag between controls (a signal sets it without a notify)."""


def _nvml_view(hub: Hub, device: torch.device) -> Any:
    """NVML's view of this process on `device`, read from the GPU readings the hub carries."""
    from ..probes.cuda import NvmlView
    from ..probes.nvml import cuda_to_nvml_index, feed

    feed(hub)
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    index = cuda_to_nvml_index(device.index, cuda_uuid=str(uuid) if uuid else None)
    return None if index is None else NvmlView(hub, index, os.getpid())


class RunSession:
    """The run's shared state and the hub-facing half of its controls.

    The settings are the script's (fit's arguments); the command line's, carried by the hub's
    overrides, win over them here and nowhere else, so a flag means the same in both modes.
    `memory_budget` (or a CPU device) makes a StateTracker count the training state of
    `tracked` (a model or its parameters); `gpu_memory_limit` caps a CUDA device.
    """

    def __init__(
        self,
        hub: Hub,
        device: torch.device,
        *,
        tracked: torch.nn.Module | list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        memory_budget: int | str | None = None,
        gpu_memory_limit: int | str | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
        memory_history: bool = False,
        keep_events: bool = False,
        defer_errors: bool = False,
    ) -> None:
        o = hub.overrides
        self.hub, self.optimizer = hub, optimizer
        self._tracked = tracked
        budget = o.memory_budget if o.memory_budget is not None else memory_budget
        self.budget = parse_size(budget) if budget is not None else None
        self._limit = o.gpu_memory_limit if o.gpu_memory_limit is not None else gpu_memory_limit
        self.snapshot_dir = os.fspath(o.snapshot_dir or snapshot_dir or DEFAULT_SNAPSHOT_DIR)
        history = o.memory_history if o.memory_history is not None else memory_history
        self._history_asked = bool(history)
        self._defer_errors = defer_errors
        self._driver_refused: dict[str, str] = {}
        self.tracker: StateTracker | None = None
        self._on(device)
        self.steps = self.samples = 0
        self.paused = False
        self.events: list[Event] | None = [] if keep_events else None  # fit returns them; an own loop needs none
        self._host: HostReading | None = None
        self._host_t = 0.0
        self._t0 = time.monotonic()
        hub.clear_rate()  # a new run's rate: the script's setup before it is not training time
        self.replay_state: Callable[[], list[torch.Tensor]] = list
        """What fit keeps to replay a step (engine/oom.py), shown as gputui's in the top tensors."""

    def _on(self, device: torch.device) -> None:
        """What depends on the device, made for `device`: the probe (with the limit), NVML's view,
        the tracker (a CPU, or a budget), the history and what the device refuses."""
        self.device = device
        nvml = _nvml_view(self.hub, device) if device.type == "cuda" else None
        tracker = self.tracker
        if tracker is None and (device.type == "cpu" or self.budget is not None):
            tracker = StateTracker(self._tracked, self.optimizer, self.budget)
        elif tracker is not None and device.type != "cpu" and self.budget is None:
            tracker.close()  # the parameters left the CPU: the allocator counts from now on
            tracker = self.tracker = None
        self.unmet: SettingsError | None = None
        """A setting this run cannot apply, kept for later (`defer_errors`): the observer meets the
        first optimizer of a fit script too, whose model fit has yet to move to the GPU."""
        limit = parse_size(self._limit) if self._limit is not None else None
        try:
            self.probe: Probe = for_device(device, tracker, limit=limit, nvml=nvml)
        except ValueError as exc:
            if not self._defer_errors:
                if tracker is not None:
                    tracker.close()
                raise SettingsError(str(exc)) from None
            self.unmet = SettingsError(str(exc))
            self.probe = for_device(device, tracker, nvml=nvml)
        except BaseException:
            if tracker is not None:
                tracker.close()
            raise
        self.tracker = tracker
        self.memory: Memory | None = None
        """The probe's last reading after a step (the steps since carry it): its peak goes into the next
        exchange and the planner's calibration."""
        reason = snapshot.unavailable(device)
        self.memory_history = self._history_asked and reason is None
        if self.memory_history:
            snapshot.start_history(self)
        else:
            snapshot.stop_history(self)  # the parameters left CUDA
        self.refused = {"snapshot": reason} if reason else {}
        if device.type != "cuda":
            self.refused["memory_summary"] = SUMMARY_NEEDS_CUDA
        self.refused.update(self._driver_refused)

    def follow(self, device: torch.device) -> bool:
        """The parameters are on `device` now (a script that made its optimizer before `.cuda()`): the
        probe and what goes with it follow them. True if they moved."""
        if device == self.device:
            return False
        self._on(device)
        return True

    def close_tracker(self) -> None:
        """Stop counting (the run ended, or fit took over and counts its own)."""
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def close(self) -> None:
        """The run is over (ended, or gone before it began): stop counting, stop the history it started,
        and lift what the probe set for the process (a CUDA cap would otherwise hold for the evaluation
        after fit, a second fit, the rest of the process)."""
        self.close_tracker()
        snapshot.stop_history(self)
        self.probe.close()

    # -- the run's two ends -----------------------------------------------------------------
    def start(self, *, mode: str, model: str, refused: dict[str, str], **fields: Any) -> RunInfo:
        """Announce the run; `refused` adds the driver's own refusals to the device's."""
        self._driver_refused = dict(refused)
        self.refused.update(refused)
        params = self.parameters()
        self._t0 = time.monotonic()
        info = RunInfo(
            mode=mode,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            started=time.time(),
            argv=tuple(sys.argv),
            device=str(self.device),
            device_name=self.probe.name,
            model=model,
            params=sum(p.numel() for p in params if not is_lazy(p)),  # a Lazy module's: not made yet
            trainable=sum(p.numel() for p in params if p.requires_grad and not is_lazy(p)),
            optimizer=type(self.optimizer).__name__,
            memory_budget=self.budget,
            refused=dict(self.refused),
            unreadable=dict(getattr(self.probe, "unreadable", {})),
            **fields,
        )
        self.hub.start(info)
        over = self.probe.over_limit
        if over is not None:
            self.emit("memory_limit", limit=over["limit"], reserved=over["reserved"])
        if self._history_asked and not self.memory_history:  # said once, as a key says why it is dimmed
            self.emit("control_refused", action="memory_history", reason=self.refused["snapshot"])
        return info

    def end(self, summary: RunSummary) -> None:
        self.hub.end(summary)

    def continued(self, *, refused: dict[str, str], **fields: Any) -> None:
        """Announce a run that continues the process's (continuity.py): its length and setting."""
        self.refused.update(refused)
        self._t0 = time.monotonic()
        self.emit("run_continued", refused=dict(self.refused), **fields)

    def elapsed(self) -> float:
        """Seconds since the run started (a monotonic clock: a clock step does not move it)."""
        return round(time.monotonic() - self._t0, 3)

    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters, or (an own loop) the optimizer's as they are now: a group added
        later (`add_param_group`) counts."""
        if isinstance(self._tracked, torch.nn.Module):
            return list(self._tracked.parameters())
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # -- events -------------------------------------------------------------------------------
    def emit(self, name: str, control: Control | None = None, **details: Any) -> None:
        """Publish an event (of the closed set in telemetry/events.py); one answering `control` says so."""
        if control is not None:
            details.update(control.answer())
        check_event(name, details)
        event = Event(name, self.steps, details)
        if self.events is not None:
            self.events.append(event)
        self.hub.emit(event)

    def refuse(self, control: Control, reason: str) -> bool:
        self.emit("control_refused", control, action=control.action, value=control.value, reason=reason)
        return False

    # -- the controls that need no loop --------------------------------------------------------
    def apply(self, control: Control) -> bool | None:
        """Apply a control every run takes; True if it changed something, False if refused, None if
        it is the driver's to apply (the batch, AMP, checkpointing, auto-recover, stop)."""
        action = control.action
        if action in self.refused:
            return self.refuse(control, self.refused[action])
        if action == "free_cache":
            self.emit("cache_freed", control, **self.probe.free_cache())
        elif action == "pause":
            if self.paused:
                return self.refuse(control, "already paused")
            self.paused = True
            self.emit("paused", control)
        elif action == "resume":
            if not self.paused:
                return self.refuse(control, "not paused")
            self.paused = False
            self.hub.clear_rate()  # the pause is not training time
            self.emit("resumed", control)
        elif action == "snapshot":
            self.snapshot("requested", control)
        elif action == "memory_summary":
            self.emit("memory_summary", control, text=torch.cuda.memory_summary(self.device))
        elif action == "top_tensors":
            self.emit(
                "top_tensors",
                control,
                **top_training_tensors(self.parameters(), self.optimizer, self._tracked, self.replay_state()),
            )
        else:
            return None
        return True

    def snapshot(self, reason: str, control: Control | None = None) -> None:
        name, details = snapshot.take(self.snapshot_dir, self.device, self, step=self.steps, reason=reason)
        self.emit(name, control, **details)

    def wait_while_paused(self, apply: Callable[[], Any], stopping: Callable[[], bool]) -> None:
        """The one pause-wait: apply controls as they come until resumed or stopping."""
        while self.paused and not stopping():
            if self.hub.controls.wait(PAUSE_POLL_S):
                apply()

    # -- one step ----------------------------------------------------------------------------------
    def publish(
        self,
        t: float,
        *,
        epoch: int,
        loss: float | None,
        batch_size: int,
        micro_batch: int,
        accumulation: int,
        amp: str,
        checkpointing: bool,
        loss_source: str | None = None,
        ranks: tuple[RankMemory, ...] = (),
        grad_norm: float | None = None,
        exact: bool = False,
    ) -> Memory | None:
        """Publish the step just counted (`steps`, `samples`), ended at `t` (time.time()), with the memory
        after it: a new reading where the probe makes one (a few a second; `exact`: after every step, for
        a planner calibrating against each), else the last one again. Returns the new reading, or None.

        What is published is a row of the figures (StepSample's fields in order, in a list the hub fills
        the rates in), appended to the hub's rows; the hub makes its record at a flush, and its sample
        when a reader asks (telemetry/hub.py)."""
        now = time.monotonic()
        reading = self.probe.read() if exact else self.probe.step_reading(now)
        memory = self.memory = reading or self.memory
        assert memory is not None  # a probe's first step_reading reads
        if now - self._host_t >= HOST_INTERVAL:
            self._host, self._host_t = read_host(), now
        hub = self.hub
        hub.rows.append(
            [
                t,
                self.steps,
                epoch,
                loss,
                batch_size,
                micro_batch,
                accumulation,
                amp,
                checkpointing,
                None,  # samples per second: the hub's to fill in (telemetry/rate.py)
                memory,
                self.samples,
                self._host,
                loss_source,
                None,  # steps per second
                ranks,
                grad_norm,
            ]
        )
        if now >= hub.due:
            hub.flush(now)
        return reading
