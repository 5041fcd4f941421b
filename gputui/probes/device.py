"""The memory probe for a training device: CUDA allocator, MPS allocator, or tracked CPU state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..telemetry.sample import Memory
from .cpu import CpuProbe, StateTracker


class Probe(Protocol):
    name: str
    over_limit: dict[str, int] | None  # a CUDA cap that memory already held exceeds (cuda.py)

    @property
    def start_step(self) -> Callable[[], None] | None: ...  # at a step's start; None: nothing to do (no call)

    def allocated(self) -> int: ...
    def capacity(self) -> int | None: ...
    def read(self) -> Memory: ...
    # After a step (`now`: the publisher's monotonic clock): None where the last reading stands.
    def step_reading(self, now: float) -> Memory | None: ...
    def free_cache(self) -> dict[str, Any]: ...
    def after_oom(self, baseline: int) -> None: ...
    def close(self) -> None: ...


def for_device(
    device: torch.device, tracker: StateTracker | None, *, limit: int | None = None, nvml: Any = None
) -> Probe:
    """`limit` (CUDA only) makes the device act smaller; `nvml` adds NVML's view (an NvmlView)."""
    if limit is not None and device.type != "cuda":
        raise ValueError(
            f"gpu_memory_limit needs a CUDA device, not {device.type}: "
            "on a CPU use memory_budget to act as if memory were short"
        )
    if device.type == "cuda":
        from .cuda import CudaProbe

        return CudaProbe(device, tracker, limit=limit, nvml=nvml)
    if device.type == "mps":
        from .mps import MpsProbe

        return MpsProbe(device, tracker)
    if tracker is None:
        raise ValueError("a CPU device is read through a StateTracker")
    return CpuProbe(tracker)
