"""Mixed precision for a step: the autocast dtype, and a GradScaler while fp16 is on."""

from __future__ import annotations

import contextlib
import inspect
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..telemetry.controls import AMP_MODES

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WAITING_DEVICES = frozenset({"cuda"})
"""Where reading a tensor's value (.item()) waits for the device's queued work."""


_OFF = contextlib.nullcontext()  # reusable: one made at each step's forward costs a call


def autocast(device: torch.device, mode: str) -> AbstractContextManager[Any]:
    """The autocast a step's forward runs under in `mode` (fit's step and the planner's trace)."""
    if mode == "off":
        return _OFF
    return torch.autocast(device.type, dtype=AMP_DTYPES[mode])


class Precision:
    """Autocast dtype, plus a GradScaler while fp16 is on (bf16 needs none)."""

    def __init__(self, device: torch.device, mode: str) -> None:
        self.device = device
        self.mode = "off"
        self.scaler: torch.amp.GradScaler | None = None
        self.set(self.resolve(mode))

    def resolve(self, mode: str) -> str:
        """ "auto": bf16 where the device runs it natively, else fp16 on a GPU, else off."""
        if mode != "auto":
            return mode
        if self.device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        if self.device.type == "mps":
            return "fp16"
        return "off"  # CPU autocast saves memory but usually costs speed: the user's call

    def unsupported(self, mode: str) -> str | None:
        """Why `mode` cannot run on this device, or None."""
        if mode not in AMP_MODES:
            return f"unknown AMP mode {mode!r} (choose from {', '.join(AMP_MODES)} or auto)"
        if mode == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(self.device)} has no bf16 support"
        return None

    def set(self, mode: str) -> None:
        reason = self.unsupported(mode)
        if reason:
            raise ValueError(reason)
        self.mode = mode
        # A fresh scaler for each fp16 period: a scale learned before is stale after a switch.
        self.scaler = torch.amp.GradScaler(self.device.type) if mode == "fp16" else None

    def autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.device, self.mode)


def unfused_fix(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Under fp16, GradScaler.step() reads whether any gradient overflowed with .item() (`_maybe_opt_step`),
    so each step waits for the GPU, unless the optimizer unscales and skips inside its own step
    (`_step_supports_amp_scaling`: torch's fused ones, which GradScaler hands the scale and the overflow flag
    as tensors). The one-line fix for an optimizer whose class has that mode and was made without it; None
    where there is none to give. The optimizer is the script's: never rebuilt here."""
    if device.type not in WAITING_DEVICES or getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    cls = type(optimizer)
    try:
        accepts = "fused" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a signature Python cannot read
        return None
    where = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    return f"{where}.{cls.__qualname__}(..., fused=True)" if accepts else None
