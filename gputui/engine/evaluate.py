"""evaluate(): a model's mean metric over data with training's safety (micro-batches weighted as
training weighs them, an OOM replayed at a smaller micro-batch, the run's AMP), published into the
run's hub as an `eval` event."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..step.microbatch import batch_size, to_device
from ..step.precision import Precision
from ..step.sizing import Sizing
from ..telemetry import hub as hubs
from ..telemetry.events import check_event
from ..telemetry.sample import Event, finite
from .oom import drop, is_oom
from .options import positive, resolve_device
from .result import FitError
from .runner import count


def evaluate(
    model: nn.Module,
    data: Iterable[Any],
    fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    micro_batch: int | None = None,
    items: Callable[[Any], Any] | None = None,
    amp: str | None = None,
    device: str | torch.device | None = None,
) -> float:
    """The mean of `fn(model, batch)` (a scalar: the batch's mean) over `data`, weighted by each batch's
    samples or, with `items`, by what its mean is over (tokens that count), under `torch.no_grad()` in
    eval mode (the model's mode is restored after). `micro_batch`: each batch in pieces of this many
    samples; an OOM halves it and replays the batch. `amp=None`: the installed run's AMP setting (off
    with no run). `device=None`: the model's. Published as an `eval` event where a hub is installed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(fn):
        raise TypeError("fn must be a function fn(model, batch) -> a scalar tensor (the batch's mean)")
    if not hasattr(data, "__iter__"):
        raise TypeError(f"data must be an iterable of batches, got {type(data).__name__}")
    if items is not None and not callable(items):
        raise TypeError(f"items must be a function items(batch) -> count, got {type(items).__name__}")
    positive("micro_batch", micro_batch)
    hub = hubs.current()
    device = resolve_device(device) if device is not None else _device_of(model)
    precision = Precision(device, amp if amp is not None else _run_amp(hub))  # ValueError for an unknown mode
    evaluation = _Evaluation(model, fn, items, device, precision, micro_batch)
    started = time.perf_counter()
    # Each module's own mode comes back, not only the model's: a layer a script froze in eval mode
    # stays in it (train() first, for a model whose train() does more than set the flags).
    training = model.training
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            value = evaluation.run(data)
    finally:
        model.train(training)
        for module, mode in modes:
            module.training = mode
    if hub is not None:
        details = evaluation.details(value, time.perf_counter() - started)
        check_event("eval", details)
        hub.emit(Event("eval", hub.last_step(), details))
    return value


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _run_amp(hub: hubs.Hub | None) -> str:
    """The AMP the run in this process trains with now: its latest step's (off before any, or with no run)."""
    latest = hub.latest() if hub is not None else None
    return latest.amp if latest is not None else "off"


class _Evaluation:
    """One evaluate() call: the weighted sum kept on the device (read once, at the end) and the
    micro-batch, which stays halved for the batches after an OOM."""

    def __init__(
        self,
        model: nn.Module,
        fn: Callable[[nn.Module, Any], torch.Tensor],
        items: Callable[[Any], Any] | None,
        device: torch.device,
        precision: Precision,
        micro_batch: int | None,
    ) -> None:
        self.model, self.fn, self.items, self.device, self.precision = model, fn, items, device, precision
        self.micro_batch = micro_batch
        # float64 keeps a long evaluation's sum as exact as its float32 means; MPS has no float64.
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        self.sizing = Sizing()  # eval mode: BatchNorm uses its running statistics, so one sample is a batch
        self.total: torch.Tensor | None = None
        self.weight = self.batches = self.samples = self.ooms = 0

    def run(self, data: Iterable[Any]) -> float:
        for batch in data:
            n = batch_size(batch)
            while True:
                size = min(self.micro_batch or n, n)
                try:
                    part, weight = self._batch(batch, n, size)
                    break
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    message = drop(exc)  # the failed pieces' tensors die with its frames
                self._halve(size, message)
            if part is not None:
                self.total = part if self.total is None else self.total + part
            self.weight += weight
            self.batches += 1
            self.samples += n
        if not self.batches:
            raise FitError("data yielded no batches: nothing to evaluate")
        if self.total is None or not self.weight:
            raise FitError("items(batch) counted nothing in any batch: there is no mean to take")
        return float(self.total) / self.weight  # the one device sync

    def _batch(self, batch: Any, n: int, size: int) -> tuple[torch.Tensor | None, int]:
        """The batch's weighted sum of piece means (None if no piece has items), and its weight."""
        pieces = self.sizing.split(batch, size, n)
        if self.items is None:
            counts = self.sizing.cut(n, size)
        else:
            counts = [count(self.items, piece) for piece in pieces]
        part = None
        for piece, units in zip(pieces, counts, strict=True):
            if not units:  # a mean over nothing is NaN, and weighs nothing
                continue
            term = self._forward(piece).detach().to(self.dtype) * units
            part = term if part is None else part + term
        return part, sum(counts)

    def _forward(self, piece: Any) -> torch.Tensor:
        with self.precision.autocast():
            value = self.fn(self.model, to_device(piece, self.device))
        if not isinstance(value, torch.Tensor):
            raise FitError(
                f"fn(model, batch) must return a scalar tensor (the batch's mean), got {type(value).__name__}"
            )
        if value.numel() != 1:
            raise FitError(
                f"fn(model, batch) must return a scalar (the mean over the batch), got a tensor of shape "
                f"{tuple(value.shape)}: reduce it with .mean()"
            )
        return value

    def _halve(self, size: int, message: str) -> None:
        """After an OOM at `size`: the micro-batch the batch replays at, or the FitError at the floor."""
        if not self.sizing.can_halve(size):
            raise FitError(
                f"out of memory in evaluate() at micro-batch {size}: not even one sample fits. Try AMP "
                f"(amp='bf16'), a shorter sequence or more memory ({message})"
            )
        self.micro_batch = self.sizing.halved(size)
        self.ooms += 1

    def details(self, value: float, seconds: float) -> dict[str, Any]:
        return {
            "value": finite(value),
            "batches": self.batches,
            "samples": self.samples,
            "items": self.weight if self.items is not None else None,
            "seconds": round(seconds, 3),
            "micro_batch": self.micro_batch,
            "ooms": self.ooms,
        }
