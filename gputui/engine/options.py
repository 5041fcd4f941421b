"""fit()'s options, checked once before anything is built, and the device they name."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None picks cuda, then mps, then cpu; "cuda" means the current CUDA device."""
    if device is None:
        if torch.cuda.is_available():
            device = "cuda"
        elif torch.backends.mps.is_available():
            device = "mps"
        else:
            device = "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but CUDA is not available here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device='mps' was asked for, but MPS is not available here")
    if device.type not in ("cuda", "mps", "cpu"):
        raise ValueError(f"device='{device}' is not one gputui trains on: cuda, mps or cpu")
    return device


def is_shared(mode: str, model: nn.Module) -> bool:
    """Train as one rank of several: under torchrun (WORLD_SIZE > 1), or given a model in DDP."""
    if mode == "off":
        return False
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or isinstance(model, torch.nn.parallel.DistributedDataParallel)


def length(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None


def positive(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


@dataclass(frozen=True)
class FitOptions:
    """fit()'s keyword arguments, checked once. The command line's settings (the hub's overrides)
    win over them in the RunSession, but for the metrics file: the command line's replaces fit's."""

    epochs: int | None = None
    max_steps: int | None = None
    scheduler: Any = None
    micro_batch: int | str | None = None
    amp: str = "off"
    checkpointing: bool | None = None  # None: as the model is (a Hugging Face model's own setting)
    checkpoint_modules: Sequence[nn.Module] | None = None
    device: str | torch.device | None = None
    memory_budget: int | str | None = None
    gpu_memory_limit: int | str | None = None
    auto_recover: bool = True
    metrics: str | os.PathLike[str] | None = None
    memory_history: bool = False
    snapshot_dir: str | os.PathLike[str] | None = None
    distributed: str = "auto"
    items: Callable[[Any], Any] | None = None
    planning: str = "auto"
    clip_grad_norm: float | None = None
    rank_timeout: float = 600.0

    def __post_init__(self) -> None:
        for name in ("epochs", "max_steps"):
            positive(name, getattr(self, name))
        if self.items is not None and not callable(self.items):
            raise TypeError(f"items must be a function items(batch) -> count, got {type(self.items).__name__}")
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip <= math.inf
        ):
            raise ValueError(
                f"clip_grad_norm must be a positive number (the largest gradient norm; inf: measure it, never "
                f"clip) or None, got {clip!r}"
            )
        timeout = self.rank_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"rank_timeout must be a positive number of seconds, got {timeout!r}")
        if self.micro_batch != "auto":
            positive("micro_batch", self.micro_batch)
        if self.distributed not in ("auto", "off", "fsdp"):
            raise ValueError(f'distributed must be "auto", "fsdp" or "off", got {self.distributed!r}')
        if self.planning not in ("auto", "asked", "off"):
            raise ValueError(f'planning must be "auto", "asked" or "off", got {self.planning!r}')
        if self.planning == "off" and self.micro_batch == "auto":
            raise ValueError('micro_batch="auto" needs the planner, and planning="off" never traces a step')
        if self.scheduler is not None:
            _check_scheduler(self.scheduler)
        for name, allowed in (("auto_recover", (True, False)), ("checkpointing", (True, False, None))):
            value = getattr(self, name)
            if not any(value is a for a in allowed):  # 1 or 0 would be carried on, and written back, as an int
                raise TypeError(f"{name} must be {' or '.join(map(str, allowed))}, got {value!r}")


def _check_scheduler(scheduler: Any) -> None:
    """One gputui steps once per trained step with no argument: a scheduler that needs one (a metric)
    would fail after the step's optimizer.step(), that step moved and not counted."""
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
    try:
        needed = [
            p.name
            for p in inspect.signature(step).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a builtin with no signature: taken as it is
        return
    if needed:
        raise ValueError(
            f"scheduler={type(scheduler).__name__} steps on a value ({', '.join(needed)}): gputui steps a scheduler "
            f"once a step with none. Step it yourself where that value is known (scheduler.step(val_loss) "
            f"after an evaluation) and pass no scheduler"
        )
