"""fit(): epochs of global batches, each trained by the core's one step (core.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .core import Core
from .options import FitOptions, length
from .result import FitError, FitResult


def fit(
    model: nn.Module,
    data: Iterable[Any],
    step: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int | None = None,
    max_steps: int | None = None,
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
) -> FitResult:
    """Train `model` on `data` with live remedies and OOM recovery; see the README for each argument.

    `epochs=None` means one epoch, or as many as `max_steps` needs when that is given; with
    both, training stops at whichever comes first. Options given on the gputui command line
    win over the same arguments here. `distributed="auto"`: under torchrun, every rank trains its
    share of each global batch through DistributedDataParallel (see engine/strategies/).
    `items(batch) -> count`: what the loss is a mean over (tokens that count); micro-batches are then
    weighted by their items, not their samples, so their gradients add up to the global batch's.
    `planning`: "auto" traces the step on fake tensors when it helps (after an OOM, near capacity,
    micro_batch="auto", a plan asked for), "asked" only for micro_batch="auto" and a plan asked for,
    "off" never (a trace runs step() once more: README, "The planner").
    `clip_grad_norm`: the largest total gradient norm; larger ones are scaled down to it after the last
    backward (unscaled first under fp16), before optimizer.step().
    `rank_timeout`: under torchrun, the seconds a rank waits for the others before the run ends with a
    FitError naming the ranks that stopped answering (README, "Under torchrun").
    """
    options = FitOptions(
        epochs=epochs,
        max_steps=max_steps,
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
        clip_grad_norm=clip_grad_norm,
        rank_timeout=rank_timeout,
    )
    if not hasattr(data, "__iter__"):
        raise TypeError(f"data must be an iterable of batches, got {type(data).__name__}")
    # said now, not after the first epoch; never by iterating it: a DataLoader's iterator draws its seed
    if epochs is not None and epochs > 1 and isinstance(data, Iterator):
        raise FitError(
            f"epochs={epochs}, but data is an iterator ({type(data).__name__}): it can be iterated only once; "
            "pass a DataLoader or a list, or set epochs=1"
        )
    core = Core(model, step, optimizer, options, data)
    epochs = epochs if epochs is not None else (1 if max_steps is None else None)
    per_epoch = length(data)
    with core.running(**_length(epochs, max_steps, per_epoch, core.first_step)):
        _epochs(core, data, epochs, max_steps)
    return core.result()


def _length(epochs: int | None, max_steps: int | None, per_epoch: int | None, before: int) -> dict[str, Any]:
    """How long the run is, as far as the data says (the ETA and "step N/M" on the screen); `before`: the
    steps an earlier fit call or Trainer of this process trained (the screen's step numbers go on)."""
    total = per_epoch * epochs if per_epoch is not None and epochs is not None else None
    if max_steps is not None:
        total = max_steps if total is None else min(total, max_steps)
    if total is not None:
        total += before
    planned = epochs
    if epochs is None and per_epoch and max_steps is not None:
        planned = math.ceil(max_steps / per_epoch)
    return {"epochs": planned, "max_steps": max_steps, "steps_per_epoch": per_epoch, "total_steps": total}


def _epochs(core: Core, data: Iterable[Any], epochs: int | None, max_steps: int | None) -> None:
    """Epochs of steps until the data, `max_steps` or a stop ends them; then the strategy's last word
    (under torchrun, a closing exchange: a failure after the last step reaches every rank)."""
    state, strategy = core.state, core.strategy
    if max_steps is not None:
        max_steps += core.first_step  # the session counts the process's steps
    epoch = 0
    while epochs is None or epoch < epochs:
        state.epoch = epoch
        strategy.set_epoch(epoch)
        trained = 0
        for batch, has_next in strategy.batches(data, lambda: max_steps is not None and state.steps + 1 >= max_steps):
            if not core.step(batch, has_next):
                return strategy.end(state.epochs_done)
            trained += 1
            if max_steps is not None and state.steps >= max_steps:
                if trained == length(data):
                    state.epochs_done += 1  # the last step was also the end of the epoch
                return strategy.end(state.epochs_done)
            if not core.more:
                break
        if trained == 0:
            if epoch == 0:
                raise FitError("data yielded no batches: nothing to train on")
            raise FitError(
                f"data yielded no batches in epoch {epoch + 1}: it can be iterated only once "
                "(a generator?); pass a DataLoader or a list, or set epochs=1"
            )
        state.epochs_done += 1
        epoch += 1
    strategy.end(state.epochs_done)
