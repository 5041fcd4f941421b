"""The memory probe for a training device: CUDA allocator, MPS allocator, or tracked CPU state."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..telemetry.sample import Memory
from .cpu import CpuProbe, StateTracker


class Probe(Protocol):
    name: str

    def start_step(self) -> None: ...
    def allocated(self) -> int: ...
    def read(self) -> Memory: ...
    def free_cache(self) -> dict[str, Any]: ...


def for_device(device: torch.device, tracker: StateTracker | None) -> Probe:
    if device.type == "cuda":
        from .cuda import CudaProbe
        return CudaProbe(device, tracker)
    if device.type == "mps":
        from .mps import MpsProbe
        return MpsProbe(device, tracker)
    if tracker is None:
        raise ValueError("a CPU device is read through a StateTracker")
    return CpuProbe(tracker)
