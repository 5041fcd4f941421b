"""Recognising an out-of-memory error, and putting the RNG back so a retry replays the same step."""

from __future__ import annotations

import random
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch

# Errors that are out-of-memory in all but type: cuBLAS/cuDNN, the MPS backend and the CPU
# allocator raise plain RuntimeErrors when memory cannot be had.
_OOM_TEXTS = (
    "out of memory",
    "can't allocate memory",  # the CPU allocator
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _OOM_TEXTS)


def drop(exc: BaseException) -> str:
    """The one line worth keeping of an OOM; its frames are cleared so the tensors they hold die.

    The traceback keeps every frame of the failed step alive, and with them its activations:
    the classic reason memory does not come back after a caught OOM.
    """
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    traceback.clear_frames(exc.__traceback__)
    exc.__traceback__ = None
    exc.__context__ = None
    return message


@dataclass
class OomInfo:
    phase: str  # "forward", "backward" or "optimizer"
    message: str
    micro_batch: int
    allocated_before: int


class RngState:
    """Every generator a step may draw from (torch CPU and device, Python, NumPy if loaded)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.torch = torch.get_rng_state()
        self.python = random.getstate()
        self.accel: Any = None
        if device.type == "cuda":
            self.accel = torch.cuda.get_rng_state(device)
        elif device.type == "mps":
            self.accel = torch.mps.get_rng_state()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        random.setstate(self.python)
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(self.accel, self.device)
        elif self.device.type == "mps":
            torch.mps.set_rng_state(self.accel)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
