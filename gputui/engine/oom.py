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
    """The generators a step may draw from, as they were at its start: torch's (CPU and the
    device) always; Python's `random` and NumPy's global one when `host` (see Generators)."""

    def __init__(self, device: torch.device, host: bool = True) -> None:
        self.device = device
        self.torch = torch.get_rng_state()
        self.accel: Any = None
        if device.type == "cuda":
            self.accel = torch.cuda.get_rng_state(device)
        elif device.type == "mps":
            self.accel = torch.mps.get_rng_state()
        self.python = random.getstate() if host else None
        numpy = sys.modules.get("numpy") if host else None
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(self.accel, self.device)
        elif self.device.type == "mps":
            torch.mps.set_rng_state(self.accel)
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


class Generators:
    """Saves, at each step's start, what a replay of the step needs.

    Python's `random.getstate()` alone costs more than the rest of the save (625 ints a call,
    tens of microseconds in a training loop), and few steps draw from it or from NumPy's global
    generator: their data pipelines do, before the step. So the first steps and every
    `CHECK_EVERY`-th save them and look afterwards whether the step drew from them; from the
    first step seen drawing, every step saves them.
    """

    CHECK_EVERY = 50

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_drawn = False
        self._saves = 0
        self._checking: RngState | None = None

    def save(self) -> RngState:
        self._saves += 1
        check = not self.host_drawn and (self._saves <= 3 or self._saves % self.CHECK_EVERY == 0)
        state = RngState(self.device, host=self.host_drawn or check)
        self._checking = state if check else None
        return state

    def completed(self) -> None:
        """The step saved last has completed: note whether it drew from Python's or NumPy's generator."""
        state, self._checking = self._checking, None
        if state is None:
            return
        numpy = sys.modules.get("numpy")
        drew_numpy = numpy is not None and state.numpy is not None and not _same_numpy(
            state.numpy, numpy.random.get_state())
        if random.getstate() != state.python or drew_numpy:
            self.host_drawn = True


def _same_numpy(a: Any, b: Any) -> bool:
    """NumPy's legacy state tuple: (name, keys array, pos, has_gauss, cached_gaussian)."""
    return a[2] == b[2] and a[3] == b[3] and bool((a[1] == b[1]).all())
