"""Zero-change mode: watching a script that runs its own training loop.

gputui cannot change how such a loop trains, but it can see it: the loss of every backward()
on a scalar (unscaled when a GradScaler scaled it), every optimizer step (PyTorch's global
optimizer hooks), the samples and epochs of the DataLoader batches each step trained on
(fetched.py), the memory after each step, and the losses the script prints. At a step boundary
(after optimizer.step()) it applies what needs no loop: free the cache, snapshot, top tensors,
pause. An OOM that ends the script gets a diagnosis instead of a bare traceback. While
gputui.fit runs, the observer stands aside.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..probes.cpu import StateTracker, hidden_from_dynamo, unpack
from ..probes.tensors import top_training_tensors
from ..telemetry.hub import Hub
from ..telemetry.run import RunSummary
from ..telemetry.sample import finite
from .aside import Aside, innermost_hooks
from .deferred import DeferredLoss
from .diagnosis import remedies, user_frame
from .fetched import Fetched
from .oom import is_oom
from .patches import patches
from .result import first_line
from .session import RunSession

NEEDS_FIT = "the script runs its own loop: this needs gputui.fit (README: Adopting fit)"
"""Why the remedies that change how the loop trains are unavailable here."""


LOOP_ACTIONS = ("halve_batch", "double_batch", "set_amp", "set_checkpointing", "set_auto_recover", "plan")
"""The controls that change how the loop trains: an own loop refuses them (NEEDS_FIT)."""


class Observer:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.optimizer: torch.optim.Optimizer | None = None
        self.session: RunSession | None = None  # from the first optimizer on
        self.loss: float | None = None
        self.loss_source: str | None = None
        self.phase: str | None = None  # "optimizer" while optimizer.step() runs
        self.failed_in: str | None = None  # set when backward() raised
        self.amp = "off"
        self._losses: list[torch.Tensor] = []
        self._reader: tuple[str, DeferredLoss] | None = None  # the losses' device type, their reader
        self.unscaled: dict[int, torch.Tensor] = {}
        self._printed: tuple[float, str] | None = None
        self.batches = Fetched()
        self._backwards = 0
        self._claimed = 0  # the losses before another optimizer's step: its (a GAN's other model's)
        self._started = False
        self.fitting = False  # gputui.fit runs: it owns the loop, the observer stands aside (aside.py)
        self.stop_reason: str | None = None  # why gputui stopped the script (a signal, a request)
        self.hooks: tuple[Any, Any] | None = None  # the saved-tensor hooks around the script
        self.aside = Aside(self)

    @property
    def tracker(self) -> StateTracker | None:
        return self.session.tracker if self.session is not None else None

    # -- installing: every patch is undone on exit ----------------------------------------------
    @contextlib.contextmanager
    def installed(self) -> Iterator[Observer]:
        """Hooks on while the script runs, in the thread that runs it (saved-tensor hooks are per thread)."""
        patched = patches(self)  # first: what it reads can raise, and nothing is installed yet
        hooks = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
        for owner, name, patch in patched:
            setattr(owner, name, patch)
        self.hub.add_sink(self.aside)
        self.hooks = hidden_from_dynamo(self._pack), hidden_from_dynamo(unpack)
        try:
            with torch.autograd.graph.saved_tensors_hooks(*self.hooks):
                try:
                    yield self
                finally:
                    self.aside.step_back_in()  # a fit that failed before its part could end
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)
            for hook in hooks:
                hook.remove()
            self.hub.remove_sink(self.aside)
            if self.session is not None:
                self.session.close()

    def hide_hooks(self) -> None:
        """The script compiled something: from now on dynamo must not trace the saved-tensor hooks
        (probes.cpu.hidden_from_dynamo), so they are swapped in place for hidden ones, if they are
        still the innermost (torch.compile is called at a script's top level, outside any)."""
        if self.hooks is None or self.hooks[0] != self._pack or innermost_hooks() != self.hooks:
            return  # hidden already, not installed, or not the innermost
        hidden = hidden_from_dynamo(self._pack), hidden_from_dynamo(unpack)
        torch._C._autograd._pop_saved_tensors_default_hooks()
        torch._C._autograd._push_saved_tensors_default_hooks(*hidden)
        self.hooks = hidden

    # -- what the hooks see ----------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.fitting:
            return t
        if not self._backwards and self.amp == "off":
            self._note_autocast(t)
        return self.tracker.pack(t) if self.tracker is not None else t

    def _note_autocast(self, t: torch.Tensor) -> None:
        device = t.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            self.amp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "off")

    def note_backward(self, tensors: Any) -> None:
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            value = self.unscaled.pop(id(tensors), None)
            self._losses.append((value if value is not None else tensors).detach())
            self._backwards += 1

    def printed(self, value: float, style: str) -> None:
        """A loss the script printed (from the output parser)."""
        self._printed = (value, style)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]] if self.optimizer else []

    def found_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, device = optimizer, parameters_device(optimizer)
        # The command line's settings (the hub's overrides) apply here as they do in fit.
        self.session = RunSession(self.hub, device, tracked=self._params(), optimizer=optimizer, defer_errors=True)
        self._start_step()

    def _follow(self) -> RunSession:
        """The session, on the device the parameters are on now: a script may make its optimizer
        before model.cuda(), which moves the same parameters (the run's info, made at its first
        step, says where it trains; a later move changes the readings)."""
        assert self.session is not None and self.optimizer is not None
        self.session.follow(parameters_device(self.optimizer))
        return self.session

    def _start(self) -> None:
        """At the first step of the script's own loop (a fit script never gets here)."""
        assert self.session is not None
        if self.session.unmet is not None:  # e.g. --gpu-memory-limit, and this loop trains on a CPU
            raise self.session.unmet
        self._started = True
        self.session.start(
            mode="observe",
            model="own loop",
            refused=dict.fromkeys(LOOP_ACTIONS, NEEDS_FIT),
            amp="off",
            checkpointing=False,
            auto_recover=False,
        )

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is self.optimizer and not self.fitting:
            self.phase = "optimizer"

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.fitting:
            return
        if optimizer is not self.optimizer:  # the backward()s before it were its own, unless ours steps next
            self._claimed = len(self._losses)
            return
        session = self._follow()
        self.phase = None
        if not self._started:
            self._start()
        if session.tracker is not None:
            session.tracker.refresh_optimizer()
        session.steps += 1
        batch, epoch = self.batches.take()
        session.samples += batch
        # A GAN's discriminator and generator each step their own optimizer after their own backward(): the
        # losses since the other's step are this step's; none since (both step after one backward): all.
        losses = self._losses[self._claimed :] or self._losses
        if losses:
            self.loss, self.loss_source = self._read_losses(losses), "backward()"
        elif self._printed is not None:
            self.loss, self.loss_source = self._printed
        accumulation, self._losses, self._backwards, self._claimed = max(1, len(losses)), [], 0, 0
        self.unscaled.clear()  # scaled losses never backpropagated (or passed in a list) end here
        session.publish(
            time.time(),
            epoch=epoch,
            loss=self.loss,
            batch_size=batch,
            micro_batch=batch // accumulation if batch else 0,
            accumulation=accumulation,
            amp=self.amp,
            checkpointing=False,
            loss_source=self.loss_source,
        )
        self._start_step()
        self._boundary()

    def _read_losses(self, losses: list[torch.Tensor]) -> float | None:
        """The step's backward() losses, summed where they are and read as fit reads its loss
        (engine/deferred.py): on CUDA a step late, never waiting for the device."""
        device = losses[0].device
        total = torch.stack([t.float().sum().to(device) for t in losses]).sum()
        if self._reader is None or self._reader[0] != device.type:
            self._reader = device.type, DeferredLoss.for_device(device)
        return self._reader[1].put(total)

    def _start_step(self) -> None:
        assert self.session is not None
        start = self.session.probe.start_step
        if start is not None:
            start()
        if self.session.tracker is not None:
            self.session.tracker.start_step()

    # -- the step boundary: what needs no loop ---------------------------------------------------------
    def _boundary(self) -> None:
        assert self.session is not None
        self._apply_queued()
        self.session.wait_while_paused(self._apply_queued, lambda: bool(self.hub.stop_signal))
        if self.hub.stop_signal and not self.stop_reason:  # SIGTERM/SIGINT under the TUI (runner.py)
            self.stop_reason, self.session.paused = self.hub.stop_signal, False
            self.session.emit("stopped", reason=f"{self.hub.stop_signal}: KeyboardInterrupt raised in the script")
            raise KeyboardInterrupt  # as that signal's Ctrl-C would under python

    def _apply_queued(self) -> None:
        assert self.session is not None
        for control in self.hub.controls.drain():
            if self.session.apply(control) is not None:
                continue
            if control.action != "stop":  # not in `refused`, and no own loop can apply it
                self.session.refuse(control, NEEDS_FIT)
            else:
                self.stop_reason, self.session.paused = "requested", False
                self.session.emit("stopped", control, reason="requested: KeyboardInterrupt raised in the script")
                raise KeyboardInterrupt  # in the script's thread, after its optimizer.step(): as Ctrl-C would

    # -- the end ---------------------------------------------------------------------------------------
    @staticmethod
    def is_oom(exc: BaseException) -> bool:
        return is_oom(exc)

    def diagnose(self, exc: BaseException) -> dict[str, Any]:
        """Where an OOM struck, the memory then, the largest tensors (the failed step's frames are
        still alive), and the remedies that fit; emitted as an event and returned."""
        where = user_frame(exc)
        phase = self.phase or self.failed_in or "forward"
        session = self._follow() if self.session is not None else None  # an OOM in the first step, after .cuda()
        memory = session.probe.read() if session is not None else None
        top = top_training_tensors(self._params(), self.optimizer) if session is not None else {"rows": []}
        details: dict[str, Any] = {
            "diagnosis": True,
            "phase": phase,
            "where": where,
            "message": first_line(exc),
            "memory": memory.to_json() if memory else None,
            "top": top["rows"][:8],
            "remedies": remedies(phase, memory),
            "recovered": False,
        }
        if session is None:
            return details  # before the first optimizer: no run to tell of it
        if not self._started and self.hub.runs == 0 and session.unmet is None:
            self._start()  # an OOM in an own loop's first step: the run began, and ends here
        if session.memory_history:  # --memory-history: the snapshot at the OOM, as fit takes it
            session.snapshot("oom")
        session.emit("oom", **details)
        return details

    def finish(self, error: str | None) -> None:
        """The end record. A KeyboardInterrupt (a Ctrl-C, or the one raised for a stop) ends the
        script as it would under python, but the run stopped (as fit's does), it did not fail."""
        if not self._started or self.session is None:
            return
        if error == "interrupted":  # a Ctrl-C (or gputui's stop raising one): stopped, as fit's is
            self.stop_reason, error = self.stop_reason or "interrupted", None
        if self.loss_source == "backward()" and self._reader is not None and error is None:
            self.loss = self._reader[1].last()  # the run's last loss exactly, as fit returns it
        s = self.session
        s.end(
            RunSummary(
                steps=s.steps,
                epochs=self.batches.epochs_done,
                samples=s.samples,
                loss=finite(self.loss),
                stopped=self.stop_reason,
                amp=self.amp,
                elapsed_s=s.elapsed(),
                error=error,
            )
        )


def parameters_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """The device of the optimizer's first parameter (CPU without one): one attribute read a step."""
    params = next((group["params"] for group in optimizer.param_groups if group["params"]), None)
    return params[0].device if params else torch.device("cpu")
