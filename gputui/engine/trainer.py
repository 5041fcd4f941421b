"""gputui.Trainer: the script keeps its loop (evaluation, logging, checkpoints, early stopping), gputui
owns the step: the boundary (controls, pause, stop; the exchange under torchrun), micro-batching, AMP,
checkpointing, OOM recovery with exact replay, telemetry. As Accelerate and Lightning Fabric keep
the user's loop, with the remedies live.

    with gputui.Trainer(model, optimizer, step, micro_batch=8, clip_grad_norm=1.0) as trainer:
        for batch in data:
            result = trainer.step(batch)
            if result.stopped:  # q, Ctrl-C or SIGTERM: this step was trained, save and leave
                break
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ..telemetry.controls import AMP_MODES
from .core import Core
from .options import FitOptions, positive
from .result import FitError, FitResult

STATE_VERSION = 1
"""The layout of Trainer.state_dict(); a newer one is refused with a line, not misread."""


class StepResult:
    """What one trainer.step() did. `loss` and `grad_norm` are read from the device when asked for (a
    sync on CUDA), not before: a loop that logs every 100 steps keeps the GPU's run-ahead.

    `steps`: the run's steps so far (the screen's step number); `ooms_recovered`: OOMs this step
    recovered from (its micro-batch then smaller); `stopped`: why the run stops after this step (q,
    Ctrl-C, SIGTERM), else None; `trained`: False when a stop came before the step began (nothing
    trained; `loss` is None)."""

    __slots__ = ("_loss", "_grad_norm", "micro_batch", "ooms_recovered", "steps", "stopped", "trained")

    def __init__(
        self,
        loss: torch.Tensor | None,
        grad_norm: torch.Tensor | float | None,
        micro_batch: int,
        ooms_recovered: int,
        steps: int,
        stopped: str | None,
        trained: bool,
    ) -> None:
        self._loss, self._grad_norm = loss, grad_norm
        self.micro_batch, self.ooms_recovered, self.steps = micro_batch, ooms_recovered, steps
        self.stopped, self.trained = stopped, trained

    @property
    def loss(self) -> float | None:
        """The global batch's loss (its items' mean with `items=`)."""
        return None if self._loss is None else float(self._loss)

    @property
    def grad_norm(self) -> float | None:
        """The gradients' total norm before clipping (with `clip_grad_norm=`)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def __repr__(self) -> str:
        return (
            f"StepResult(steps={self.steps}, loss={self.loss}, grad_norm={self.grad_norm}, micro_batch="
            f"{self.micro_batch}, ooms_recovered={self.ooms_recovered}, stopped={self.stopped!r})"
        )


class Trainer:
    """One global step at a time, gputui's way; see the module's docstring and the README ("Your own loop").

    The options are fit()'s that concern a step, checked the same way; `steps`: how many steps the run
    is expected to take in all (the screen's "step N/M" and ETA; after a resume, the same total). Use it
    as a context manager: the run closes at the end of the block (else call close()). A process's fit
    calls and Trainers are one run on screen (engine/continuity.py).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: Callable[[nn.Module, Any], torch.Tensor],
        *,
        steps: int | None = None,
        scheduler: Any = None,
        micro_batch: int | str | None = None,
        amp: str = "off",
        checkpointing: bool | None = None,
        checkpoint_modules: Sequence[nn.Module] | None = None,
        device: str | torch.device | None = None,
        memory_budget: int | str | None = None,
        gpu_memory_limit: int | str | None = None,
        auto_recover: bool = True,
        metrics: str | os.PathLike[str] | None = None,
        memory_history: bool = False,
        snapshot_dir: str | os.PathLike[str] = "gputui-snapshots",
        distributed: str = "auto",
        items: Callable[[Any], Any] | None = None,
        planning: str = "auto",
        clip_grad_norm: float | None = None,
        rank_timeout: float = 600.0,
    ) -> None:
        positive("steps", steps)
        if isinstance(step, torch.optim.Optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("gputui.Trainer takes (model, optimizer, step): the optimizer comes before the step")
        options = FitOptions(
            clip_grad_norm=clip_grad_norm,
            rank_timeout=rank_timeout,
            scheduler=scheduler,
            micro_batch=micro_batch,
            amp=amp,
            checkpointing=checkpointing,
            checkpoint_modules=checkpoint_modules,
            device=device,
            memory_budget=memory_budget,
            gpu_memory_limit=gpu_memory_limit,
            auto_recover=auto_recover,
            metrics=metrics,
            memory_history=memory_history,
            snapshot_dir=snapshot_dir,
            distributed=distributed,
            items=items,
            planning=planning,
        )
        self._core = Core(model, step, optimizer, options)
        self._core.by = "Trainer"
        self._steps = steps
        self._run: contextlib.ExitStack | None = None
        self._closed = False
        self._stop_said: str | None = None  # a result said stopped: the loop should have left

    # -- the run ----------------------------------------------------------------------------
    def __enter__(self) -> Trainer:
        self._open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close(exc, exchange=True)

    def _close(self, exc: tuple[Any, ...], *, exchange: bool) -> None:
        """End the part; `exchange`: the loop ended, so under torchrun a closing exchange says a failure
        after its last step (not when the script ended with the trainer open: _end_unclosed)."""
        run, self._run = self._run, None
        self._closed = True
        if run is None:
            return
        if exc[0] is None and exchange:
            try:
                self._core.strategy.end(self._core.state.epochs_done)
            except BaseException as error:
                if not run.__exit__(type(error), error, error.__traceback__):
                    raise
                return
        run.__exit__(*exc)  # an error that ends the block is the run's error too

    def close(self) -> None:
        """End this trainer's part of the run (the process's run ends with the script)."""
        self.__exit__(None, None, None)

    def _open(self) -> None:
        if self._run is None:
            run = contextlib.ExitStack()
            run.enter_context(self._core.running(total_steps=self._steps))
            self._run = run
            self._core.hub.on_finish(partial(_end_unclosed, weakref.ref(self)))  # weak: a dropped trainer ended

    # -- one step ---------------------------------------------------------------------------
    def step(self, batch: Any) -> StepResult:
        """Train one global batch (a step of the run); see StepResult for what it returns."""
        if self._closed:
            raise FitError("trainer.step() after the trainer was closed: make a new gputui.Trainer to go on")
        if self._stop_said is not None:
            raise FitError(
                f"trainer.step() after the run was asked to stop ({self._stop_said}): leave the loop when "
                "the result's `stopped` is set (save first, if you save)"
            )
        if batch is None:
            raise TypeError("trainer.step() needs a batch, got None")
        self._open()
        core = self._core
        ooms = core.state.ooms_recovered
        trained = core.step(batch)
        stopped = core.stop_asked()
        if stopped is not None:
            self._stop_said = stopped
        state = core.state
        return StepResult(
            core.runner.loss if trained else None,
            core.runner.grad_norm if trained else None,
            state.micro_batch_now(),
            state.ooms_recovered - ooms,
            state.steps,
            stopped,
            trained,
        )

    def result(self) -> FitResult:
        """This trainer's figures so far, as fit() returns them (the last loss read from the device)."""
        return self._core.result()

    # -- resume -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as this one would: the setting in use (found by the keys or
        after OOMs), the GradScaler, the step and sample counters, the planner's calibration. Plain data
        and tensors: torch.save it beside the model and optimizer, torch.load(weights_only=True) loads it."""
        core = self._core
        state, session, scaler = core.state, core.session, core.precision.scaler
        return {
            "version": STATE_VERSION,
            "steps": session.steps,
            "samples": session.samples,
            "micro_batch": state.micro_batch,
            "amp": core.precision.mode,
            "checkpointing": core.checkpointing.enabled,
            "auto_recover": state.auto_recover,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "planner": core.planning.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Go on from a state_dict(): before the first step (ValueError after it, or for what is not one)."""
        if not isinstance(saved, dict) or "steps" not in saved:
            raise ValueError(f"load_state_dict() takes what Trainer.state_dict() returned, got {type(saved).__name__}")
        if saved.get("version") != STATE_VERSION:
            raise ValueError(f"this state_dict is version {saved.get('version')!r}; gputui reads {STATE_VERSION}")
        _check_state(saved)
        core = self._core
        if core.session.steps != core.first_step:
            raise ValueError("load_state_dict() must come before the first trainer.step()")
        core.setting.apply(saved["micro_batch"], saved["amp"], saved["checkpointing"])
        core.state.auto_recover = bool(saved["auto_recover"])
        scaler = core.precision.scaler
        if scaler is not None and saved.get("scaler"):
            scaler.load_state_dict(saved["scaler"])
        session = core.session
        session.steps, session.samples = int(saved["steps"]), int(saved["samples"])
        core.first_step, core.first_samples = session.steps, session.samples
        core.planning.load_state_dict(saved.get("planner"))


def _check_state(saved: dict[str, Any]) -> None:
    """Each field Trainer.state_dict() writes, of the kind it writes (an edited or foreign dict is said
    field by field, not trained on: steps=-5 would count on from -4)."""

    def wrong(field: str, what: str) -> ValueError:
        return ValueError(f"this state_dict's {field!r} must be {what}, got {saved[field]!r}")

    for field in ("steps", "samples", "micro_batch", "amp", "checkpointing", "auto_recover"):
        if field not in saved:
            raise ValueError(f"this state_dict has no {field!r}: load what Trainer.state_dict() returned")
    for field in ("steps", "samples"):
        value = saved[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise wrong(field, "an int >= 0")
    mb = saved["micro_batch"]
    if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
        raise wrong("micro_batch", "a positive int or None")
    if saved["amp"] not in AMP_MODES:
        raise wrong("amp", f"one of {', '.join(AMP_MODES)}")
    for field in ("checkpointing", "auto_recover"):
        if not isinstance(saved[field], bool):
            raise wrong(field, "True or False")


def _end_unclosed(ref: weakref.ref[Trainer]) -> None:
    """The script ended with this trainer open (no `with`, no close()): its part ends now, before the run's
    end record (its summary, the metrics file's end line). No closing exchange: an error may have ended the
    script, not its loop."""
    trainer = ref()
    if trainer is not None:
        trainer._close((None, None, None), exchange=False)
